"""Single-query attention read in place from the paged KV cache.

A decode row (and a fully cached prompt's last query) attends over its whole context. The plain
way, `k_cache[block_table]` and then SDPA, copies every request's context out of the cache in
every layer: on a CPU that copy alone costs more than the attention math (bench/RESULTS.md).

Here the math is written as reductions over *slot ids*: `slots[b, j]` is the cache slot of
request b's key j, computed once per step from the block tables and shared by all layers. Compiled
by inductor, the gather `k_flat[slots]` is fused into the score and output loops, so each key and
value is read once, straight from its block, and never materialised.

- `decode_slots`: slot ids and the key count per row, padded to a batch of >= 2 rows and >= 2
  keys (the compiler specialises sizes 0 and 1, so padding keeps one compiled kernel for every
  batch size and context length).
- `group_by_length`: the rows of a step in groups of similar context length, one kernel call
  each, so that a short row is not padded to the step's longest context.
- `paged_decode_reference`: the same math, eager: the definition the compiled kernel is tested
  against, and readable.
- `PagedDecodeKernel`: compiles it ahead of time (AOTInductor) with dynamic batch, context and
  cache sizes into a package in the chunkwise cache, built once per machine and head geometry
  and loaded in milliseconds by every later start (aot_package.py); checks it on a warm-up batch,
  and says why when it cannot run (no C++ compiler, --enforce-eager): the caller then uses the
  folded-query SDPA path instead.

Softmax runs in float32 whatever the cache dtype. A row's padded keys (past its own context)
are masked to -inf, and `decode_slots` points them at the row's own last key: a padded key's
weight is exactly 0 and its value one this request wrote, so stale data in a slot the request
does not own (even NaN) is never read, and the values need no mask of their own.
"""

from __future__ import annotations

import inspect
import os
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import aot_package


# Rows and keys are padded to at least this many, so that no dynamic size is 0 or 1.
MIN_PADDED = 2
# (rows, keys) of the warm-up calls: a typical decode batch first (also the export's example,
# whose sizes guide the compiler's loop planning), then the smallest.
WARM_UP_SHAPES = ((32, 512), (2, 5))
WARM_UP_SLOTS = 256
# Inductor decides which loops run in parallel from the example's sizes (the hints) and keeps
# that decision for every later size. cpp.dynamic_threads keeps at least the outer loop of
# every loop nest parallel whatever the hints said: without it, after a small warm-up batch the
# softmax reductions were compiled `omp single`, one core idle for a third of the kernel.
# assert_indirect_indexing off: the generated loops would bounds-check every slot id they load
# (a compare and branch in the innermost loop; 10% of the kernel in fp32, bench/RESULTS.md).
# `PagedDecodeKernel.check_slots` checks them all once per step instead, before any layer runs.
COMPILE_OPTIONS = {"cpp.dynamic_threads": True, "assert_indirect_indexing": False}
# Bytes in one SIMD register of this CPU (AVX-512: 64, AVX2: 32). The package is per CPU already
# (its key has the ISA), so the width can follow the CPU. The values' sum goes in pieces of one
# register's worth of cache elements (value_piece).
VECTOR_BYTES = 64 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 32
# Part of the package's cache key: bump it when what is exported changes in a way the key's
# other parts (the functions' source, the options, torch) do not show.
PACKAGE_FORMAT = 2
# The packages' name prefix (and what pruning deletes: aot_package.prune_idle_packages).
PACKAGE_KIND = "paged_decode"


# A kernel call pads its rows to its longest context and computes every padded key (masked), so
# rows of very different lengths go in separate calls: a group ends where a context is shorter
# than DECODE_GROUP_FILL x the group's longest (under 1/8 of a group's keys wasted), and there are
# at most DECODE_GROUPS_MAX calls a layer. A call costs ~15 us over its work, about 100 keys of
# one row (bench/RESULTS.md section 2), so even a row split off alone pays for itself.
DECODE_GROUP_FILL = 0.875
DECODE_GROUPS_MAX = 4


def group_by_length(lens: list[int], fill: float = DECODE_GROUP_FILL,
                    max_groups: int = DECODE_GROUPS_MAX) -> list[list[int]]:
    """Indices into `lens` in groups, longest contexts first: in each group the shortest context
    is at least `fill` x the longest, except in the last group once there are `max_groups`,
    which takes all the rest."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        if groups and (len(groups) == max_groups or lens[i] >= fill * lens[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def value_piece(dtype: torch.dtype) -> int:
    """Cache elements per piece of the values' sum: one SIMD register's worth as stored (bf16 on
    AVX-512: 32), so that each piece is one full-width load. Pieces of a register's worth of
    *floats* (16) made every bf16 load a masked half-register one: the kernel 1.2-1.6x slower
    (bench/RESULTS.md section 2)."""
    return VECTOR_BYTES // dtype.itemsize


def decode_slots(block_table: torch.Tensor, lens: list[int], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot ids [B', L] int64 and key counts [B'] int64 for single-query rows with contexts
    `lens`, whose block tables are the rows of `block_table` [B, >= cdiv(max(lens), block_size)].
    B' = max(B, 2) and L = max(max(lens), 2). A row's positions past its own context (padding to
    L) repeat the slot of its last key, so every slot a row names is one of its own: the kernel
    masks those keys' scores and never needs to mask their values. Padding rows attend to one
    key, slot 0 (any valid index will do: their output is discarded)."""
    device = block_table.device
    b = len(lens)
    width = max(max(lens), MIN_PADDED)
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    pos = torch.minimum(torch.arange(width, device=device)[None, :], lens_t[:, None] - 1)  # [B, L]
    slots = block_table.gather(1, pos // block_size) * block_size + pos % block_size
    if b < MIN_PADDED:
        pad = MIN_PADDED - b
        slots = torch.cat([slots, slots.new_zeros(pad, width)])
        lens_t = torch.cat([lens_t, lens_t.new_ones(pad)])
    return slots, lens_t


def paged_decode_reference(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor,
                           lens: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Attention of one query per row over keys `k_flat[slots[b, :lens[b]]]`.

    q [B, H, D]; k_flat, v_flat [num_slots, KVH, D] (a layer's cache, blocks flattened);
    slots [B, L] int64; lens [B] int64. Returns [B, H, D] in q's dtype. The query heads of one
    KV head are its consecutive H / KVH heads (the GQA convention). Keys at positions >= lens[b]
    get no weight, but their values are read: their slots must hold finite values, as the
    row's own slots from decode_slots do."""
    b, h, d = q.shape
    kvh = k_flat.shape[1]
    length = slots.shape[1]
    valid = (torch.arange(length, device=q.device)[None, :] < lens[:, None])[:, :, None, None]  # [B, L, 1, 1]
    qf = q.float().view(b, 1, kvh, h // kvh, d)
    # k_flat[slots], written as an embedding lookup: the same rows, but compiled, an index into
    # k_flat[...] is wrapped if negative at every load (a test and a conditional move in the
    # innermost loops), and an embedding index is not (~7% of the kernel in float32,
    # bench/RESULTS.md). Slot ids are never negative: check_slots checks them once per step.
    keys = F.embedding(slots, k_flat.flatten(1)).float().view(b, length, kvh, d)
    # Each query head's scores as a sum of its own: sibling sums over the same key, which
    # inductor fuses into one loop over the head dimension with an accumulator per query head,
    # so that a key is loaded (and in bf16 converted) once for all H / KVH heads, not once each:
    # the kernel 1.09-1.20x faster in bf16, 1.06-1.09x in float32, outputs bit for bit the same
    # (bench/RESULTS.md section 2). (The same split of the values' sum made it slower.)
    scores = torch.stack([(qf[:, :, :, i] * keys).sum(-1) for i in range(h // kvh)], -1) * scale  # [B, L, KVH, G]
    scores = scores.masked_fill(~valid, float("-inf"))
    weights = torch.exp(scores - scores.amax(1, keepdim=True))
    denom = weights.sum(1)  # [B, KVH, G]
    # No mask on the values: a padded key's weight is exp(-inf) = 0, and its slot is the row's
    # own last key (decode_slots), so 0 x a value this request wrote adds exactly 0. (A mask
    # here cost a compare and a blend per value vector: the fp32 kernel ~1.1x slower.)
    values = F.embedding(slots, v_flat.flatten(1)).float().view(b, length, kvh, 1, d)
    # The weighted sum of the values in pieces of the head dimension, one SIMD register of
    # cache elements each (value_piece). Compiled, a sum over the keys gets one accumulator per
    # output vector and a pass over the keys of its own: over the whole head dimension that was
    # a pass over a row's values per query head and vector (24 for SmolLM2's heads on AVX2),
    # each waiting on its one accumulator. The pieces are sibling sums over the same keys, which
    # inductor fuses into one pass with an accumulator each (3 passes): the kernel 1.25x faster
    # in float32 (bench/paged_kernel_ab.py, bench/RESULTS.md section 2). Each output is the
    # same sum in the same order whatever the pieces: the builds' outputs are bit for bit equal.
    weighted = weights.unsqueeze(-1)
    pieces = values.split(value_piece(v_flat.dtype), dim=-1)
    out = torch.cat([(weighted * part).sum(1) for part in pieces], -1)
    out = out / denom.unsqueeze(-1)  # [B, KVH, G, D]
    return out.reshape(b, h, d).to(q.dtype)


class PagedDecodeKernel:
    """`paged_decode_reference`, compiled ahead of time by AOTInductor for every batch size,
    context length and cache size, and kept as a package in the chunkwise cache. Construct with
    the model's head geometry; `ready` tells whether it may be used (else `reason` says why not),
    after a warm-up run checked against the reference. Why ahead of time: aot_package.py."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, enforce_eager: bool, cache_dir: str | os.PathLike[str] | None = None):
        self.package: Path | None = None

        def load() -> str:
            self.package = package_path(num_heads, num_kv_heads, head_dim, dtype, cache_dir)
            # `_build` looked up at the call, so that tests can stand in for the compiler.
            self._runner, how = aot_package.load_or_build(
                self.package, lambda path: _build(path, num_heads, num_kv_heads, head_dim, dtype),
                "paged decode kernel", PACKAGE_KIND)
            self._warm_up(num_heads, num_kv_heads, head_dim, dtype, device)
            return how

        self.ready, detail = aot_package.start_kernels(
            "the paged decode kernel", "using folded-query SDPA over gathered blocks", device, enforce_eager, load)
        self.reason = f"paged decode kernel, AOTInductor-compiled ({detail}: {self.package})" if self.ready else detail

    def _warm_up(self, h: int, kvh: int, d: int, dtype: torch.dtype, device: torch.device) -> None:
        # Two different shapes, one of them the smallest a call can have, each checked against
        # the reference: a stale or damaged package is caught here, before the server is ready.
        g = torch.Generator(device="cpu").manual_seed(0)
        k_flat = torch.randn(WARM_UP_SLOTS, kvh, d, generator=g).to(device, dtype)
        v_flat = torch.randn(WARM_UP_SLOTS, kvh, d, generator=g).to(device, dtype)
        with torch.inference_mode():
            for b, length in WARM_UP_SHAPES:
                q = torch.randn(b, h, d, generator=g).to(device, dtype)
                slots = torch.randint(0, WARM_UP_SLOTS, (b, length), generator=g).to(device)
                lens = torch.tensor([length] + [length - 1] * (b - 1), device=device)
                got = self(q, k_flat, v_flat, slots, lens, d**-0.5)
                want = paged_decode_reference(q, k_flat, v_flat, slots, lens, d**-0.5)
                tol = 1e-4 if dtype == torch.float32 else 2e-2
                if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
                    raise RuntimeError("the compiled kernel disagrees with the reference on the warm-up batch")

    def generated_cpp(self) -> str:
        """The C++ source of the package's kernel (what inductor wrote), for tests and curiosity."""
        assert self.package is not None
        with zipfile.ZipFile(self.package) as z:
            return "\n".join(z.read(n).decode() for n in z.namelist() if n.endswith(".kernel.cpp"))

    @staticmethod
    def check_slots(slots: torch.Tensor, num_slots: int) -> None:
        """Every slot id inside the cache: the compiled kernel does not check the ids it loads.
        They come from block tables the runner validated, so this failing is a bug here."""
        if slots.numel() and not (int(slots.min()) >= 0 and int(slots.max()) < num_slots):
            raise IndexError(f"paged decode: a slot id outside the cache [0, {num_slots})")

    def __call__(self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor,
                 lens: torch.Tensor, scale: float) -> torch.Tensor:
        # Every size is dynamic in the package (none is ever 0 or 1, see decode_slots). The
        # query goes in as float32, whatever the cache's dtype: the reference converts it first
        # anyway, and compiled, that conversion would be redone for every key it meets (12% of
        # a bf16 call; bench/RESULTS.md section 2). The output is rounded to q's dtype after.
        inputs = [q.float(), k_flat, v_flat, slots, lens, aot_package.scalar_tensor(scale)]
        return self._runner.run(inputs)[0].to(q.dtype)


def package_path(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the package for this geometry lives (its name hashes the kernel's source and
    options, torch and the CPU: aot_package.package_path)."""
    key = {
        "format": PACKAGE_FORMAT, "source": inspect.getsource(paged_decode_reference),
        "export": inspect.getsource(_ExportedKernel), "options": COMPILE_OPTIONS, "value_piece": value_piece(dtype),
        "geometry": [num_heads, num_kv_heads, head_dim, str(dtype)],
    }
    prefix = f"{PACKAGE_KIND}_{str(dtype).removeprefix('torch.')}_{num_heads}x{num_kv_heads}x{head_dim}"
    return aot_package.package_path(prefix, key, cache_dir)


class _ExportedKernel(torch.nn.Module):
    """The reference as a module, for torch.export; the scale is an input (a 0-d float32 tensor),
    so one package serves any model with this head geometry."""

    def forward(self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor,
                lens: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return paged_decode_reference(q, k_flat, v_flat, slots, lens, scale)


def _build(path: Path, h: int, kvh: int, d: int, dtype: torch.dtype) -> None:
    """Export the reference with dynamic batch, key count and cache size, compile it with
    AOTInductor and write the package to `path`."""
    from torch.export import Dim, export

    rows, keys, slots_n = Dim("rows", min=MIN_PADDED), Dim("keys", min=MIN_PADDED), Dim("slots", min=MIN_PADDED)
    # The example's sizes are the hints inductor plans the loops by: a typical decode batch.
    b, length = WARM_UP_SHAPES[0]
    example = (torch.randn(b, h, d), torch.randn(WARM_UP_SLOTS, kvh, d).to(dtype),  # q: float32, see __call__
               torch.randn(WARM_UP_SLOTS, kvh, d).to(dtype), torch.randint(0, WARM_UP_SLOTS, (b, length)),
               torch.full((b,), length), torch.tensor(d**-0.5))
    dynamic = ({0: rows}, {0: slots_n}, {0: slots_n}, {0: rows, 1: keys}, {0: rows}, None)
    program = export(_ExportedKernel(), example, dynamic_shapes=dynamic)
    aot_package.compile_to_package(program, path, COMPILE_OPTIONS)
