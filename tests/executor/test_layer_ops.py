"""The compiled element-wise ops (models/layer_ops.py) against their eager references: RoPE bit for
bit, residual add + RMSNorm to one rounding of the summation order, every row independent of the
batch it is in, and the model's logits unchanged beyond that."""

from __future__ import annotations

import pytest
import torch

from executor_svc.models import layer_ops
from executor_svc.models.layer_ops import (EAGER, CompiledLayerOps, add_rms_norm_reference, rotary_reference)
from executor_svc.models.rope import RotaryEmbedding
from executor_svc.models.spec import RopeSpec
from chunkwise.plan import GREEDY, NewRequestData, ScheduledChunk, StepPlan

from .helpers import make_runner, random_tokens

HIDDEN, HEADS, KV_HEADS, DIM = 64, 4, 2, 16
CPU = torch.device("cpu")


def compiled(dtype: torch.dtype, **kw) -> CompiledLayerOps:
    ops = CompiledLayerOps(HIDDEN, (HEADS + 2 * KV_HEADS) * DIM, HEADS + KV_HEADS, DIM, dtype, CPU, False, **kw)
    assert ops.ready, ops.reason
    return ops


def angles(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    rope = RotaryEmbedding(RopeSpec(rope_type="default", theta=10000.0), DIM, 4096, CPU)
    return rope.cos_sin(torch.randint(0, 4000, (tokens,)), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, 5, 300])
def test_compiled_rotary_is_the_eager_rotary_bit_for_bit(dtype, tokens):
    torch.manual_seed(tokens)
    cos, sin = angles(tokens, dtype)
    qkv = (torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM) * 4).to(dtype)
    eager = EAGER.rotary(qkv, cos, sin, HEADS + KV_HEADS, DIM)
    # The cat form the package compiles is apply_rotary's values (test_model_parts.py holds
    # apply_rotary to transformers' own, bit for bit).
    assert torch.equal(rotary_reference(qkv, cos, sin, HEADS + KV_HEADS, DIM), eager)
    got = compiled(dtype).rotary(qkv, cos, sin, HEADS + KV_HEADS, DIM)
    assert got.is_contiguous() and torch.equal(got, eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, 7, 300])
def test_compiled_add_rms_norm_is_the_reference_to_one_rounding(dtype, tokens):
    torch.manual_seed(tokens)
    x, delta = (torch.randn(tokens, HIDDEN) * 3).to(dtype), torch.randn(tokens, HIDDEN).to(dtype)
    weight = (torch.rand(HIDDEN) + 0.5).to(dtype)
    want_x, want_h = add_rms_norm_reference(x, delta, weight, 1e-5)
    got_x, got_h = compiled(dtype).add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(got_x, want_x)  # the residual add is one rounding either way
    # The squares are summed in another order, so a row's scale may differ in its last bit: in
    # float32 the row's values then differ in their last bits (a few units of float32's rounding),
    # in bf16 a few values round to the next step.
    step = torch.finfo(dtype).eps * (4 if dtype == torch.float32 else 1)
    assert ((got_h.float() - want_h.float()).abs() <= step * want_h.float().abs()).all()
    if dtype == torch.bfloat16:
        assert (got_h != want_h).float().mean() <= 0.01
    if tokens == 1:  # a single row takes the reference itself
        assert torch.equal(got_h, want_h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_is_computed_the_same_in_any_batch(dtype):
    """A token's values do not depend on how many rows share its step: prefix caching reuses
    KV computed in one batch for requests that arrive in another."""
    torch.manual_seed(0)
    ops = compiled(dtype)
    x, delta = (torch.randn(300, HIDDEN) * 3).to(dtype), torch.randn(300, HIDDEN).to(dtype)
    weight = (torch.rand(HIDDEN) + 0.5).to(dtype)
    whole = ops.add_rms_norm(x, delta, weight, 1e-5)[1]
    pairs = torch.cat([ops.add_rms_norm(x[i : i + 2], delta[i : i + 2], weight, 1e-5)[1] for i in range(0, 300, 2)])
    assert torch.equal(whole, pairs)
    cos, sin = angles(300, dtype)
    qkv = torch.randn(300, (HEADS + 2 * KV_HEADS) * DIM).to(dtype)
    whole_r = ops.rotary(qkv, cos, sin, HEADS + KV_HEADS, DIM)
    pairs_r = torch.cat([ops.rotary(qkv[i : i + 2], cos[i : i + 2], sin[i : i + 2], HEADS + KV_HEADS, DIM)
                         for i in range(0, 300, 2)])
    assert torch.equal(whole_r, pairs_r)


def test_a_package_that_disagrees_with_the_reference_is_not_used(monkeypatch):
    ops = compiled(torch.float32)
    # The warm-up check compares the packages with the references: against a reference that
    # rotates the other way, it refuses them.
    monkeypatch.setattr(layer_ops, "rotary_reference", lambda qkv, cos, sin, h, d: rotary_reference(qkv, cos, -sin, h, d))
    with pytest.raises(RuntimeError, match="compiled RoPE disagrees"):
        ops._warm_up()
    # And a refusal leaves the model on the eager ops, saying why.
    monkeypatch.undo()
    monkeypatch.setattr(CompiledLayerOps, "_warm_up", lambda self: (_ for _ in ()).throw(RuntimeError("disagrees")))
    ops = CompiledLayerOps(HIDDEN, (HEADS + 2 * KV_HEADS) * DIM, HEADS + KV_HEADS, DIM, torch.float32, CPU, False)
    assert not ops.ready and "disagrees" in ops.reason and ops.reason.endswith("eager element-wise ops")


def test_enforce_eager_and_cuda_keep_the_eager_ops():
    ops = CompiledLayerOps(HIDDEN, (HEADS + 2 * KV_HEADS) * DIM, HEADS + KV_HEADS, DIM, torch.float32, CPU, True)
    assert not ops.ready and ops.reason.startswith("--enforce-eager")
    ops = CompiledLayerOps(HIDDEN, (HEADS + 2 * KV_HEADS) * DIM, HEADS + KV_HEADS, DIM, torch.float32,
                           torch.device("cuda"), False)
    assert not ops.ready and "CPU only" in ops.reason


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_with_compiled_ops_gives_the_eager_models_logits(tiny_llama_path, dtype):
    runner = make_runner(tiny_llama_path, block_size=16, num_kv_blocks=8, dtype=dtype)
    assert runner.info.layer_ops == "compiled" and isinstance(runner.model.layer_ops, CompiledLayerOps)
    eager = make_runner(tiny_llama_path, block_size=16, num_kv_blocks=8, dtype=dtype, enforce_eager=True)
    assert eager.info.layer_ops == "eager" and eager.model.layer_ops is EAGER
    tokens = random_tokens(60, seed=5)
    plan = StepPlan(1, new_requests=[NewRequestData("r", tokens, [3, 1, 4, 0], GREEDY)],
                    chunks=[ScheduledChunk("r", 0, 60, 0, True)])
    _, got = runner.execute_with_logits(plan)
    # The same runner with its ops swapped for the eager ones: only the element-wise ops differ.
    runner.model.layer_ops = EAGER
    runner.reset()
    _, want = runner.execute_with_logits(plan)
    if dtype == "float32":
        torch.testing.assert_close(got["r"], want["r"], atol=1e-5, rtol=0)
    else:  # an RMSNorm value one bf16 step off moves logits by far less than bf16's own error
        assert (got["r"] - want["r"]).abs().max() < 0.05
    assert int(got["r"][-1].argmax()) == int(want["r"][-1].argmax())
