"""The attention backend interface and the per-step batch layout every backend reads.

One step's batch is a flat sequence of T query tokens: request r owns rows
`[query_start[r], query_start[r + 1])`, which are its positions `[num_computed[r],
context_lens[r])`. Every layer first writes the K/V of the rows that must be written (those at or
after the request's kv_write_start) into their slots, for the whole batch, and only then attends:
each request's queries attend to keys `[0, context_lens[r])` read back from the paged cache
through its block table (cached prefix blocks, earlier chunks and this chunk alike), causally
with the chunk offset: query at position p sees keys 0..p.

Writing the whole batch before attending also makes a block computed by one request in this step
readable by another request in the same step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..kv_cache import KVCache


@dataclass
class BatchLayout:
    num_tokens: int
    block_size: int
    query_start: list[int]  # R + 1 offsets into the flat batch
    num_computed: list[int]  # per request: position of its first query row
    context_lens: list[int]  # per request: keys attended (= its chunk's end)
    num_blocks: list[int]  # per request: blocks covering [0, context_len)
    block_table: torch.Tensor  # [R, max(num_blocks)] int64 on the device, padded with 0
    slot_mapping: torch.Tensor  # [W] int64 slots receiving K/V this step (device)
    write_rows: torch.Tensor | None  # [W] int64 batch rows written there; None: every row, in order

    @property
    def num_requests(self) -> int:
        return len(self.context_lens)

    @property
    def query_lens(self) -> list[int]:
        return [b - a for a, b in zip(self.query_start, self.query_start[1:])]


class AttentionBackend(ABC):
    name: ClassVar[str]

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale

    @classmethod  # noqa: B027 (a hook: every block size is fine unless a backend says otherwise)
    def check_block_size(cls, block_size: int) -> None:
        """Raise ValueError if this backend cannot use a paged cache with this block size."""

    @abstractmethod
    def prepare(self, layout: BatchLayout) -> Any:
        """Per-step precomputation shared by all layers (masks, cumulative lengths, ...)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                layout: BatchLayout, prepared: Any) -> torch.Tensor:
        """Write this step's K/V into `layer_cache` and return attention output [T, H, D] for
        q [T, H, D] (k, v: [T, KVH, D], already rotated)."""


class StepAttention:
    """The `attend(layer_idx, q, k, v)` callable the model calls, bound to one step's layout."""

    def __init__(self, backend: AttentionBackend, kv_cache: KVCache, layout: BatchLayout):
        self.backend = backend
        self.kv_cache = kv_cache
        self.layout = layout
        self.prepared = backend.prepare(layout)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = self.layout.num_tokens
        layer_cache = self.kv_cache.layers[layer_idx]
        if q.shape[0] == n:
            return self.backend.forward(q, k, v, layer_cache, self.layout, self.prepared)
        # The engine padded the batch past the layout's rows (to a row count its linear layers
        # have kernels for; packed_linear.padded_rows). Those rows are no tokens: they write no
        # K/V, attend to nothing, and their output is zero.
        out = torch.empty_like(q)
        out[n:].zero_()
        out[:n] = self.backend.forward(q[:n], k[:n], v[:n], layer_cache, self.layout, self.prepared)
        return out
