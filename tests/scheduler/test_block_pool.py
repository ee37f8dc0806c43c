import pytest

from scheduler_svc.core import BlockPool, hash_block_tokens


def chain_hashes(tokens, block_size, salt=None):
    hashes, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size], salt)
        hashes.append(parent)
    return hashes


def fill_and_register(pool, tokens):
    """Allocate a chain for `tokens` (full blocks only) and register every block."""
    bs = pool.block_size
    ids = pool.allocate(len(tokens) // bs)
    hashes = chain_hashes(tokens, bs)
    for i, (b, h) in enumerate(zip(ids, hashes)):
        assert pool.register(b, h, tokens[i * bs : (i + 1) * bs], hashes[i - 1] if i else None)
    return ids


def test_hash_depends_on_parent_tokens_and_extra_key():
    tokens = [1, 2, 3, 4]
    base = hash_block_tokens(None, tokens)
    assert len(base) == 32  # SHA-256
    assert base == hash_block_tokens(None, list(tokens))
    assert base != hash_block_tokens(None, [1, 2, 3, 5])
    assert base != hash_block_tokens(base, tokens)
    assert base != hash_block_tokens(None, tokens, "tenant-a")
    assert hash_block_tokens(None, tokens, "tenant-a") != hash_block_tokens(None, tokens, "tenant-b")
    # None, "" and b"" are different keys; so are the str and bytes spellings of one salt.
    assert len({hash_block_tokens(None, tokens, k) for k in (None, "", b"", "x", b"x")}) == 5


def test_allocate_release_and_counts():
    pool = BlockPool(num_blocks=8, block_size=4)
    ids = pool.allocate(3)
    assert ids == [0, 1, 2]
    assert [pool.blocks[b].ref_count for b in ids] == [1, 1, 1]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (5, 3)
    pool.release(ids)
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_free_blocks) == (8, 0, 0)
    with pytest.raises(ValueError, match="released more often"):
        pool.release([0])
    with pytest.raises(ValueError, match="only 8 free"):
        pool.allocate(9)


def test_register_only_full_used_blocks():
    pool = BlockPool(num_blocks=4, block_size=4)
    (b,) = pool.allocate(1)
    with pytest.raises(ValueError, match="only full blocks"):
        pool.register(b, hash_block_tokens(None, [1, 2, 3]), [1, 2, 3])
    pool.release([b])
    with pytest.raises(ValueError, match="is free"):
        pool.register(b, hash_block_tokens(None, [1, 2, 3, 4]), [1, 2, 3, 4])


def test_lookup_double_checks_tokens():
    pool = BlockPool(num_blocks=4, block_size=4)
    tokens = [5, 6, 7, 8]
    (b,) = fill_and_register(pool, tokens)
    h = chain_hashes(tokens, 4)[0]
    assert pool.lookup(h, tokens).block_id == b
    # A (hypothetical) collision: same hash, other tokens. The stored tokens turn it into a miss.
    assert pool.lookup(h, [5, 6, 7, 9]) is None
    assert pool.lookup(hash_block_tokens(None, [0, 0, 0, 0]), [0, 0, 0, 0]) is None


def test_duplicate_hash_keeps_first_block_and_second_stays_private():
    pool = BlockPool(num_blocks=4, block_size=2)
    tokens = [1, 2]
    h = chain_hashes(tokens, 2)[0]
    first, second = pool.allocate(2)
    assert pool.register(first, h, tokens)
    assert not pool.register(second, h, tokens)
    assert pool.blocks[second].block_hash is None
    pool.release([first, second])
    assert pool.cached_free_block_ids() == [first]


def test_freed_blocks_stay_cached_and_a_hit_revives_them():
    pool = BlockPool(num_blocks=6, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    ids = fill_and_register(pool, tokens)
    pool.release(ids)
    assert pool.num_cached_free_blocks == 3 and pool.num_free_blocks == 6
    hit = pool.lookup(chain_hashes(tokens, 2)[0], [1, 2])
    pool.acquire([hit.block_id])
    assert hit.ref_count == 1 and pool.num_cached_free_blocks == 2 and pool.num_free_blocks == 5
    # Shared by a second holder: ref counts add up.
    pool.acquire([hit.block_id])
    assert hit.ref_count == 2
    pool.release([hit.block_id])
    assert hit.ref_count == 1 and hit.block_id not in pool.free_block_ids()


def test_empty_blocks_are_used_before_any_cached_block_is_evicted():
    pool = BlockPool(num_blocks=6, block_size=2)
    cached = fill_and_register(pool, [1, 2, 3, 4])
    pool.release(cached)
    fresh = pool.allocate(4)
    assert not set(fresh) & set(cached)
    assert pool.num_cached_free_blocks == 2  # nothing evicted yet


def test_blocks_are_handed_out_in_ascending_order_whichever_the_policy_picks():
    """Eviction takes a freed chain tail first, i.e. in descending ids; the blocks it picks are
    still the LRU policy's, but a block table gets them ascending (what the decode kernel reads
    fastest: bench/block_order.py)."""
    pool = BlockPool(num_blocks=12, block_size=2)
    a = fill_and_register(pool, list(range(1, 13)))  # a chain of 6 blocks
    b = fill_and_register(pool, list(range(13, 25)))
    pool.release(a)
    pool.release(b)
    lru = pool.cached_free_block_ids()
    assert lru[:6] == sorted(a, reverse=True)  # the order eviction takes them in
    taken = pool.allocate(5)
    assert taken == sorted(lru[:5])  # the same blocks as the policy picks, ascending
    # Empty and evicted blocks together: still one ascending list.
    pool.release(taken)
    pool.release(pool.allocate(1))
    mixed = pool.allocate(9)
    assert mixed == sorted(mixed) and len(set(mixed)) == 9


def test_eviction_is_lru_and_tail_first_within_a_chain():
    pool = BlockPool(num_blocks=6, block_size=2)
    a = fill_and_register(pool, [1, 2, 3, 4, 5, 6])  # blocks a0 a1 a2
    b = fill_and_register(pool, [7, 8, 9, 10, 11, 12])  # blocks b0 b1 b2
    pool.release(a)  # freed first: evicted first, tail before head
    pool.release(b)
    assert pool.cached_free_block_ids() == [a[2], a[1], a[0], b[2], b[1], b[0]]
    evicted = pool.allocate(2)
    assert sorted(evicted) == sorted([a[2], a[1]])  # handed out in ascending order (the test above)
    assert all(pool.blocks[x].block_hash is None for x in evicted)
    # a's head block is still cached and found; a's tail is gone from the index.
    a_hashes = chain_hashes([1, 2, 3, 4, 5, 6], 2)
    assert pool.lookup(a_hashes[0], [1, 2]).block_id == a[0]
    assert pool.lookup(a_hashes[2], [5, 6]) is None
    assert pool.num_indexed_blocks == 4


def test_a_hit_moves_a_block_to_most_recently_freed():
    pool = BlockPool(num_blocks=4, block_size=2)
    a = fill_and_register(pool, [1, 2])
    b = fill_and_register(pool, [3, 4])
    pool.release(a)
    pool.release(b)
    pool.acquire(a)  # a is reused...
    pool.release(a)  # ...and freed again after b: now b is older
    assert pool.cached_free_block_ids() == [b[0], a[0]]


def test_reset_prefix_cache_empties_the_index_but_keeps_used_blocks_owned():
    pool = BlockPool(num_blocks=6, block_size=2)
    kept = fill_and_register(pool, [1, 2, 3, 4])
    freed = fill_and_register(pool, [5, 6])
    pool.release(freed)
    pool.reset_prefix_cache()
    assert pool.num_indexed_blocks == 0 and pool.num_cached_free_blocks == 0
    assert pool.num_free_blocks == 4 and all(pool.blocks[b].ref_count == 1 for b in kept)
    assert all(block.block_hash is None for block in pool.blocks)
    pool.release(kept)
    assert pool.num_free_blocks == 6 and pool.num_cached_free_blocks == 0


# ---- KV events ---------------------------------------------------------------------------------


def test_kv_events_are_off_until_asked_for():
    pool = BlockPool(num_blocks=4, block_size=2)
    fill_and_register(pool, [1, 2, 3, 4])
    assert pool.take_events() == []


def test_kv_events_log_stores_evictions_and_resets_in_order():
    from scheduler_svc.core import BlockRemoved, BlockStored, CacheCleared

    pool = BlockPool(num_blocks=2, block_size=2)
    pool.record_events()
    h1, h2 = chain_hashes([1, 2, 3, 4], 2, salt="s")
    a, b = pool.allocate(2)
    assert pool.register(a, h1, [1, 2], None, "s") and pool.register(b, h2, [3, 4], h1, "s")
    assert pool.take_events() == [BlockStored(h1, None, (1, 2), "s"), BlockStored(h2, h1, (3, 4), "s")]
    assert pool.take_events() == []  # taken once
    pool.release([a, b])
    assert pool.take_events() == []  # freed but still cached: the index did not change
    pool.allocate(1)  # evicts the least recently freed, the chain's tail first
    assert pool.take_events() == [BlockRemoved(h2)]
    pool.reset_prefix_cache()
    assert pool.take_events() == [CacheCleared()]


def test_snapshot_lists_the_index_parents_first():
    from scheduler_svc.core import BlockStored, CacheCleared

    pool = BlockPool(num_blocks=4, block_size=2)
    fill_and_register(pool, [1, 2, 3, 4])
    h1, h2 = chain_hashes([1, 2, 3, 4], 2)
    snap = pool.snapshot_events()
    assert snap[0] == CacheCleared()
    assert snap[1:] == [BlockStored(h1, None, (1, 2), None), BlockStored(h2, h1, (3, 4), None)]
