"""The decoder's element-wise work between its matmuls: residual add + RMSNorm, and RoPE, compiled.

Eager torch runs each op as its own kernel, one pass over memory and one parallel region each: a
bf16 RMSNorm is seven (to float32, square, mean, add epsilon and rsqrt, multiply, round to bf16,
multiply by the weight), RoPE on q and k four multiplies and two adds. Inductor fuses a residual
add and the RMSNorm after it into one kernel (two outputs: the new residual stream and the normed
input of the next matmul), and RoPE into one. Measured on the seed-shaped workload in bf16 (Zen 5):
the whole run 1.10x faster, its mixed steps ~1.09x, its decode-only steps ~1.07x
(bench/RESULTS.md section 2); vLLM's CPU build compiles the same parts with inductor.

The model (llama.py) calls the ops through a `LayerOps`:
- `EAGER`: the references, plain torch; the definition the compiled ops are tested against.
- `CompiledLayerOps`: both ops from AOTInductor packages (aot_package.py) built for the model's
  shapes with the token count dynamic (at least 2; a single row takes the reference), compiled
  with inductor's `emulate_precision_casts`, so that bf16 intermediates are rounded where eager
  torch rounds them; checked on a warm-up batch. `ready` is False (and `reason` says why) with
  --enforce-eager, off CPU, without a C++ compiler, or when a build fails: the model then runs
  the references.

Numerics: RoPE compiled is bit for bit the reference (tests/executor/test_layer_ops.py). The
compiled RMSNorm sums its squares in another order than torch's ops, so a row's values may differ
in their last bits in float32 (up to ~3 units of its rounding), and in bf16 a few values in 10^4
by one bf16 step. Each row is computed the same in any batch.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import aot_package
from .rope import apply_rotary


# Token counts of the exports' examples and the least a package takes (the compiler specialises 0 and 1).
EXAMPLE_TOKENS = 64
MIN_TOKENS = 2
# emulate_precision_casts: round bf16 intermediates where eager torch rounds them (inductor would
# otherwise keep fused intermediates in float32, a different result from the reference's).
COMPILE_OPTIONS = {"cpp.dynamic_threads": True, "emulate_precision_casts": True}


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float | torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalised in float32, rounded to x's dtype, then times the weight."""
    if x.dtype == torch.float32 and not isinstance(eps, torch.Tensor):
        # One call, bit for bit the formula below in float32 (not in bf16, where torch's op
        # rounds after the weight multiply and the reference before it).
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream x plus a layer's output delta (rounded to x's dtype, as the reference
    adds them), and that sum RMS-normed: (x + delta, rms_norm(x + delta))."""
    x = x + delta
    return x, rms_norm_reference(x, weight, eps)


def rotary_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated_heads: int,
                     head_dim: int) -> torch.Tensor:
    """The first `rotated_heads` heads of a fused q/k/v projection output qkv [T, >= rotated_heads
    x head_dim] (q's heads, then k's), rotated by the per-token angles cos, sin [T, 1, head_dim // 2]
    (rope.py: `RotaryEmbedding.cos_sin`): a new contiguous [T, rotated_heads, head_dim].

    The same values as rope.apply_rotary, written as one `cat` of the two halves: the form
    inductor fuses into one pass (apply_rotary's `out=` writes compile into four)."""
    t = qkv.shape[0]
    x = qkv[:, : rotated_heads * head_dim].view(t, rotated_heads, head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class LayerOps:
    """The element-wise ops a decoder layer calls; this class runs the references (eager torch)."""

    name = "eager"

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm_reference(x, delta, weight, eps)

    def rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated_heads: int,
               head_dim: int) -> torch.Tensor:
        # apply_rotary, not the cat: in eager torch it makes fewer passes over memory.
        t = qkv.shape[0]
        return apply_rotary(qkv[:, : rotated_heads * head_dim].view(t, rotated_heads, head_dim), cos, sin)


EAGER = LayerOps()


class _AddRmsNorm(torch.nn.Module):
    def forward(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm_reference(x, delta, weight, eps)


class _Rotary(torch.nn.Module):
    def __init__(self, rotated_heads: int, head_dim: int):
        super().__init__()
        self.rotated_heads, self.head_dim = rotated_heads, head_dim

    def forward(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotary_reference(qkv, cos, sin, self.rotated_heads, self.head_dim)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def add_rms_norm_package(hidden: int, dtype: torch.dtype,
                         cache_dir: str | os.PathLike[str] | None = None) -> tuple[str, Path]:
    """The package's name prefix (its kind and shapes: what pruning groups by) and its path."""
    prefix = f"add_rms_norm_{_dtype_name(dtype)}_{hidden}"
    key = {"source": [_source(add_rms_norm_reference), _source(rms_norm_reference)], "options": COMPILE_OPTIONS,
           "hidden": hidden, "dtype": str(dtype), "example": EXAMPLE_TOKENS}
    return prefix, aot_package.package_path(prefix, key, cache_dir)


def rotary_package(qkv_width: int, rotated_heads: int, head_dim: int, dtype: torch.dtype,
                   cache_dir: str | os.PathLike[str] | None = None) -> tuple[str, Path]:
    prefix = f"rotary_{_dtype_name(dtype)}_{qkv_width}_{rotated_heads}x{head_dim}"
    key = {"source": _source(rotary_reference), "options": COMPILE_OPTIONS, "qkv_width": qkv_width,
           "rotated_heads": rotated_heads, "head_dim": head_dim, "dtype": str(dtype), "example": EXAMPLE_TOKENS}
    return prefix, aot_package.package_path(prefix, key, cache_dir)


def _source(fn) -> str:
    return inspect.getsource(fn)


def _example(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _build_add_rms_norm(hidden: int, dtype: torch.dtype, path: Path) -> None:
    from torch.export import Dim, export

    tokens = Dim("tokens", min=MIN_TOKENS)
    # Distinct example tensors: export would treat one tensor passed twice as one input.
    example = (_example((EXAMPLE_TOKENS, hidden), dtype, 0), _example((EXAMPLE_TOKENS, hidden), dtype, 1),
               _example((hidden,), dtype, 2), torch.tensor(1e-5))
    program = export(_AddRmsNorm(), example, dynamic_shapes=({0: tokens}, {0: tokens}, None, None))
    aot_package.compile_to_package(program, path, COMPILE_OPTIONS)


def _build_rotary(qkv_width: int, rotated_heads: int, head_dim: int, dtype: torch.dtype, path: Path) -> None:
    from torch.export import Dim, export

    tokens = Dim("tokens", min=MIN_TOKENS)
    half = (EXAMPLE_TOKENS, 1, head_dim // 2)
    example = (_example((EXAMPLE_TOKENS, qkv_width), dtype, 0), _example(half, dtype, 1), _example(half, dtype, 2))
    program = export(_Rotary(rotated_heads, head_dim), example, dynamic_shapes=({0: tokens}, {0: tokens}, {0: tokens}))
    aot_package.compile_to_package(program, path, COMPILE_OPTIONS)


class CompiledLayerOps(LayerOps):
    """Both ops from AOTInductor packages for one model's shapes; use it only where `ready`."""

    name = "compiled"

    def __init__(self, hidden: int, qkv_width: int, rotated_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, enforce_eager: bool, cache_dir: str | os.PathLike[str] | None = None):
        self.hidden, self.qkv_width, self.rotated_heads, self.head_dim = hidden, qkv_width, rotated_heads, head_dim
        self.dtype = dtype

        def load() -> str:
            prefix, path = add_rms_norm_package(hidden, dtype, cache_dir)
            self._add_rms_norm, how_norm = aot_package.load_or_build(
                path, lambda p: _build_add_rms_norm(hidden, dtype, p), "residual add + RMSNorm kernel", prefix)
            prefix, path = rotary_package(qkv_width, rotated_heads, head_dim, dtype, cache_dir)
            self._rotary, how_rotary = aot_package.load_or_build(
                path, lambda p: _build_rotary(qkv_width, rotated_heads, head_dim, dtype, p), "RoPE kernel", prefix)
            self._warm_up()
            return how_norm if how_norm == how_rotary else f"{how_norm} and {how_rotary}"

        self.ready, detail = aot_package.start_kernels("the element-wise kernels", "eager element-wise ops", device,
                                                       enforce_eager, load)
        self.reason = f"compiled residual add + RMSNorm and RoPE ({detail})" if self.ready else detail

    def _warm_up(self) -> None:
        # The smallest and a typical token count, each checked against the reference before the
        # server reports ready: RoPE bit for bit, the RMSNorm to its summation order's rounding.
        with torch.inference_mode():
            for tokens in (MIN_TOKENS, EXAMPLE_TOKENS + 3):
                x, delta = _example((tokens, self.hidden), self.dtype, 3), _example((tokens, self.hidden), self.dtype, 4)
                weight = _example((self.hidden,), self.dtype, 5)
                got, want = self.add_rms_norm(x, delta, weight, 1e-5), add_rms_norm_reference(x, delta, weight, 1e-5)
                if not torch.equal(got[0], want[0]) or not _within_rounding(got[1], want[1]):
                    raise RuntimeError("the compiled residual add + RMSNorm disagrees with the reference")
                qkv = _example((tokens, self.qkv_width), self.dtype, 6)
                cos, sin = (_example((tokens, 1, self.head_dim // 2), self.dtype, s) for s in (7, 8))
                got_r = self.rotary(qkv, cos, sin, self.rotated_heads, self.head_dim)
                if not torch.equal(got_r, rotary_reference(qkv, cos, sin, self.rotated_heads, self.head_dim)):
                    raise RuntimeError("the compiled RoPE disagrees with the reference")

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if x.shape[0] < MIN_TOKENS:
            return add_rms_norm_reference(x, delta, weight, eps)
        x, h = self._add_rms_norm.run([x.contiguous(), delta.contiguous(), weight, aot_package.scalar_tensor(eps)])
        return x, h

    def rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated_heads: int,
               head_dim: int) -> torch.Tensor:
        """As the reference, for the shapes the package was built for."""
        if qkv.shape[0] < MIN_TOKENS:
            return super().rotary(qkv, cos, sin, rotated_heads, head_dim)
        return self._rotary.run([qkv.contiguous(), cos.contiguous(), sin.contiguous()])[0]


def _within_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to what another summation order can change: one bf16 step, a few float32 ones."""
    step = torch.finfo(want.dtype).eps * (4 if want.dtype == torch.float32 else 1)
    return bool(((got.float() - want.float()).abs() <= step * want.float().abs()).all())
