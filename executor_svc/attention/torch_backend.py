"""The reference attention backend: plain torch, CPU or CUDA, any block size.

Prefill chunks: per request, gather its blocks from the paged cache (one index_select of whole
blocks), trim to the context length and run scaled_dot_product_attention with a causal mask
offset by the number of positions before the chunk.

Single-query rows (decodes, and a fully cached prompt's last token) take one of two paths:
- with a ready PagedDecodeKernel (CPU, inductor): all of them in one call that reads keys and
  values in place from their blocks through per-step slot ids (paged_decode.py);
- otherwise (--enforce-eager, no C++ compiler, CUDA): requests are sorted by context length and
  grouped so that one padded gather + one SDPA call serves a whole group, with a key-padding
  mask and the query heads of each KV head folded into query rows (so SDPA sees plain multi-
  query attention, not GQA). Groups are capped in gathered bytes, so long contexts never blow
  up memory.
A loop over requests or groups, never over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kv_cache import write_kv
from .base import AttentionBackend, BatchLayout
from .paged_decode import PagedDecodeKernel, decode_slots

# Upper bound on keys gathered (padded) by one batched decode call: groups x max context.
DECODE_GROUP_MAX_KEYS = 1 << 16


def _sdpa_supports_gqa() -> bool:
    # enable_gqa arrived in torch 2.5; older versions need the KV heads repeated.
    try:
        x = torch.zeros(1, 2, 1, 8)
        F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
    except TypeError:
        return False
    return True


_SDPA_GQA = _sdpa_supports_gqa()


@dataclass
class _Prefill:
    row: int  # index into layout.block_table
    q0: int
    q1: int
    context_len: int
    num_blocks: int
    # [q_len, context_len] bool, True = attend; None with `causal`. Turned into an additive mask
    # in q's dtype at the first layer: torch's CPU SDPA runs ~10% faster with one than with a bool
    # mask on a 461 x 637 chunk (bench/RESULTS.md).
    mask: torch.Tensor | None
    causal: bool  # query rows are exactly positions 0..context_len-1 (plain causal)


@dataclass
class _DecodeGroup:
    q_rows: torch.Tensor  # [G] batch rows of the single queries
    block_table: torch.Tensor  # [G, num_blocks] covering the longest context of the group
    context_len: int  # longest context of the group
    mask: torch.Tensor | None  # [G, 1, 1, context_len] key padding mask; None if all equal
    pad: torch.Tensor | None  # [G, context_len, 1, 1] True at padded key positions


@dataclass
class _PagedDecode:
    """All single-query rows of the step, for the paged decode kernel."""

    q_rows: torch.Tensor  # [B'] batch rows, padded to >= 2 by repeating the first
    num_rows: int  # B: the real rows, first in q_rows
    slots: torch.Tensor  # [B', L] cache slot of each key
    lens: torch.Tensor  # [B'] keys per row
    checked: bool = False  # slots bounds-checked against the cache (first layer)


@dataclass
class _TorchStep:
    prefills: list[_Prefill]
    decode_groups: list[_DecodeGroup]
    paged_decode: _PagedDecode | None


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 decode_kernel: PagedDecodeKernel | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.decode_kernel = decode_kernel if decode_kernel is not None and decode_kernel.ready else None

    @property
    def decode_path(self) -> str:
        """Which path single-query rows take: 'paged-inductor' or 'sdpa-folded'."""
        return "paged-inductor" if self.decode_kernel is not None else "sdpa-folded"

    def prepare(self, layout: BatchLayout) -> _TorchStep:
        device = layout.block_table.device
        prefills: list[_Prefill] = []
        singles: list[int] = []
        for r in range(layout.num_requests):
            q0, q1 = layout.query_start[r], layout.query_start[r + 1]
            ctx, start = layout.context_lens[r], layout.num_computed[r]
            if q1 - q0 == 1:
                singles.append(r)
                continue
            mask, causal = None, False
            if q1 - q0 == ctx:
                causal = True  # whole sequence in this chunk: the standard causal mask
            else:
                # Query at position p may see keys 0..p; p runs from `start`, keys from 0.
                q_pos = torch.arange(start, ctx, device=device)
                mask = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]
            prefills.append(_Prefill(r, q0, q1, ctx, layout.num_blocks[r], mask, causal))
        if self.decode_kernel is not None and singles:
            return _TorchStep(prefills, [], self._paged_decode(layout, singles))
        return _TorchStep(prefills, self._decode_groups(layout, singles), None)

    @staticmethod
    def _paged_decode(layout: BatchLayout, singles: list[int]) -> _PagedDecode:
        device = layout.block_table.device
        rows = torch.tensor(singles, device=device)
        nb = max(layout.num_blocks[r] for r in singles)
        slots, lens = decode_slots(layout.block_table.index_select(0, rows)[:, :nb],
                                   [layout.context_lens[r] for r in singles], layout.block_size)
        q_rows = [layout.query_start[r] for r in singles]
        q_rows += [q_rows[0]] * (slots.shape[0] - len(q_rows))
        return _PagedDecode(torch.tensor(q_rows, device=device), len(singles), slots, lens)

    @staticmethod
    def _decode_groups(layout: BatchLayout, singles: list[int]) -> list[_DecodeGroup]:
        device = layout.block_table.device
        singles = sorted(singles, key=lambda r: layout.context_lens[r])
        groups: list[_DecodeGroup] = []
        i = 0
        while i < len(singles):
            # Grow the group while (members x longest context) stays under the cap; sorted
            # order keeps the padding small.
            j = i + 1
            while j < len(singles) and (j + 1 - i) * layout.context_lens[singles[j]] <= DECODE_GROUP_MAX_KEYS:
                j += 1
            members = singles[i:j]
            lens = [layout.context_lens[r] for r in members]
            longest = lens[-1]
            nb = max(layout.num_blocks[r] for r in members)
            rows = torch.tensor(members, device=device)
            mask = pad = None
            if lens[0] != longest:
                lens_t = torch.tensor(lens, device=device)
                valid = torch.arange(longest, device=device)[None, :] < lens_t[:, None]  # [G, ctx]
                mask, pad = valid[:, None, None, :], ~valid[:, :, None, None]
            groups.append(_DecodeGroup(
                q_rows=torch.tensor([layout.query_start[r] for r in members], device=device),
                block_table=layout.block_table.index_select(0, rows)[:, :nb],
                context_len=longest,
                mask=mask,
                pad=pad,
            ))
            i = j
        return groups

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              causal: bool) -> torch.Tensor:
        """q [B, H, L, D], k/v [B, KVH, S, D]."""
        groups = self.num_heads // self.num_kv_heads
        extra = {}
        if groups > 1:
            if _SDPA_GQA:
                extra["enable_gqa"] = True
            else:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, **extra)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                layout: BatchLayout, prepared: _TorchStep) -> torch.Tensor:
        write_kv(layer_cache, k, v, layout.slot_mapping, layout.write_rows)
        k_cache, v_cache = layer_cache[0], layer_cache[1]  # [num_blocks, block_size, KVH, D]
        out = torch.empty_like(q)
        for s in prepared.prefills:
            if s.mask is not None and s.mask.dtype == torch.bool:
                s.mask = torch.zeros(s.mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~s.mask, float("-inf"))
            blocks = layout.block_table[s.row, : s.num_blocks]
            keys = k_cache.index_select(0, blocks).flatten(0, 1)[: s.context_len]  # [ctx, KVH, D]
            values = v_cache.index_select(0, blocks).flatten(0, 1)[: s.context_len]
            o = self._sdpa(q[s.q0 : s.q1].transpose(0, 1).unsqueeze(0),  # [1, H, q_len, D]
                           keys.transpose(0, 1).unsqueeze(0),  # [1, KVH, ctx, D]
                           values.transpose(0, 1).unsqueeze(0), s.mask, s.causal)
            out[s.q0 : s.q1] = o[0].transpose(0, 1)
        if prepared.paged_decode is not None:
            d = prepared.paged_decode
            assert self.decode_kernel is not None
            if not d.checked:
                self.decode_kernel.check_slots(d.slots, layer_cache.shape[1] * layer_cache.shape[2])
                d.checked = True
            o = self.decode_kernel(q.index_select(0, d.q_rows), layer_cache[0].flatten(0, 1),
                                   layer_cache[1].flatten(0, 1), d.slots, d.lens, self.scale)
            out.index_copy_(0, d.q_rows[: d.num_rows], o[: d.num_rows])
        for g in prepared.decode_groups:
            n = g.q_rows.numel()
            keys = k_cache[g.block_table].flatten(1, 2)[:, : g.context_len]  # [G, ctx, KVH, D]
            values = v_cache[g.block_table].flatten(1, 2)[:, : g.context_len]
            if g.pad is not None:
                # Padded keys are masked out, but they are slots this request does not own
                # (stale data of other requests): zero them so a non-finite stale value can
                # never leak through 0 * NaN.
                keys, values = keys.masked_fill(g.pad, 0), values.masked_fill(g.pad, 0)
            # The H / KVH query heads of each KV head become that head's query rows: [G, KVH, H/KVH, D]
            # against [G, KVH, ctx, D], plain attention with no GQA expansion of keys or values.
            folded = q.index_select(0, g.q_rows).view(n, self.num_kv_heads, -1, self.head_dim)
            o = F.scaled_dot_product_attention(folded, keys.transpose(1, 2), values.transpose(1, 2),
                                               attn_mask=g.mask, scale=self.scale)
            out.index_copy_(0, g.q_rows, o.reshape(n, self.num_heads, self.head_dim))
        return out
