"""FlexAttention backend: torch's FlexAttention reading the paged cache in place (no gather).

The whole cache of a layer is one key sequence of num_blocks * block_size slots; the step's T
query rows are one query sequence. Which slots a row may see is said twice, and both must agree:

- the block mask (sparsity): for each tile of Q_TILE query rows, the physical blocks of the
  requests whose rows are in that tile, each listed once (two requests sharing a cached prefix
  block name it once; a block listed twice would be attended twice). Built straight from the
  block tables, never by evaluating the mask over T x cache slots;
- the mask_mod (exactness): row q of request r sees slot s if s's block is r's logical block j
  and j * block_size + (s % block_size) <= the position of q. A per-step table maps each
  physical block to its logical index in each request's table (-1: not r's).

So a chunk after a cached prefix sees the prefix and itself causally, a decode sees its whole
context, and slots other requests own are never read into a row's softmax. K/V are written
first by `write_kv` (rows at or after kv_write_start: never into cached blocks).

This is the torch fallback for CUDA when FlashInfer is missing (compiled by inductor into a
Triton kernel there; not yet run on a GPU). On CPU it runs too (inductor's C++ template when
compiled, else FlexAttention's dense eager reference), which is how its exactness is tested
here; it is not chosen on CPU by `auto`, where the paged decode kernel is several times faster.
On CPU it is a test path: each new step shape compiles anew, and past torch's recompile limit
(or with --enforce-eager) the dense reference scores every slot of the cache for every row.

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


@dataclass
class _FlexStep:
    row_request: torch.Tensor  # [T] int32 request index of each query row
    row_position: torch.Tensor  # [T] int32 position of each query row
    block_mask: BlockMask | None = None  # built by the first layer, which knows the cache size


def paged_block_mask(layout: BatchLayout, num_cache_blocks: int, row_request: torch.Tensor,
                     row_position: torch.Tensor) -> BlockMask:
    """The step's BlockMask over a cache of `num_cache_blocks` blocks (see the module docstring)."""
    bs, device = layout.block_size, layout.block_table.device
    num_rows, num_req = layout.num_tokens, layout.num_requests
    # logical[r, b]: which of r's blocks physical block b is, or -1.
    logical = torch.full((max(num_req, 1), num_cache_blocks), -1, dtype=torch.int32, device=device)
    tables = [layout.block_table[r, :nb] for r, nb in enumerate(layout.num_blocks)]
    for r, blocks in enumerate(tables):
        logical[r, blocks] = torch.arange(len(blocks), dtype=torch.int32, device=device)
    num_tiles = max(1, -(-num_rows // Q_TILE))
    tile_blocks: list[torch.Tensor] = []
    for t in range(num_tiles):
        lo, hi = t * Q_TILE, min((t + 1) * Q_TILE, num_rows)
        members = [r for r in range(num_req) if layout.query_start[r] < hi and layout.query_start[r + 1] > lo]
        blocks = torch.cat([tables[r] for r in members]) if members else torch.zeros(0, dtype=torch.int64, device=device)
        tile_blocks.append(torch.unique(blocks))  # sorted, each block once
    # FlexAttention's kv_indices row is as wide as the key sequence has blocks; entries past
    # kv_num_blocks are never read.
    kv_indices = torch.zeros((1, 1, num_tiles, num_cache_blocks), dtype=torch.int32, device=device)
    for t, blocks in enumerate(tile_blocks):
        kv_indices[0, 0, t, : len(blocks)] = blocks.to(torch.int32)
    kv_num_blocks = torch.tensor([len(b) for b in tile_blocks], dtype=torch.int32, device=device).view(1, 1, -1)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        r = row_request[q_idx]
        j = logical[r, kv_idx // bs]
        return (j >= 0) & (j * bs + kv_idx % bs <= row_position[q_idx])

    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=(Q_TILE, bs), mask_mod=mask_mod,
                                    seq_lengths=(num_rows, num_cache_blocks * bs), compute_q_blocks=False)


class FlexAttentionBackend(AttentionBackend):
    name = "flex"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 compile: bool = True):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        # Compiled, FlexAttention is one fused kernel that honours the block mask's sparsity;
        # eager, it is the dense reference (every slot scored, then masked): exact but slow.
        self._attend: Any = None if compile else flex_attention

    def _compiled(self, device: torch.device) -> Any:
        # CUDA: torch.compile's automatic dynamic shapes (the first step's shape static, the next
        # different one once more with symbolic sizes, then no more compiles). CPU: static shapes
        # (one compile per step shape, eager past torch's recompile limit), because torch 2.13's
        # C++ FlexAttention template does not compile with symbolic query or key lengths.
        return torch.compile(flex_attention, dynamic=False if device.type == "cpu" else None)

    def prepare(self, layout: BatchLayout) -> _FlexStep:
        device = layout.block_table.device
        lens = torch.tensor(layout.query_lens, device=device)
        row_request = torch.repeat_interleave(torch.arange(layout.num_requests, device=device), lens)
        offsets = torch.arange(layout.num_tokens, device=device) - torch.repeat_interleave(
            torch.tensor(layout.query_start[:-1], device=device), lens)
        row_position = torch.repeat_interleave(torch.tensor(layout.num_computed, device=device), lens) + offsets
        return _FlexStep(row_request.to(torch.int32), row_position.to(torch.int32))

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
