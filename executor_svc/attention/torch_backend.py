"""The reference attention backend: plain torch, CPU or CUDA, any block size.

Prefill chunks: per request, gather its blocks from the paged cache (one index_select of whole
blocks), trim to the context length and run scaled_dot_product_attention with a causal mask
offset by the number of positions before the chunk. On CPU a long chunk's query rows go in
pieces, each against only the keys up to its own last position (see PREFILL_PIECE_ROWS). With
`prefill_bf16_gemm` (bf16 on a CPU with native bf16 matmuls) each piece is instead two oneDNN
GEMMs that take bf16 inputs and give float32 results, with the softmax between them in float32
(see PREFILL_GEMM_PIECE_ROWS), compiled where a PrefillSoftmaxKernel is ready (prefill_softmax.py).

Single-query rows (decodes, and a fully cached prompt's last token) take one of two paths:
- with a ready PagedDecodeKernel (CPU, inductor): a call per group of rows of similar context
  length (one call when they are alike), reading keys and values in place from their blocks
  through per-step slot ids (paged_decode.py);
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

from chunkwise.plan import cdiv

from ..kv_cache import write_kv
from .base import AttentionBackend, BatchLayout
from .paged_decode import PagedDecodeKernel, decode_slots, group_by_length
from .prefill_softmax import PrefillSoftmaxKernel, prefill_softmax_reference

# Upper bound on keys gathered (padded) by one batched decode call: groups x max context.
DECODE_GROUP_MAX_KEYS = 1 << 16

# On CPU a prefill chunk's query rows are attended in pieces of at most this many rows, each piece
# against keys [0, its last position] only. torch's CPU flash kernel skips causally masked keys
# only in whole 512-key blocks, and scores every key when it is given a mask (a chunk after a
# cached prefix or an earlier chunk), so a single call scores most of the pairs that the causal
# mask then discards. In pieces the masked-out upper triangle is mostly never computed: 1.03-1.4x
# faster per chunk on SmolLM2's shapes, bf16 and fp32, with 96-256 rows about equally good
# (bench/RESULTS.md section 2b). Each row's softmax still runs over exactly its visible keys.
PREFILL_PIECE_ROWS = 192

# bf16 prefill on a CPU with native bf16 matmuls (AVX512-BF16, AMX): torch's CPU flash kernel runs
# at ~160 GFLOP/s on head dim 64 there, a sixth of the bf16 matmul rate, bf16 or not (its tiles'
# GEMMs are small). Written as scores = q k^T (one batched GEMM, the query heads of each KV head
# folded into its rows), exp and sum in float32, then the unnormalised weights times the values
# (a second GEMM) divided by the sum, each piece is 1.1-1.25x faster over the seed workload's chunk
# shapes on a Zen 5, with flash's precision: the GEMMs run in oneDNN's "bf16" float32 mode, which
# rounds their inputs to bf16 (exact for bf16 queries, keys and values; the weights in [0, 1] are
# rounded as flash rounds them) and keeps float32 sums and results, so the scores are not rounded
# to bf16 as a bf16 GEMM's output would be, and the output is rounded once, after the division
# (bench/RESULTS.md section 2). Smaller pieces than SDPA's keep a piece's float32 scores in cache.
# 128 rather than 96 since the pieces stopped copying keys and a mask (1.00-1.13x per chunk, 64
# rows 0.93-1.03x, 192 0.98-1.05x; bench/RESULTS.md section 2); outputs are the same for any size.
PREFILL_GEMM_PIECE_ROWS = 128


def prefill_gemm_pays(cpu_flags: list[str]) -> bool:
    """Whether bf16 prefill takes the GEMM path on a CPU with these native-bf16 flags
    (config.cpu_bf16_flags): with AVX512-BF16 and no AMX. With AMX (amx_bf16), torch's flash
    kernel packs its key and value tiles for AMX and multiplies them there, and on a Xeon with
    AMX the seed-shaped run was 1.27x faster on it than on the GEMM path, its mixed steps 1.48x
    (bench/RESULTS.md section 2b)."""
    return "avx512_bf16" in cpu_flags and "amx_bf16" not in cpu_flags


# Longer contexts take SDPA: the GEMM path holds a piece's float32 scores and their weights
# ([KVH x G x rows, keys] floats each), which flash never makes.
PREFILL_GEMM_MAX_KEYS = 4096


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
class _Piece:
    """Query rows [q0, q1) of the batch against keys [0, num_keys) of their request."""

    q0: int
    q1: int
    num_keys: int
    # [q1 - q0, num_keys] bool, True = attend; None with `causal`. Turned into an additive mask
    # in q's dtype at the first layer: torch's CPU SDPA runs ~10% faster with one than with a bool
    # mask on a 461 x 637 chunk (bench/RESULTS.md).
    mask: torch.Tensor | None
    causal: bool  # the rows are exactly positions 0..num_keys-1 (plain causal, no mask)
    # The GEMM path's mask: how many keys each of its [KVH x G x rows] folded rows sees (int64;
    # each row's keys are a prefix of the piece's), made at the first layer.
    gemm_visible: torch.Tensor | None = None


@dataclass
class _Prefill:
    row: int  # index into layout.block_table
    context_len: int
    num_blocks: int
    pieces: list[_Piece]


@dataclass
class _DecodeGroup:
    q_rows: torch.Tensor  # [G] batch rows of the single queries
    block_table: torch.Tensor  # [G, num_blocks] covering the longest context of the group
    context_len: int  # longest context of the group
    mask: torch.Tensor | None  # [G, 1, 1, context_len] key padding mask; None if all equal
    pad: torch.Tensor | None  # [G, context_len, 1, 1] True at padded key positions


@dataclass
class _PagedDecode:
    """Single-query rows of the step of similar context length, for one paged decode kernel call."""

    q_rows: torch.Tensor  # [B'] batch rows, padded to >= 2 by repeating the first
    num_rows: int  # B: the real rows, first in q_rows
    slots: torch.Tensor  # [B', L] cache slot of each key
    lens: torch.Tensor  # [B'] keys per row
    checked: bool = False  # slots bounds-checked against the cache (first layer)


@dataclass
class _TorchStep:
    prefills: list[_Prefill]
    decode_groups: list[_DecodeGroup]
    paged_decodes: list[_PagedDecode]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 decode_kernel: PagedDecodeKernel | None = None, prefill_piece_rows: int | None = PREFILL_PIECE_ROWS,
                 prefill_bf16_gemm: bool = False, prefill_softmax: PrefillSoftmaxKernel | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.decode_kernel = decode_kernel if decode_kernel is not None and decode_kernel.ready else None
        # bf16 prefill pieces as two GEMMs (see PREFILL_GEMM_PIECE_ROWS): for CPUs with native
        # bf16 matmuls; chunks of other dtypes take SDPA whatever this says.
        self.prefill_bf16_gemm = prefill_bf16_gemm
        # The GEMM path's softmax compiled (else eager, the same numbers up to exp's last bit).
        self.prefill_softmax = prefill_softmax if prefill_softmax is not None and prefill_softmax.ready else None
        # None: one call per chunk (what CUDA always gets: its kernels skip masked tiles themselves).
        self.prefill_piece_rows = PREFILL_GEMM_PIECE_ROWS if prefill_bf16_gemm else prefill_piece_rows

    @property
    def prefill_path(self) -> str:
        """How prefill chunks attend: 'bf16-gemm' (bf16 chunks, the softmax compiled; others take
        SDPA), 'bf16-gemm-eager-softmax' or 'sdpa'."""
        if not self.prefill_bf16_gemm:
            return "sdpa"
        return "bf16-gemm" if self.prefill_softmax is not None else "bf16-gemm-eager-softmax"

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
            pieces = self._pieces(q0, q1, start, device)
            prefills.append(_Prefill(r, ctx, layout.num_blocks[r], pieces))
        if self.decode_kernel is not None and singles:
            return _TorchStep(prefills, [], self._paged_decodes(layout, singles))
        return _TorchStep(prefills, self._decode_groups(layout, singles), [])

    def _pieces(self, q0: int, q1: int, start: int, device: torch.device) -> list[_Piece]:
        """Batch rows [q0, q1), positions start.., split into near-equal pieces of at most
        prefill_piece_rows rows (CPU only), each seeing keys up to its own last position."""
        rows = q1 - q0
        size = rows
        if self.prefill_piece_rows is not None and device.type == "cpu" and rows > self.prefill_piece_rows:
            n = cdiv(rows, self.prefill_piece_rows)
            size = cdiv(rows, n)
        pieces = []
        for a in range(0, rows, size):
            b = min(rows, a + size)
            first, keys = start + a, start + b  # positions of the piece: first .. keys - 1
            if first == 0:  # the piece is a whole prefix of the sequence: the standard causal mask
                pieces.append(_Piece(q0 + a, q0 + b, keys, None, True))
                continue
            # Query at position p may see keys 0..p.
            q_pos = torch.arange(first, keys, device=device)
            mask = torch.arange(keys, device=device)[None, :] <= q_pos[:, None]
            pieces.append(_Piece(q0 + a, q0 + b, keys, mask, False))
        return pieces

    @staticmethod
    def _paged_decodes(layout: BatchLayout, singles: list[int]) -> list[_PagedDecode]:
        device = layout.block_table.device
        calls = []
        for group in group_by_length([layout.context_lens[r] for r in singles]):
            members = [singles[i] for i in group]
            rows = torch.tensor(members, device=device)
            nb = max(layout.num_blocks[r] for r in members)
            slots, lens = decode_slots(layout.block_table.index_select(0, rows)[:, :nb],
                                       [layout.context_lens[r] for r in members], layout.block_size)
            q_rows = [layout.query_start[r] for r in members]
            q_rows += [q_rows[0]] * (slots.shape[0] - len(q_rows))
            calls.append(_PagedDecode(torch.tensor(q_rows, device=device), len(members), slots, lens))
        return calls

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

    def _gemm_piece(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, p: _Piece,
                    out: torch.Tensor) -> None:
        """One piece by the GEMM path into `out` [rows, H, D] (contiguous): q [rows, H, D] bf16;
        keys [KVH, D, num_keys] and values [KVH, num_keys, D] float32 (bf16 values). Runs under
        oneDNN's bf16 float32 mode."""
        rows, kvh, d = q.shape[0], self.num_kv_heads, self.head_dim
        g = self.num_heads // kvh
        if p.gemm_visible is None:
            # The piece's last row is at position num_keys - 1 and sees every key; each row
            # before it one key fewer (causal).
            first = p.num_keys - rows + 1
            p.gemm_visible = torch.arange(first, p.num_keys + 1, device=q.device).repeat(kvh * g)
        # One copy: converted straight into the folded layout.
        qf = q.view(rows, kvh, g, d).permute(1, 2, 0, 3).to(torch.float32, memory_format=torch.contiguous_format)
        qf = qf.view(kvh, g * rows, d)
        products = torch.bmm(qf, keys)  # [KVH, G * rows, keys]: q k^T, unscaled and unmasked
        # Scale, causal mask, exp(scores - row max) and the row sums: every row sees at least key
        # 0, so its max is finite and exp() of it is 1. (A piece has >= 2 rows and keys: the
        # kernel's smallest sizes.)
        softmax = self.prefill_softmax or prefill_softmax_reference
        weights, sums = softmax(products.view(-1, p.num_keys), p.gemm_visible, self.scale)
        weights, sums = weights.view(products.shape), sums.view(kvh, g * rows, 1)
        o = torch.bmm(weights, values).div_(sums)  # [KVH, G * rows, D]
        out.view(rows, kvh, g, d).copy_(o.view(kvh, g, rows, d).permute(2, 0, 1, 3))  # unfolded, rounded once

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                layout: BatchLayout, prepared: _TorchStep) -> torch.Tensor:
        write_kv(layer_cache, k, v, layout.slot_mapping, layout.write_rows)
        out = torch.empty_like(q)
        self._prefill(q, layer_cache, layout, prepared, out)
        self._decode(q, layer_cache, layout, prepared, out)
        return out

    def _prefill(self, q: torch.Tensor, layer_cache: torch.Tensor, layout: BatchLayout, prepared: _TorchStep,
                 out: torch.Tensor) -> None:
        k_cache, v_cache = layer_cache[0], layer_cache[1]  # [num_blocks, block_size, KVH, D]
        gemm = self.prefill_bf16_gemm and q.dtype == torch.bfloat16
        for s in prepared.prefills:
            blocks = layout.block_table[s.row, : s.num_blocks]
            keys = k_cache.index_select(0, blocks).flatten(0, 1)[: s.context_len].transpose(0, 1)  # [KVH, ctx, D]
            values = v_cache.index_select(0, blocks).flatten(0, 1)[: s.context_len].transpose(0, 1)
            if gemm and s.context_len <= PREFILL_GEMM_MAX_KEYS:
                # Converted once per layer, the keys straight into the transposed layout the first
                # GEMM multiplies by [KVH, D, ctx]: a piece's keys are then a plain strided view,
                # where the [KVH, ctx, D] cache order cost every piece a transposing copy.
                keys = torch.empty(keys.shape[0], keys.shape[2], keys.shape[1], device=q.device).copy_(keys.transpose(1, 2))
                values = values.float()
                # Process-wide: float32 matmuls round their inputs to bf16 while it is set. The
                # executor's torch work is on one thread, and only the two GEMMs run under it.
                matmul = torch.backends.mkldnn.matmul
                before, matmul.fp32_precision = matmul.fp32_precision, "bf16"
                try:
                    for p in s.pieces:
                        self._gemm_piece(q[p.q0 : p.q1], keys[:, :, : p.num_keys], values[:, : p.num_keys], p,
                                         out[p.q0 : p.q1])
                finally:
                    matmul.fp32_precision = before
                continue
            for p in s.pieces:
                if p.mask is not None and p.mask.dtype == torch.bool:
                    p.mask = torch.zeros(p.mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~p.mask, float("-inf"))
                o = self._sdpa(q[p.q0 : p.q1].transpose(0, 1).unsqueeze(0),  # [1, H, rows, D]
                               keys[:, : p.num_keys].unsqueeze(0),  # [1, KVH, keys, D]
                               values[:, : p.num_keys].unsqueeze(0), p.mask, p.causal)
                out[p.q0 : p.q1] = o[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, layer_cache: torch.Tensor, layout: BatchLayout, prepared: _TorchStep,
                out: torch.Tensor) -> None:
        k_cache, v_cache = layer_cache[0], layer_cache[1]
        for d in prepared.paged_decodes:
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
