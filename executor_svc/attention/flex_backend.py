"""FlexAttention backend: torch's FlexAttention reading the paged cache in place (no gather).

The whole cache of a layer is one key sequence of num_blocks * block_size slots; the step's T
query rows are one query sequence. Which slots a row may see is said twice, and both must agree:

- the block mask (sparsity): for each tile of Q_TILE query rows, the physical blocks of the
  requests whose rows are in that tile, each listed once (two requests sharing a cached prefix
  block name it once; a block listed twice would be attended twice). Built straight from the
  block tables, never by evaluating the mask over T x cache slots;
- the mask_mod (exactness): row q of request r sees slot s if s's block is r's logical block j
  and j * block_size + (s % block_size) <= the position of q. A per-step table maps each
  physical block to its one logical index (-1: nobody's in this step), and r's block table
  says whether the block at that index is this one.

So a chunk after a cached prefix sees the prefix and itself causally, a decode sees its whole
context, and slots other requests own are never read into a row's softmax. K/V are written
first by `write_kv` (rows at or after kv_write_start: never into cached blocks).

This is the torch fallback for CUDA when FlashInfer is missing (compiled by inductor into a
Triton kernel there; not yet run on a GPU). On CPU it runs too (inductor's C++ template when
compiled, else FlexAttention's dense eager reference), which is how its exactness is tested
here; it is not chosen on CPU by `auto`, where the paged decode kernel is several times faster.
On CPU it is a test path: each new step shape compiles anew, and past torch's recompile limit
(or with --enforce-eager) the dense reference scores every slot of the cache for every row.

Inductor's CPU template is not right everywhere: on an AVX2-only CPU (Zen 3) torch 2.13's kernel
returns wrong rows at block size 8 (errors of ~2-5 in the output; blocks of 2, 4, 16 and 32 are
right there, and 8 is right on AVX-512 CPUs). So on CPU the compiled backend first runs
`cpu_self_check`, a probe step at the cache's block size and dtype against the eager reference,
and the runner refuses the backend, naming the flag, if the two disagree.

Slots no request owns are multiplied by a zero weight, not skipped, inside a listed block (and
everywhere in the eager reference), so they must hold finite values: the cache is allocated
zeroed and only ever written with K/V, which keeps them so.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..kv_cache import write_kv
from .base import AttentionBackend, BatchLayout
from ..aot_package import use_chunkwise_inductor_cache

# Query rows per block-mask tile. Every row of a tile visits every block the tile lists, so a
# tile of decode rows from many requests does each row's work once per request in it: small
# tiles keep that waste down (16, as vLLM's FlexAttention backend uses with torch >= 2.9; here
# 128 made a 32-decode step 2.3x slower on CPU than 16, bench/cuda_step.py --device cpu).
Q_TILE = 16


def flex_attention_unavailable_reason(device: torch.device, block_size: int | None = None) -> str | None:
    """None if the FlexAttention backend can run here, else a sentence saying why not."""
    if device.type == "cpu" and block_size == 1:
        # torch 2.13's C++ FlexAttention template fails to compile KV tiles of one slot.
        return "on CPU it needs --block-size of at least 2 (inductor's CPU template)"
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:  # inductor's CUDA kernels
        return "triton is not importable (FlexAttention compiles to Triton on CUDA)"
    return None


def _tight_kv_indices(device: torch.device) -> bool:
    return device.type != "cpu"


@dataclass
class _FlexStep:
    row_request: torch.Tensor  # [T] int32 request index of each query row
    row_position: torch.Tensor  # [T] int32 position of each query row
    block_mask: BlockMask | None = None  # built by the first layer, which knows the cache size


def paged_block_mask(layout: BatchLayout, num_cache_blocks: int, row_request: torch.Tensor,
                     row_position: torch.Tensor) -> BlockMask:
    """The step's BlockMask over a cache of `num_cache_blocks` blocks (see the module docstring).

    Built on the host from the block tables (one copy of them back from the device, one copy of
    the result there), so its size is the step's, never requests x cache blocks."""
    bs, device = layout.block_size, layout.block_table.device
    num_rows, num_req = layout.num_tokens, layout.num_requests
    table = layout.block_table.cpu()  # [R, max blocks], padded with 0
    owned = torch.arange(table.shape[1]) < torch.tensor(layout.num_blocks).view(-1, 1)  # [R, max blocks]
    # logical[b]: the logical index physical block b has in the tables of this step, or -1. A
    # shared block is a prefix-cache hit, which is at the same logical index in every request that
    # holds it (the prefix hash chains from position 0); anything else would make one table for
    # all requests wrong, so it is refused, not attended.
    phys, cols = table[owned], owned.nonzero()[:, 1]
    logical = torch.full((num_cache_blocks,), -1, dtype=torch.int32)
    logical[phys] = cols.to(torch.int32)
    if not torch.equal(logical[phys], cols.to(torch.int32)):
        raise ValueError("a physical block sits at two different logical indices in this step's block tables")
    num_tiles = max(1, -(-num_rows // Q_TILE))
    tile_blocks: list[torch.Tensor] = []
    for t in range(num_tiles):
        lo, hi = t * Q_TILE, min((t + 1) * Q_TILE, num_rows)
        members = [r for r in range(num_req) if layout.query_start[r] < hi and layout.query_start[r + 1] > lo]
        rows = table[members][owned[members]]
        tile_blocks.append(torch.unique(rows))  # sorted, each block once
    # Entries of a kv_indices row past its kv_num_blocks are never read, so on CUDA the row is as
    # wide as the step's widest tile needs (as vLLM's FlexAttention backend sizes it). Inductor's
    # CPU template asserts a row as wide as the key sequence has blocks.
    width = max(1, max(len(b) for b in tile_blocks)) if _tight_kv_indices(device) else num_cache_blocks
    kv_indices = torch.zeros((1, 1, num_tiles, width), dtype=torch.int32)
    for t, blocks in enumerate(tile_blocks):
        kv_indices[0, 0, t, : len(blocks)] = blocks.to(torch.int32)
    kv_num_blocks = torch.tensor([len(b) for b in tile_blocks], dtype=torch.int32).view(1, 1, -1)
    logical_dev, table_dev = logical.to(device), layout.block_table.to(torch.int32)
    last_col = table.shape[1] - 1

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        r = row_request[q_idx]
        block = kv_idx // bs
        j = logical_dev[block]
        mine = (j >= 0) & (table_dev[r, j.clamp(0, last_col)] == block)
        # Columns of r's table past its own blocks (padding, or clamped) fail the position test:
        # a row's position is below its context length <= num_blocks * block_size.
        return mine & (j * bs + kv_idx % bs <= row_position[q_idx])

    return BlockMask.from_kv_blocks(kv_num_blocks.to(device), kv_indices.to(device), BLOCK_SIZE=(Q_TILE, bs),
                                    mask_mod=mask_mod, seq_lengths=(num_rows, num_cache_blocks * bs),
                                    compute_q_blocks=False)


class FlexAttentionBackend(AttentionBackend):
    name = "flex"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 compile: bool = True):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        # Compiled, FlexAttention is one fused kernel that honours the block mask's sparsity;
        # eager, it is the dense reference (every slot scored, then masked): exact but slow.
        self._attend: Any = None if compile else flex_attention

    def cpu_self_check(self, block_size: int, dtype: torch.dtype) -> str | None:
        """None if the compiled CPU kernel equals FlexAttention's eager reference on a probe step
        at this block size and dtype, else a sentence saying how far off it is. The probe: a
        prompt straddling query tiles, a chunk after a cached prefix, two decodes, over scattered
        blocks of a cache filled with random K/V."""
        if self._attend is flex_attention:  # eager: the reference itself
            return None
        g = torch.Generator().manual_seed(0)
        bs = block_size
        num_computed = [0, 2 * bs + 3, 3 * bs + 5, bs + 1]
        query_lens = [20, 13, 1, 1]
        context_lens = [c + n for c, n in zip(num_computed, query_lens)]
        num_blocks = [-(-c // bs) for c in context_lens]
        cache_blocks = sum(num_blocks) + 3
        order = torch.randperm(cache_blocks, generator=g)
        table = torch.zeros((len(num_blocks), max(num_blocks)), dtype=torch.int64)
        used = 0
        for r, n in enumerate(num_blocks):
            table[r, :n] = order[used: used + n]
            used += n
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        layout = BatchLayout(num_tokens=query_start[-1], block_size=bs, query_start=query_start,
                             num_computed=num_computed, context_lens=context_lens, num_blocks=num_blocks,
                             block_table=table, slot_mapping=torch.empty(0, dtype=torch.int64), write_rows=None)
        layer_cache = torch.randn(2, cache_blocks, bs, self.num_kv_heads, self.head_dim, generator=g).to(dtype)
        q = torch.randn(layout.num_tokens, self.num_heads, self.head_dim, generator=g).to(dtype)
        kv = q.new_empty(0, self.num_kv_heads, self.head_dim)  # nothing is written: slot_mapping is empty
        with torch.inference_mode():
            got = self.forward(q, kv, kv, layer_cache, layout, self.prepare(layout)).float()
            eager = FlexAttentionBackend(self.num_heads, self.num_kv_heads, self.head_dim, self.scale, compile=False)
            want = eager.forward(q, kv, kv, layer_cache, layout, eager.prepare(layout)).float()
        err = float((got - want).abs().max())
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        if err <= tol:
            return None
        bad_rows = int(((got - want).abs().amax(dim=(1, 2)) > tol).sum())
        return (f"inductor's CPU FlexAttention kernel disagrees with the eager reference at block size {bs} "
                f"({str(dtype).removeprefix('torch.')}) on this CPU: {bad_rows} of {layout.num_tokens} probe rows off, by up to {err:.3g}")

    def _compiled(self, device: torch.device) -> Any:
        # CUDA: torch.compile's automatic dynamic shapes (the first step's shape static, the next
        # different one once more with symbolic sizes, then no more compiles). CPU: static shapes
        # (one compile per step shape, eager past torch's recompile limit), because torch 2.13's
        # C++ FlexAttention template does not compile with symbolic query or key lengths.
        use_chunkwise_inductor_cache()
        return torch.compile(flex_attention, dynamic=False if device.type == "cpu" else None)

    def prepare(self, layout: BatchLayout) -> _FlexStep:
        # On the host (the sizes are data-dependent), then one copy each to the device.
        lens = torch.tensor(layout.query_lens)
        row_request = torch.repeat_interleave(torch.arange(layout.num_requests, dtype=torch.int32), lens)
        starts = torch.tensor(layout.query_start[:-1], dtype=torch.int32)
        computed = torch.tensor(layout.num_computed, dtype=torch.int32)
        row_position = torch.arange(layout.num_tokens, dtype=torch.int32) + (computed - starts).repeat_interleave(lens)
        device = layout.block_table.device
        return _FlexStep(row_request.to(device), row_position.to(device))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                layout: BatchLayout, prepared: _FlexStep) -> torch.Tensor:
        write_kv(layer_cache, k, v, layout.slot_mapping, layout.write_rows)
        _, num_blocks, bs, kv_heads, dim = layer_cache.shape
        if prepared.block_mask is None:
            prepared.block_mask = paged_block_mask(layout, num_blocks, prepared.row_request, prepared.row_position)
        if self._attend is None:
            self._attend = self._compiled(q.device)
        keys = layer_cache[0].view(1, num_blocks * bs, kv_heads, dim).transpose(1, 2)  # [1, KVH, S, D]
        values = layer_cache[1].view(1, num_blocks * bs, kv_heads, dim).transpose(1, 2)
        out = self._attend(q.transpose(0, 1).unsqueeze(0), keys, values, block_mask=prepared.block_mask,
                           scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return out[0].transpose(0, 1)
