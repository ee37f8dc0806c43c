"""Linear layers on CPU through oneDNN with prepacked weights.

`F.linear` on CPU passes the plain [out, in] weight to the BLAS on every call (MKL for float32,
oneDNN for bfloat16). Packing it once at load time into oneDNN's blocked layout (the ops inductor
uses for frozen CPU graphs; vLLM's CPU path prepacks for oneDNN too) is what float32 needs: on
this machine the seed-shaped run is 1.19x faster with packed weights, its decode-only steps 1.42x
(bench/RESULTS.md; in isolation the 32-row lm_head is 2.5x faster). In bfloat16 decode steps
gain 1.09x (32 requests at 700 tokens) to 1.33x (8 at 200), and the prefill-heavy run is
unchanged (0.996): there torch's bf16 matmuls already go to oneDNN at near its peak.

`pack` returns None (keep `F.linear`) off CPU, where torch has no oneDNN, or when the packed
weight does not reproduce `F.linear` on a probe input: callers never depend on packing.

Prefill-sized batches are another matter in float32 on a CPU without AVX-512. The packed layout
is tuned for decode batches, and on a Zen 3 (AVX2) MKL's `F.linear` on the plain weight ran
SmolLM2's layers 1.05-1.13x faster at 1024 rows (about even at 256-512 rows, slower below), and
the seed-shaped run 1.065-1.079x faster in process, paired. With `--cpu-plain-weight-min-rows N`
each linear layer keeps its plain weight as a second copy for batches of at least N rows
(llama.py: `pack_linear_weights`). It is off by default: served, with fresh processes for every
run, the stack without the copies was as fast or faster in 6 of 7 paired rounds (bench/RESULTS.md
section 1), and the copies cost the linear weights' memory twice. vLLM's CPU build keeps one
oneDNN copy. A choice timed per layer shape at start-up was tried first: on a shared 2-core
machine the timings flipped between runs.

bfloat16 (and float16) weights on a CPU without a matmul in that dtype are the third case. oneDNN
packs bf16 only with AVX-512 (bw, vl, dq) or AVX-NE-CONVERT, and without them torch's `F.linear`
in bf16 is its portable fallback: on the Zen 3 (AVX2), at SmolLM2's shapes, 4-8x slower than
a packed float32 copy of the same weight, so a bf16 run was ~5x slower than an fp32 one and
matmuls were 75-96% of a decode step.
There `pack(widen=True)` packs a float32 copy of the weight instead (every bf16 value is exact in
float32), and `linear` computes in float32 and rounds the result to the input's dtype: the same
products summed in float32 that the fallback computes, in another order (test_model_parity.py
checks each output against the float64 sum rounded to bf16). Activations, the KV cache and
every other op stay in bf16. The cost is the linear weights' memory twice over, which the engine
pays only while that is under 1/4 of the memory available (engine.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The batch size oneDNN chooses its blocking for; it only tunes the layout (any row count works).
# 32 rows is a decode batch; 1024-row prefills measured within 3% of a 1024 hint.
ROWS_HINT = 32
# bf16 on a CPU with AMX: oneDNN's brgemm split the work of some layers packed for 32 rows (or
# 128 to 4096) into a single piece at prefill-sized batches, so one of two threads multiplied
# while the other waited: SmolLM2's q/k/v at 768-1024 rows, its down projection from 256 rows
# on, its o projection at 384-832 ran at the one-thread rate. Packed for 1 row they split: at
# 1024 rows q/k/v 1.78x, down 1.67x faster, o at 512-768 1.8x; at 32 rows within -5..+12%, down
# at 64-128 rows 0.74-0.81x (bench/RESULTS.md section 2b). The MLP's gate/up halves gained
# nothing (1.0-1.02x at 768-1024 rows, 0.79-0.95x at 64-512) and keep ROWS_HINT
# (llama.GateUpSiluMul), as does lm_head, which multiplies only the sampling rows (hint 1 was
# 0.77x there), and float32 (hint 1 was 0.74-0.98x at every size).
AMX_BF16_LAYER_ROWS_HINT = 1


def layer_rows_hint(dtype: torch.dtype, cpu_flags: list[str]) -> int:
    """The row-count hint a model's linear layers (not lm_head) are packed with, for weights of
    `dtype` on a CPU with these native-bf16 flags (config.cpu_bf16_flags)."""
    return AMX_BF16_LAYER_ROWS_HINT if dtype == torch.bfloat16 and "amx_bf16" in cpu_flags else ROWS_HINT


def padded_rows(num_rows: int) -> int:
    """The row count a step's batch is padded to on CPU when its linear layers are packed: a
    multiple of 8 up to 512 rows, then of 16 up to 1024, 32 up to 2048 and so on, so that the pad
    is under 1/32 of the rows and each doubling of the row count adds 32 row counts at most.

    oneDNN builds (JIT-compiles) a kernel for every new row count it multiplies, and a step's
    row count is its token count, which changes nearly every step: on a Xeon with AMX a bf16 linear
    layer of SmolLM2's took 7.2 ms at a row count it had not seen against 0.9-1.3 ms at one it had
    (~600 rows; 0.9 against 0.1-0.15 ms at ~20 rows), and oneDNN's primitive cache keeps 1024
    by default, fewer than a long-running server meets unpadded (every count up to the token
    budget, for each layer shape). Padded, a budget of 8192 has 192 row counts. The pad rows cost their
    share of the step's work (bench/RESULTS.md section 2b; CUDA graph capture sizes bucket a GPU's
    batches for a similar reason)."""
    step = 8
    while 64 * step < num_rows:  # step < num_rows / 32
        step *= 2
    return -(-num_rows // step) * step


def available(device: torch.device) -> bool:
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None, widen: bool = True,
         rows_hint: int = ROWS_HINT) -> torch.Tensor | None:
    """oneDNN's prepacked copy of `weight` [out, in], checked against F.linear, or None. With
    `widen`, a bf16/fp16 weight that oneDNN cannot pack in its own dtype is packed as float32.
    `rows_hint`: the batch size the layout is tuned for (layer_rows_hint; a float32 copy takes
    ROWS_HINT)."""
    if not available(weight.device):
        return None
    try:
        try:
            packed = _reorder(weight.detach(), rows_hint)
        except RuntimeError:
            if not (widen and weight.dtype in (torch.bfloat16, torch.float16)):
                raise
            packed = _reorder(weight.detach().float(), ROWS_HINT)  # this CPU has no matmul in the weight's dtype
        probe = _probe(weight)
        with torch.inference_mode():
            got, want = linear(probe, packed, bias), F.linear(probe, weight, bias)
    except RuntimeError:
        return None
    return packed if _agrees(got, want, weight.dtype) else None


def pack_silu_mul(weight: torch.Tensor, bias: torch.Tensor | None = None, widen: bool = True,
                  rows_hint: int = ROWS_HINT
                  ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor | None, torch.Tensor | None]] | None:
    """An MLP's fused gate/up weight [2n, in] (gate rows first) as two packed halves for
    `silu_mul`, with their biases in the packed dtype: ((gate, up), (gate_bias, up_bias)), or
    None where either half cannot be packed or the pair does not reproduce silu(gate) * up from
    F.linear on a probe input."""
    n = weight.shape[0] // 2
    gate_bias, up_bias = (None, None) if bias is None else (bias[:n], bias[n:])
    packed = [pack(weight[:n], gate_bias, widen, rows_hint), pack(weight[n:], up_bias, widen, rows_hint)]
    if packed[0] is None or packed[1] is None or packed[0].dtype != packed[1].dtype:
        return None
    dtype = packed[0].dtype
    biases = (None if gate_bias is None else gate_bias.to(dtype), None if up_bias is None else up_bias.to(dtype))
    probe = _probe(weight)
    try:
        with torch.inference_mode():
            got = silu_mul(probe, packed[0], packed[1], *biases)
            gate, up = F.linear(probe, weight, bias).float().split(n, dim=-1)
            want = F.silu(gate) * up
    except RuntimeError:  # no such post-op in this oneDNN
        return None
    return ((packed[0], packed[1]), biases) if _agrees(got, want, weight.dtype) else None


def _probe(weight: torch.Tensor) -> torch.Tensor:
    """The 3-row input every packed copy is checked on (seeded: the same for every weight)."""
    return torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)


def _agrees(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """A packed path's probe output against F.linear's: within 1e-4 (float32) or 2e-2 (bf16/fp16)
    of the largest value + 1."""
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    scale = float(want.abs().max()) + 1.0
    return bool((got.float() - want.float()).abs().max() <= tol * scale)


def silu_mul(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor | None,
             up_bias: torch.Tensor | None) -> torch.Tensor:
    """silu(x @ Wg.T + bg) * (x @ Wu.T + bu), in x's dtype, with Wg and Wu as `pack_silu_mul`
    returned them. Two matmuls whose epilogues do the element-wise work on their float32 sums:
    the gate's applies silu, the up's multiplies by the gate's result (the post-ops inductor
    fuses into packed CPU linears). Against one [T, 2n] matmul followed by eager silu and mul,
    the [T, 2n] intermediate and two passes over it are gone, and bf16 rounds twice, not four
    times."""
    wide = x if gate.dtype == x.dtype else x.to(gate.dtype)  # a widened pair: float32 arithmetic
    act = torch.ops.mkldnn._linear_pointwise(wide, gate, gate_bias, "swish", [], "")
    out = torch.ops.mkldnn._linear_pointwise.binary(wide, act, up, up_bias, "mul")
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _reorder(weight: torch.Tensor, rows_hint: int = ROWS_HINT) -> torch.Tensor:
    # Raises RuntimeError where oneDNN has no kernel for the weight's dtype on this CPU.
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias with W as `pack` returned it, in x's dtype."""
    if packed.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    # A widened weight: float32 arithmetic, one rounding to x's dtype at the end. (Linear keeps
    # its bias in float32 already; pack's probe passes the weight's own.)
    wide_bias = None if bias is None else bias.to(packed.dtype)
    return torch.ops.mkldnn._linear_pointwise(x.to(packed.dtype), packed, wide_bias, "none", [], "").to(x.dtype)
