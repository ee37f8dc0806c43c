"""Attention backends behind one interface, and the choice between them.

`torch`: the exact reference, CPU and CUDA, any block size.
`flashinfer`: CUDA only, float16/bfloat16, any block size (not yet run on a GPU).
`flash-attn`: CUDA only, float16/bfloat16, paged block size a multiple of 256 (stock flash-attn 2).
`flex`: torch's FlexAttention over the paged cache in place, compiled (Triton on CUDA, not yet run
on a GPU; inductor's C++ on CPU, where it is exact but slower than torch's paged decode kernel).
`auto`: on CUDA FlashInfer if it can run, else flash-attn if it can, else flex if triton is there,
else torch; on CPU torch. The reason is returned (and logged by the runner) naming why each
earlier choice was passed over.
"""

from __future__ import annotations

import logging

import torch

from .base import AttentionBackend, BatchLayout, StepAttention
from .flash_attn_backend import FLASH_ATTN_PAGE_MULTIPLE, FlashAttnBackend, flash_attn_unavailable_reason
from .flashinfer_backend import FlashInferBackend, flashinfer_unavailable_reason
from .flex_backend import FlexAttentionBackend, flex_attention_unavailable_reason
from .torch_backend import TorchAttentionBackend

logger = logging.getLogger("chunkwise.executor.attention")


def select_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                   block_size: int | None) -> tuple[type[AttentionBackend], str]:
    """The backend class to use and a sentence saying why. `block_size` None means "not known
    yet" (a provisional answer). An explicit request that cannot be honoured raises ValueError."""
    if requested == "torch":
        return TorchAttentionBackend, "requested with --attention-backend torch"
    if requested not in ("auto", "flashinfer", "flash-attn", "flex"):
        raise ValueError(f"unknown attention backend {requested!r}; "
                         "choose auto, torch, flashinfer, flash-attn or flex")
    flex_reason = flex_attention_unavailable_reason(device, block_size)
    if requested == "flex":
        if flex_reason is not None:
            raise ValueError(f"--attention-backend flex cannot be used: {flex_reason}")
        return FlexAttentionBackend, "requested with --attention-backend flex"
    flashinfer_reason = flashinfer_unavailable_reason(device, dtype, head_dim)
    if requested == "flashinfer":
        if flashinfer_reason is not None:
            raise ValueError(f"--attention-backend flashinfer cannot be used: {flashinfer_reason}")
        return FlashInferBackend, "requested with --attention-backend flashinfer"
    reason = flash_attn_unavailable_reason(device, dtype, head_dim, block_size)
    if requested == "flash-attn":
        if reason is not None:
            raise ValueError(f"--attention-backend flash-attn cannot be used: {reason}")
        return FlashAttnBackend, "requested with --attention-backend flash-attn"
    if flashinfer_reason is None:
        return FlashInferBackend, "auto: CUDA, flashinfer importable, fp16/bf16 (any block size)"
    if reason is None:
        return FlashAttnBackend, (f"auto: not using FlashInfer because {flashinfer_reason}; flash-attn: CUDA, "
                                  "fp16/bf16 and a compatible block size")
    passed_over = f"not using FlashInfer because {flashinfer_reason}; not using flash-attn because {reason}"
    if device.type != "cuda":
        return TorchAttentionBackend, f"auto: {passed_over}; on CPU torch's paged decode kernel beats flex"
    if flex_reason is None:
        return FlexAttentionBackend, f"auto: {passed_over}; flex: CUDA and triton importable"
    return TorchAttentionBackend, f"auto: {passed_over}; not using flex because {flex_reason}"


__all__ = [
    "AttentionBackend",
    "BatchLayout",
    "FLASH_ATTN_PAGE_MULTIPLE",
    "FlashAttnBackend",
    "FlashInferBackend",
    "FlexAttentionBackend",
    "StepAttention",
    "TorchAttentionBackend",
    "flash_attn_unavailable_reason",
    "flashinfer_unavailable_reason",
    "flex_attention_unavailable_reason",
    "select_backend",
]
