"""The softmax between the two GEMMs of the bf16 prefill path, compiled.

The GEMM path (torch_backend.py, PREFILL_GEMM_PIECE_ROWS) takes a piece's float32 products
q k^T [rows, keys] from one GEMM and needs the causal mask, the scale, exp(scores - row max) and
each row's sum before the second. The mask is each row's count of visible keys (its keys are a
prefix of the piece's), applied here, inside the softmax's own passes: an additive -inf mask added
by the GEMM cost a copy of a piece-sized bias into every GEMM's output (bench/RESULTS.md section 2).
In eager torch that is four passes over the scores (max, subtract, exp, sum), each a separate
kernel; on SmolLM2's chunk shapes they took ~40% of a piece on a Zen 5, as much as either GEMM.
Inductor fuses them into two passes (the max; then exp, store and sum) with its vectorised exp:
2.0-2.3x faster than the eager ops, a piece 1.19-1.27x faster (bench/RESULTS.md section 2).

- `prefill_softmax_reference`: the math, eager; the definition the package is tested against.
- `PrefillSoftmaxKernel`: the reference compiled ahead of time with dynamic rows and keys, one
  package per machine (aot_package.py), checked on a warm-up batch; `ready` is False (and
  `reason` says why) with --enforce-eager, without a C++ compiler, or when the build fails: the
  backend then runs the eager reference, which gives the same numbers up to exp's last bit.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import torch

from .. import aot_package


# Rows and keys of the export's example (the sizes inductor plans its loops by): a 96-row piece
# of SmolLM2 (9 query heads folded into 3 KV heads' rows: 3 x 3 x 96) over a 512-key context.
# Both sizes are dynamic, never below 2 (the compiler specialises 0 and 1).
EXAMPLE_ROWS, EXAMPLE_KEYS = 864, 512
MIN_SIZE = 2
COMPILE_OPTIONS = {"cpp.dynamic_threads": True}
PACKAGE_KIND = "prefill_softmax"


def prefill_softmax_reference(products: torch.Tensor, visible: torch.Tensor,
                              scale: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """products [rows, keys] float32 (q k^T); visible [rows] int64, how many of the keys (a
    prefix, at least 1) each row sees. With scores = scale x products over the visible keys and
    -inf elsewhere, returns exp(scores - each row's max) [rows, keys] (exactly 0 on masked keys)
    and their row sums [rows, 1]."""
    masked = torch.arange(products.shape[1], device=products.device)[None, :] >= visible[:, None]
    scores = (products * scale).masked_fill_(masked, float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp_()
    return weights, weights.sum(-1, keepdim=True)


class _ExportedSoftmax(torch.nn.Module):
    """The reference as a module; the scale is an input (a 0-d float32 tensor), so one package
    serves every model."""

    def forward(self, products: torch.Tensor, visible: torch.Tensor,
                scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return prefill_softmax_reference(products, visible, scale)


def package_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    key = {"source": inspect.getsource(prefill_softmax_reference), "options": COMPILE_OPTIONS,
           "example": [EXAMPLE_ROWS, EXAMPLE_KEYS]}
    return aot_package.package_path(PACKAGE_KIND, key, cache_dir)


def _build(path: Path) -> None:
    from torch.export import Dim, export

    rows = Dim("rows", min=MIN_SIZE)
    dynamic = ({0: rows, 1: Dim("keys", min=MIN_SIZE)}, {0: rows}, None)
    example = (torch.randn(EXAMPLE_ROWS, EXAMPLE_KEYS), torch.randint(1, EXAMPLE_KEYS + 1, (EXAMPLE_ROWS,)),
               torch.tensor(0.125))
    program = export(_ExportedSoftmax(), example, dynamic_shapes=dynamic)
    aot_package.compile_to_package(program, path, COMPILE_OPTIONS)


class PrefillSoftmaxKernel:
    """`prefill_softmax_reference` from an AOTInductor package; call it only where `ready`."""

    def __init__(self, device: torch.device, enforce_eager: bool,
                 cache_dir: str | os.PathLike[str] | None = None):
        self.package: Path | None = None

        def load() -> str:
            self.package = package_path(cache_dir)
            self._runner, how = aot_package.load_or_build(self.package, _build, "prefill softmax kernel",
                                                          PACKAGE_KIND)
            self._warm_up()
            return how

        self.ready, detail = aot_package.start_kernels("the prefill softmax kernel", "eager softmax", device,
                                                       enforce_eager, load)
        self.reason = f"compiled softmax ({detail})" if self.ready else detail

    def _warm_up(self) -> None:
        # Two shapes, the smallest and a typical one, with masked keys as the path has them,
        # each checked against the reference before the server reports ready.
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for rows, keys in ((MIN_SIZE, MIN_SIZE), (EXAMPLE_ROWS // 3, EXAMPLE_KEYS + 7)):
                products = torch.randn(rows, keys, generator=g) * 30
                visible = torch.randint(1, keys + 1, (rows,), generator=g)
                got, want = self(products, visible, 0.125), prefill_softmax_reference(products, visible, 0.125)
                for a, b in zip(got, want):
                    if not torch.allclose(a, b, atol=1e-6, rtol=1e-5):
                        raise RuntimeError("the compiled softmax disagrees with the reference on the warm-up batch")

    def __call__(self, products: torch.Tensor, visible: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """As prefill_softmax_reference, for products [rows >= 2, keys >= 2] float32, contiguous."""
        weights, sums = self._runner.run([products, visible, aot_package.scalar_tensor(scale)])
        return weights, sums
