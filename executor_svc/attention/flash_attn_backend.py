"""flash-attn 2 backend (CUDA, fp16/bf16) reading the paged cache through `block_table`.

Mixed batches (any prefill chunk present) go through one `flash_attn_varlen_func` call with
cumulative query lengths and cumulative context lengths: with causal=True flash-attn aligns the
mask to the bottom-right corner, which is exactly "the query at position p sees keys 0..p" for
a chunk whose queries are the last q_len of its context_len positions. Pure-decode batches use
`flash_attn_with_kvcache` (one query per sequence, cache_seqlens = context lengths). In both the
K/V of this step were already written by us (respecting kv_write_start), so flash-attn is only
asked to read the cache, never to append to it.

Stock flash-attn 2 requires the paged block size (`k_cache.size(1)`) to be a multiple of 256;
`check_block_size` says so before any kernel runs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from ..kv_cache import write_kv
from .base import AttentionBackend, BatchLayout

FLASH_ATTN_PAGE_MULTIPLE = 256


def import_flash_attn() -> tuple[Any, Any]:
    """(flash_attn_varlen_func, flash_attn_with_kvcache), or raise ImportError saying why."""
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    except Exception as e:  # ImportError, or a CUDA extension failing to load
        raise ImportError(f"flash_attn is not importable: {e}") from e
    if "block_table" not in inspect.signature(flash_attn_varlen_func).parameters:
        raise ImportError("flash_attn_varlen_func has no block_table argument (needs flash-attn >= 2.6)")
    return flash_attn_varlen_func, flash_attn_with_kvcache


def flash_attn_unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int,
                                  block_size: int | None) -> str | None:
    """None if the flash-attn backend can run here, else a sentence saying why not."""
    if device.type != "cuda":
        return f"device is {device.type}, flash-attn needs CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype is {str(dtype).removeprefix('torch.')}, flash-attn needs float16 or bfloat16"
    if head_dim > 256 or head_dim % 8:
        return f"head_dim {head_dim} is not supported by flash-attn (a multiple of 8, at most 256)"
    if block_size is not None and block_size % FLASH_ATTN_PAGE_MULTIPLE:
        return (f"block size {block_size} is not a multiple of {FLASH_ATTN_PAGE_MULTIPLE}, which "
                "stock flash-attn 2 requires for a paged KV cache")
    try:
        import_flash_attn()
    except ImportError as e:
        return str(e)
    return None


@dataclass
class _FlashStep:
    cu_seqlens_q: torch.Tensor  # [R + 1] int32
    cu_seqlens_k: torch.Tensor  # [R + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [R, max_blocks] int32
    decode_only: bool
    cache_seqlens: torch.Tensor  # [R] int32 (context lengths)


class FlashAttnBackend(AttentionBackend):
    name = "flash-attn"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._varlen, self._with_kvcache = import_flash_attn()

    @classmethod
    def check_block_size(cls, block_size: int) -> None:
        if block_size % FLASH_ATTN_PAGE_MULTIPLE:
            raise ValueError(
                f"the flash-attn backend needs a KV block size that is a multiple of "
                f"{FLASH_ATTN_PAGE_MULTIPLE} (stock flash-attn 2's paged-KV constraint), got {block_size}; "
                "use a block size of 256 or --attention-backend torch"
            )

    def prepare(self, layout: BatchLayout) -> _FlashStep:
        device = layout.block_table.device
        q_lens = layout.query_lens
        cu_q = [0]
        cu_k = [0]
        for ql, kl in zip(q_lens, layout.context_lens):
            cu_q.append(cu_q[-1] + ql)
            cu_k.append(cu_k[-1] + kl)
        return _FlashStep(
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
            cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(layout.context_lens),
            block_table=layout.block_table.to(torch.int32).contiguous(),
            decode_only=all(ql == 1 for ql in q_lens),
            cache_seqlens=torch.tensor(layout.context_lens, dtype=torch.int32, device=device),
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                layout: BatchLayout, prepared: _FlashStep) -> torch.Tensor:
        write_kv(layer_cache, k, v, layout.slot_mapping, layout.write_rows)
        k_cache, v_cache = layer_cache[0], layer_cache[1]  # [num_blocks, block_size, KVH, D]
        if prepared.decode_only:
            out = self._with_kvcache(
                q.unsqueeze(1), k_cache, v_cache,
                cache_seqlens=prepared.cache_seqlens, block_table=prepared.block_table,
                softmax_scale=self.scale, causal=True,
            )
            return out.squeeze(1)
        return self._varlen(
            q, k_cache, v_cache,
            prepared.cu_seqlens_q, prepared.cu_seqlens_k, prepared.max_seqlen_q, prepared.max_seqlen_k,
            softmax_scale=self.scale, causal=True, block_table=prepared.block_table,
        )
