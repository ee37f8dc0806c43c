"""Attention backends behind one interface, and the choice between them.

`torch`: the exact reference, CPU and CUDA, any block size.
`flash-attn`: CUDA only, float16/bfloat16, paged block size a multiple of 256 (stock flash-attn 2).
`auto`: flash-attn when all of that holds, otherwise torch (logging why).
"""

from __future__ import annotations

import logging

import torch

from .base import AttentionBackend, BatchLayout, StepAttention
from .flash_attn_backend import FLASH_ATTN_PAGE_MULTIPLE, FlashAttnBackend, flash_attn_unavailable_reason
from .torch_backend import TorchAttentionBackend

logger = logging.getLogger("chunkwise.executor.attention")


def select_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                   block_size: int | None) -> tuple[type[AttentionBackend], str]:
    """The backend class to use and a sentence saying why. `block_size` None means "not known
    yet" (a provisional answer). An explicit request that cannot be honoured raises ValueError."""
    if requested == "torch":
        return TorchAttentionBackend, "requested with --attention-backend torch"
    if requested not in ("auto", "flash-attn"):
        raise ValueError(f"unknown attention backend {requested!r}; choose auto, torch or flash-attn")
    reason = flash_attn_unavailable_reason(device, dtype, head_dim, block_size)
    if requested == "flash-attn":
        if reason is not None:
            raise ValueError(f"--attention-backend flash-attn cannot be used: {reason}")
        return FlashAttnBackend, "requested with --attention-backend flash-attn"
    if reason is None:
        return FlashAttnBackend, "auto: CUDA, flash-attn importable, fp16/bf16 and a compatible block size"
    return TorchAttentionBackend, f"auto: not using flash-attn because {reason}"


__all__ = [
    "AttentionBackend",
    "BatchLayout",
    "FLASH_ATTN_PAGE_MULTIPLE",
    "FlashAttnBackend",
    "StepAttention",
    "TorchAttentionBackend",
    "flash_attn_unavailable_reason",
    "select_backend",
]
