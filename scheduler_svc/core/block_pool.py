"""The paged KV block pool and its prefix-cache index.

The executor owns the KV memory; this pool owns the bookkeeping of it: which block ids are in use
(and by how many requests), which free blocks still hold a reusable prefix, and in what order those
are evicted. Every operation on the scheduling hot path is O(1) per block touched: dicts, an
OrderedDict for the LRU order, a list used as a stack. Nothing here scans the whole pool, except the
inspection helpers at the bottom, which are for tests and debugging.

Prefix hashes. A full block's hash is SHA-256 over (parent block's hash, the block's token ids, an
extra key such as a per-tenant cache salt). The cache is shared across users, so a hash collision
would hand one user another user's KV; a cryptographic 256-bit digest makes a crafted collision
infeasible, where a fast non-cryptographic hash (xxhash, Python's hash) can be attacked. The pool
also keeps each registered block's token ids, so a hit is double-checked against the tokens at the
cost of one tuple comparison.

KV events. With `record_events()` the pool also logs what its prefix index gained and lost
(`BlockStored` on register, `BlockRemoved` on eviction, `CacheCleared` on reset), for a gateway
that routes requests to the replica holding their prefix. Stored events come from `register`,
which runs only after the step that wrote the block, so a subscriber never hears of KV that does
not exist yet.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

BlockHash = bytes  # a 32-byte SHA-256 digest
ExtraKey = str | bytes | None


@dataclass(frozen=True)
class BlockStored:
    block_hash: BlockHash
    parent_hash: BlockHash | None  # None: the first block of a sequence
    token_ids: tuple[int, ...]
    extra_key: ExtraKey  # the cache salt the hash was computed under


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: BlockHash


@dataclass(frozen=True)
class CacheCleared:
    pass


KVEvent = BlockStored | BlockRemoved | CacheCleared

# The parent of a sequence's first block. Fixed width like a real digest, so the hash input is
# unambiguous; no SHA-256 output is all zeros in practice.
_ROOT_PARENT_HASH = bytes(32)


def _encode_extra_key(extra_key: ExtraKey) -> bytes:
    # A type tag keeps None, "" and b"" distinct, and a length prefix keeps the extra key from
    # running into the token bytes.
    if extra_key is None:
        body, tag = b"", b"\x00"
    elif isinstance(extra_key, str):
        body, tag = extra_key.encode("utf-8"), b"\x01"
    elif isinstance(extra_key, bytes):
        body, tag = extra_key, b"\x02"
    else:
        raise TypeError(f"extra key must be str, bytes or None, got {type(extra_key).__name__}")
    return tag + len(body).to_bytes(4, "little") + body


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int], extra_key: ExtraKey = None) -> BlockHash:
    """SHA-256 of (parent hash, extra key, token ids): the identity of a full block's KV.

    The KV of a block depends on every token before it, which the parent hash stands for, so equal
    hashes mean equal prefixes up to and including this block.
    """
    digest = hashlib.sha256(parent_hash if parent_hash is not None else _ROOT_PARENT_HASH)
    digest.update(_encode_extra_key(extra_key))
    digest.update(len(token_ids).to_bytes(4, "little"))
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class KVBlock:
    """Bookkeeping for one KV block. Its id is the executor's block index."""

    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "parent_hash", "extra_key")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0  # requests whose block table holds this block
        # Set only while the block is in the prefix index: full, and its KV reported as written.
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None
        # What the hash was computed from besides the tokens, for a snapshot of the index.
        self.parent_hash: BlockHash | None = None
        self.extra_key: ExtraKey = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_count}, hash={cached})"


class BlockPool:
    """A fixed pool of `num_blocks` KV blocks with ref counts, a prefix index and LRU eviction.

    A block is in exactly one of three states:
    - used: ref_count > 0, in one or more block tables;
    - free and cached: ref_count == 0, still in the prefix index, reusable by a later hit, and
      evictable (it sits in `_cached_free`, least recently freed first);
    - free and empty: ref_count == 0, not in the index (`_empty_free`).
    Allocation takes empty blocks first and evicts cached ones only when there are none.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        # A stack; reversed so block 0 is handed out first, which makes small tests readable.
        self._empty_free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Insertion order is eviction order: the first entry is the least recently freed.
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._index: dict[BlockHash, int] = {}
        self._events: list[KVEvent] | None = None  # None: not recording
        # False: hand blocks out in the order the free lists give them (bench/block_order.py's
        # baseline); see `allocate`.
        self.ascending = True

    # ----- KV events -----

    def record_events(self) -> None:
        """Start logging index changes (idempotent); `take_events` hands them over."""
        if self._events is None:
            self._events = []

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, oldest first ([] when not recording)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    # ----- counts -----

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: empty ones plus evictable cached ones."""
        return len(self._empty_free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a prefix in the index."""
        return len(self._cached_free)

    @property
    def num_indexed_blocks(self) -> int:
        """Blocks in the prefix index, used or free."""
        return len(self._index)

    # ----- prefix index -----

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block for this hash, if its stored tokens also equal `token_ids`."""
        block_id = self._index.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        # With SHA-256 a mismatch should never happen; if it does, a miss is the safe answer.
        if block.token_ids != tuple(token_ids):
            return None
        return block

    def register(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int],
                 parent_hash: BlockHash | None = None, extra_key: ExtraKey = None) -> bool:
        """Put a full, executed block in the prefix index. False if the hash is already indexed.

        The caller (the scheduler's update) guarantees the block's KV has been written: see the
        invariant stated in `Scheduler._register_computed_blocks`. Two requests that computed the
        same prefix at once each hold their own copy; only the first copy is indexed, and the second
        stays private to its request and is freed as an empty block.
        """
        block = self.blocks[block_id]
        if block.ref_count < 1:
            raise ValueError(f"block {block_id} is free; only blocks in a block table can be registered")
        if len(token_ids) != self.block_size:
            raise ValueError(f"block {block_id}: only full blocks are cached, got {len(token_ids)} tokens")
        if block.block_hash is not None:
            raise ValueError(f"block {block_id} is already registered")
        if block_hash in self._index:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.parent_hash, block.extra_key = parent_hash, extra_key
        self._index[block_hash] = block_id
        if self._events is not None:
            self._events.append(BlockStored(block_hash, parent_hash, block.token_ids, extra_key))
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix.

        Free cached blocks become empty. Used blocks keep their KV for the requests that hold them
        (it is still valid for them) but leave the index, so no new request can share them; when
        freed they become empty blocks. O(pool size); not on the hot path.
        """
        for block_id in self._index.values():
            block = self.blocks[block_id]
            block.block_hash = None
            block.token_ids = block.parent_hash = block.extra_key = None
        self._index.clear()
        self._empty_free.extend(self._cached_free)
        self._cached_free.clear()
        if self._events is not None:
            self._events.append(CacheCleared())

    # ----- allocation -----

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks, each with ref count 1. Empty blocks go first.

        They are returned in ascending id order, whatever order the free lists gave them in.
        Which blocks are taken is the eviction policy's choice; the order they take in a block
        table is not, and it decides how fast attention reads them: blocks of consecutive ids
        are consecutive in memory, so a table in ascending runs reads as one forward stream,
        where one in descending runs or scattered makes the CPU's prefetcher start over at every
        block. Evicted chains come off the LRU list tail first (see `release`), i.e. in
        descending order, so without the sort a pool full of cached blocks hands out mostly
        descending tables: on the seed workload's tables the CPU decode kernel was 1.18-1.27x
        slower with them (bench/block_order.py, bench/RESULTS.md section 2)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {self.num_free_blocks} free")
        taken: list[int] = []
        for _ in range(num_blocks):
            if self._empty_free:
                block_id = self._empty_free.pop()
            else:
                block_id, _ = self._cached_free.popitem(last=False)  # evict the least recently freed
                self._evict(self.blocks[block_id])
            self.blocks[block_id].ref_count = 1
            taken.append(block_id)
        if self.ascending:
            taken.sort()
        return taken

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self._index[block.block_hash]
        if self._events is not None:
            self._events.append(BlockRemoved(block.block_hash))
        block.block_hash = None
        block.token_ids = block.parent_hash = block.extra_key = None

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each of these cached blocks (a prefix-cache hit)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                # It was free and cached: it is now in use and no longer evictable.
                del self._cached_free[block_id]
            block.ref_count += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block of a request's block table.

        The table is walked tail first, so when a whole chain becomes free its tail blocks are queued
        for eviction before its head blocks: the head is a prefix of more sequences (every longer
        prompt that starts the same way shares it), so it is worth keeping longer.
        """
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count < 1:
                raise ValueError(f"block {block_id} released more often than acquired")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._cached_free[block_id] = None  # most recently freed: evicted last
                else:
                    self._empty_free.append(block_id)

    # ----- inspection (tests, debugging); O(pool size) -----

    def free_block_ids(self) -> list[int]:
        """Every free block id: empty ones, then cached ones in eviction order."""
        return list(self._empty_free) + list(self._cached_free)

    def cached_free_block_ids(self) -> list[int]:
        """Free cached block ids in eviction order (first evicted first)."""
        return list(self._cached_free)

    def index_items(self) -> Iterator[tuple[BlockHash, KVBlock]]:
        for block_hash, block_id in self._index.items():
            yield block_hash, self.blocks[block_id]

    def snapshot_events(self) -> list[KVEvent]:
        """The index as events: a reset, then every indexed block in registration order (so a
        block's parent, when indexed, comes before it)."""
        return [CacheCleared(), *(BlockStored(h, b.parent_hash, b.token_ids or (), b.extra_key)
                                  for h, b in self.index_items())]
