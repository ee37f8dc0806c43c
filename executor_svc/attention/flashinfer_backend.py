"""FlashInfer backend (CUDA, fp16/bf16) over chunkwise's paged cache at any block size.

FlashInfer's batch wrappers read pages in "NHD" layout ([num_blocks, block_size, kv_heads,
head_dim]: the layout KVCache already has) through the plan tensors of `flashinfer_plan.py`. A
step is planned once in `prepare` and run in every layer: steps with any prefill chunk use the
batch-prefill wrapper (causal, bottom-right aligned: a chunk after a cached prefix sees the prefix
and itself causally), decode-only steps the batch-decode wrapper. K/V are written first by
`write_kv` (only rows at or after kv_write_start, so never into cached blocks); FlashInfer only
reads the cache.

Not yet run on a GPU (no device has been lent to this project): the plan tensors are checked on
CPU against the torch backend, and tests/executor/test_flashinfer_plan.py holds the CUDA parity test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..kv_cache import write_kv
from .base import AttentionBackend, BatchLayout
from .flashinfer_plan import PagedKVIndices, paged_kv_indices

WORKSPACE_BYTES = 128 << 20  # FlashInfer's documented default for its float workspace


def import_flashinfer() -> Any:
    try:
        import flashinfer
    except Exception as e:  # ImportError, or its CUDA libraries failing to load
        raise ImportError(f"flashinfer is not importable: {e}") from e
    for name in ("BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper"):
        if not hasattr(flashinfer, name):
            raise ImportError(f"flashinfer has no {name}")
    return flashinfer


def flashinfer_unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None if the FlashInfer backend can run here, else a sentence saying why not."""
    if device.type != "cuda":
        return f"device is {device.type}, FlashInfer needs CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype is {str(dtype).removeprefix('torch.')}, FlashInfer needs float16 or bfloat16"
    if head_dim not in (64, 128, 256):
        return f"head_dim {head_dim} is not one of the head sizes FlashInfer's prebuilt kernels cover (64, 128, 256)"
    try:
        import_flashinfer()
    except ImportError as e:
        return str(e)
    return None


@dataclass
class _FlashInferStep:
    indices: PagedKVIndices
    wrapper: Any  # the prefill or the decode wrapper
    planned: bool = False  # planned by the first layer, which knows the dtype of q and the cache


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._flashinfer = import_flashinfer()
        self._prefill: Any = None
        self._decode: Any = None

    def prepare(self, layout: BatchLayout) -> _FlashInferStep:
        if self._prefill is None:  # one workspace for both: a step uses only one of them
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=layout.block_table.device)
            self._prefill = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            self._decode = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        idx = paged_kv_indices(layout)
        return _FlashInferStep(idx, self._decode if idx.decode_only else self._prefill)

    def _plan(self, step: _FlashInferStep, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        idx = step.indices
        common = dict(sm_scale=self.scale, q_data_type=q_dtype, kv_data_type=kv_dtype)
        if idx.decode_only:
            step.wrapper.plan(idx.paged_kv_indptr, idx.paged_kv_indices, idx.paged_kv_last_page_len,
                              self.num_heads, self.num_kv_heads, self.head_dim, idx.page_size, **common)
        else:
            step.wrapper.plan(idx.qo_indptr, idx.paged_kv_indptr, idx.paged_kv_indices,
                              idx.paged_kv_last_page_len, self.num_heads, self.num_kv_heads, self.head_dim,
                              idx.page_size, causal=True, **common)
        step.planned = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                layout: BatchLayout, prepared: _FlashInferStep) -> torch.Tensor:
        write_kv(layer_cache, k, v, layout.slot_mapping, layout.write_rows)
        if not prepared.planned:
            self._plan(prepared, q.dtype, layer_cache.dtype)
        return prepared.wrapper.run(q.contiguous(), (layer_cache[0], layer_cache[1]))
