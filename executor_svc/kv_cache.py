"""The paged KV cache: one tensor per layer, allocated once per `initialize(block_size)`.

Layout per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`, index 0 keys, 1 values.
`layer[0]` and `layer[1]` are each contiguous `[num_blocks, block_size, kv_heads, head_dim]`
tensors, which is the paged layout flash-attn's `block_table` arguments expect, and the torch
backend gathers whole blocks from them with one index_select.

A token at position p of a request lives in slot `block_table[p // block_size] * block_size +
p % block_size`; writes go through the flat `[num_blocks * block_size, kv_heads, head_dim]` view.
The cache is zero-filled so never-written slots read as finite numbers (a kernel that multiplies
masked probabilities by garbage NaNs would otherwise poison outputs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("chunkwise.executor.kv_cache")

GIB = 1 << 30


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem


class KVCache:
    def __init__(self, shape: KVCacheShape, num_blocks: int, block_size: int, device: torch.device | str):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.layers: list[torch.Tensor] = [
            torch.zeros((2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim),
                        dtype=shape.dtype, device=self.device)
            for _ in range(shape.num_layers)
        ]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `layer` as [num_slots, kv_heads, head_dim] views."""
        kv = self.layers[layer]
        return kv[0].view(self.num_slots, *kv.shape[3:]), kv[1].view(self.num_slots, *kv.shape[3:])


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             rows: torch.Tensor | None) -> None:
    """Store k/v rows into their slots. `rows` selects which batch rows are written (positions at
    or after each request's kv_write_start); None means all rows, in order."""
    if slot_mapping.numel() == 0:
        return
    if rows is not None:
        k, v = k.index_select(0, rows), v.index_select(0, rows)
    _, num_blocks, block_size, heads, dim = layer_cache.shape
    layer_cache[0].view(num_blocks * block_size, heads, dim).index_copy_(0, slot_mapping, k)
    layer_cache[1].view(num_blocks * block_size, heads, dim).index_copy_(0, slot_mapping, v)


def blocks_for_memory(shape: KVCacheShape, block_size: int, budget_bytes: int) -> int:
    return int(budget_bytes // shape.bytes_per_block(block_size))


def plan_num_blocks(
    shape: KVCacheShape,
    block_size: int,
    device: torch.device,
    num_kv_blocks: int | None,
    gpu_memory_utilization: float,
    kv_cache_space_gib: float,
) -> int:
    """How many blocks to allocate: `num_kv_blocks` if given, else from memory (CUDA: a
    fraction of the memory free after loading the weights, leaving the rest for activations;
    CPU: a fixed number of GiB)."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free * gpu_memory_utilization)
        where = f"{gpu_memory_utilization:.2f} x {free / GIB:.1f} GiB free of {total / GIB:.1f} GiB"
    else:
        budget = int(kv_cache_space_gib * GIB)
        where = f"--kv-cache-space {kv_cache_space_gib} GiB"
    blocks = blocks_for_memory(shape, block_size, budget)
    if blocks < 1:
        raise RuntimeError(
            f"not enough memory for a single KV block of {shape.bytes_per_block(block_size)} bytes "
            f"({where}); lower the block size or give more memory"
        )
    logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s)", blocks, block_size,
                blocks * shape.bytes_per_block(block_size) / GIB, where)
    return blocks
