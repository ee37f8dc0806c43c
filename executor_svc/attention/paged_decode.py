"""Single-query attention read in place from the paged KV cache.

A decode row (and a fully cached prompt's last query) attends over its whole context. The plain
way, `k_cache[block_table]` and then SDPA, copies every request's context out of the cache in
every layer: on a CPU that copy alone costs more than the attention math (bench/RESULTS.md).

Here the math is written as reductions over *slot ids*: `slots[b, j]` is the cache slot of
request b's key j, computed once per step from the block tables and shared by all layers. With
torch.compile (inductor), the gather `k_flat[slots]` is fused into the score and output loops, so
each key and value is read once, straight from its block, and never materialised.

- `decode_slots`: slot ids and the key count per row, padded to a batch of >= 2 rows and >= 2
  keys (the compiler specialises sizes 0 and 1, so padding keeps one compiled kernel for every
  batch size and context length).
- `paged_decode_reference`: the same math, eager: the definition the compiled kernel is tested
  against, and readable.
- `PagedDecodeKernel`: compiles it once with dynamic batch, context and cache sizes, warms it
  up, and says why when it cannot (no C++ compiler, --enforce-eager): the caller then uses the
  folded-query SDPA path instead.

Softmax runs in float32 whatever the cache dtype; padded keys are masked to -inf and their
values to zero, so stale data in a slot the request does not own (even NaN) cannot leak in.
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import torch

from chunkwise.plan import cdiv

logger = logging.getLogger("chunkwise.executor.attention")

# Rows and keys are padded to at least this many, so that no dynamic size is 0 or 1.
MIN_PADDED = 2
# (rows, keys) of the warm-up calls: a typical decode batch first (its sizes guide the compiler's
# loop planning), then a small one, which must run without a recompile.
WARM_UP_SHAPES = ((32, 512), (2, 5))
WARM_UP_SLOTS = 256
# Inductor decides which loops run in parallel from the sizes of the first call (the hints) and
# keeps that decision for every later size. cpp.dynamic_threads keeps at least the outer loop of
# every loop nest parallel whatever the hints said: without it, after a small warm-up batch the
# softmax reductions were compiled `omp single`, one core idle for a third of the kernel.
# assert_indirect_indexing off: the generated loops would bounds-check every slot id they load
# (a compare and branch in the innermost loop; 10% of the kernel in fp32, bench/RESULTS.md).
# `PagedDecodeKernel.check_slots` checks them all once per step instead, before any layer runs.
COMPILE_OPTIONS = {"cpp.dynamic_threads": True, "assert_indirect_indexing": False}


def decode_slots(block_table: torch.Tensor, lens: list[int], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot ids [B', L] int64 and key counts [B'] int64 for single-query rows with contexts
    `lens`, whose block tables are the rows of `block_table` [B, nb]. B' = max(B, 2) and L =
    max(max(lens), 2). Padding rows attend to one key, slot 0 (any valid index will do: their
    output is discarded)."""
    device = block_table.device
    b = len(lens)
    width = max(max(lens), MIN_PADDED)
    nb = cdiv(width, block_size)
    if block_table.shape[1] < nb:  # the padded key range may need one more (masked) block column
        block_table = torch.nn.functional.pad(block_table, (0, nb - block_table.shape[1]))
    pos = torch.arange(width, device=device)
    slots = block_table[:, pos // block_size] * block_size + pos % block_size
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    if b < MIN_PADDED:
        pad = MIN_PADDED - b
        slots = torch.cat([slots, slots.new_zeros(pad, width)])
        lens_t = torch.cat([lens_t, lens_t.new_ones(pad)])
    return slots, lens_t


def paged_decode_reference(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor,
                           lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one query per row over keys `k_flat[slots[b, :lens[b]]]`.

    q [B, H, D]; k_flat, v_flat [num_slots, KVH, D] (a layer's cache, blocks flattened);
    slots [B, L] int64; lens [B] int64. Returns [B, H, D] in q's dtype. The query heads of one
    KV head are its consecutive H / KVH heads (the GQA convention)."""
    b, h, d = q.shape
    kvh = k_flat.shape[1]
    length = slots.shape[1]
    valid = (torch.arange(length, device=q.device)[None, :] < lens[:, None])[:, :, None, None]  # [B, L, 1, 1]
    qf = q.float().view(b, 1, kvh, h // kvh, d)
    keys = k_flat[slots].float().view(b, length, kvh, 1, d)
    scores = (qf * keys).sum(-1) * scale  # [B, L, KVH, G]
    scores = scores.masked_fill(~valid, float("-inf"))
    weights = torch.exp(scores - scores.amax(1, keepdim=True))
    denom = weights.sum(1)  # [B, KVH, G]
    values = torch.where(valid, v_flat[slots].float(), 0.0).view(b, length, kvh, 1, d)
    out = (weights.unsqueeze(-1) * values).sum(1) / denom.unsqueeze(-1)  # [B, KVH, G, D]
    return out.reshape(b, h, d).to(q.dtype)


def inductor_cache_dir() -> str:
    """Where inductor keeps compiled kernels: $TORCHINDUCTOR_CACHE_DIR if set, else under the
    chunkwise cache root, so that a second start reuses the first one's compile."""
    from chunkwise.model_source import cache_root

    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(cache_root() / "inductor")


def compiler_unavailable_reason(device: torch.device) -> str | None:
    """None if inductor can build CPU kernels here, else why not."""
    if device.type != "cpu":
        return f"the compiled paged decode kernel is built for CPU only (device {device})"
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None and shutil.which("c++") is None and shutil.which("clang++") is None:
        return f"no C++ compiler found ({cxx}, c++ or clang++ on PATH), which inductor needs"
    return None


class PagedDecodeKernel:
    """`paged_decode_reference`, compiled by inductor once for every batch size, context length
    and cache size. Construct with the model's head geometry; `ready` tells whether it may be
    used (else `reason` says why not), after a warm-up run checked against the reference."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, enforce_eager: bool):
        self.ready = False
        self.compile_s = 0.0
        if enforce_eager:
            self.reason = "--enforce-eager: using folded-query SDPA over gathered blocks"
            return
        why = compiler_unavailable_reason(device)
        if why is not None:
            self.reason = f"{why}: using folded-query SDPA over gathered blocks"
            return
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
        self._fn = torch.compile(paged_decode_reference, dynamic=False, fullgraph=True, options=COMPILE_OPTIONS)
        t0 = time.perf_counter()
        try:
            self._warm_up(num_heads, num_kv_heads, head_dim, dtype, device)
        except Exception as e:  # a broken toolchain shows up here as any kind of error
            self.reason = f"inductor could not build the kernel ({type(e).__name__}: {str(e)[:200]}): " \
                          "using folded-query SDPA over gathered blocks"
            logger.warning("%s", self.reason)
            return
        self.compile_s = time.perf_counter() - t0
        self.ready = True
        self.reason = f"inductor-compiled paged decode kernel ({self.compile_s:.1f} s to build or load)"

    def _warm_up(self, h: int, kvh: int, d: int, dtype: torch.dtype, device: torch.device) -> None:
        # Called the way the executor calls it, since grad mode and the tensors' kind are part of
        # the compiled code's guards: the KV cache is an ordinary tensor (allocated outside
        # inference mode), everything else is made inside it. Two different shapes, so the
        # kernel is known to serve new sizes without recompiling; the first is a typical decode
        # batch, since its sizes are the hints the compiler plans the loops by.
        g = torch.Generator(device="cpu").manual_seed(0)
        k_flat = torch.randn(WARM_UP_SLOTS, kvh, d, generator=g).to(device, dtype)
        v_flat = torch.randn(WARM_UP_SLOTS, kvh, d, generator=g).to(device, dtype)
        with torch.inference_mode():
            self._check_shapes(k_flat, v_flat, h, d, dtype, device, g)

    def _check_shapes(self, k_flat: torch.Tensor, v_flat: torch.Tensor, h: int, d: int, dtype: torch.dtype,
                      device: torch.device, g: torch.Generator) -> None:
        for b, length in WARM_UP_SHAPES:
            q = torch.randn(b, h, d, generator=g).to(device, dtype)
            slots = torch.randint(0, WARM_UP_SLOTS, (b, length), generator=g).to(device)
            lens = torch.tensor([length] + [length - 1] * (b - 1), device=device)
            got = self(q, k_flat, v_flat, slots, lens, d**-0.5)
            want = paged_decode_reference(q, k_flat, v_flat, slots, lens, d**-0.5)
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
                raise RuntimeError("the compiled kernel disagrees with the reference on the warm-up batch")

    @staticmethod
    def check_slots(slots: torch.Tensor, num_slots: int) -> None:
        """Every slot id inside the cache: the compiled kernel does not check the ids it loads.
        They come from block tables the runner validated, so this failing is a bug here."""
        if slots.numel() and not (int(slots.min()) >= 0 and int(slots.max()) < num_slots):
            raise IndexError(f"paged decode: a slot id outside the cache [0, {num_slots})")

    def __call__(self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor,
                 lens: torch.Tensor, scale: float) -> torch.Tensor:
        # Batch, context length and cache size vary from call to call; marking them dynamic
        # keeps one compiled kernel for all of them (they are never 0 or 1, see decode_slots).
        for t, dims in ((q, (0,)), (k_flat, (0,)), (v_flat, (0,)), (slots, (0, 1)), (lens, (0,))):
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(t, dim)
        return self._fn(q, k_flat, v_flat, slots, lens, scale)
