"""Tensor parallelism on CPU (gloo, two ranks): the sharded runner computes the same logits as the
single-process one at every position, under chunked prefill, prefix-cache hits, mixed
decode/prefill batches and async scheduling's append_sampled deltas; and sizes that do not divide
the heads are refused before anything starts."""

from __future__ import annotations

import pytest
import torch

from chunkwise.plan import RunningRequestDelta, ScheduledChunk, StepPlan
from executor_svc.config import ExecutorConfig
from executor_svc.engine import ModelRunner

from .helpers import Driver, make_runner, random_tokens

BS = 8

MODELS = {
    # (arch, config overrides, runner options)
    "llama-4q-2kv": ("llama", {}, {}),
    "llama-8q-2kv-eager": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 2}, {"enforce_eager": True}),
    "qwen2-biases-tied": ("qwen2", {"tie_word_embeddings": True}, {}),
}


@pytest.fixture(scope="module", params=list(MODELS))
def runners(request, tiny_checkpoint):
    arch, overrides, options = MODELS[request.param]
    path = tiny_checkpoint(arch, **overrides)
    single = make_runner(path, block_size=BS, num_kv_blocks=48, **options)
    sharded = make_runner(path, block_size=BS, num_kv_blocks=48, tensor_parallel_size=2, **options)
    yield single, sharded
    sharded.close()


def test_sharded_logits_equal_the_single_process_runner_everywhere(runners):
    single, sharded = runners
    single.reset()
    sharded.reset()
    drivers = [Driver(single, seed=5), Driver(sharded, seed=5)]
    prompt = random_tokens(40, seed=11)
    for d in drivers:
        d.add("a", prompt)
        d.step({"a": 16})  # chunked prefill: three chunks
        d.step({"a": 16})
        d.step({"a": None})
        # 'b' shares a's first two blocks (a prefix-cache hit) and is computed beside a's decode.
        d.add("b", prompt[:16] + random_tokens(13, seed=12), cached_blocks=d.reqs["a"].blocks[:2])
        d.step({"a": 1, "b": None})
        d.step({"a": 1, "b": 1})
    ref, got = drivers
    for rid in ("a", "b"):
        assert ref.reqs[rid].outputs == got.reqs[rid].outputs
        positions = sorted(ref.reqs[rid].logits)
        assert positions == sorted(got.reqs[rid].logits)
        want = torch.stack([ref.reqs[rid].logits[p] for p in positions])
        have = torch.stack([got.reqs[rid].logits[p] for p in positions])
        torch.testing.assert_close(have, want, atol=1e-5, rtol=0)

    # Async scheduling's delta: rank 0 spells out the token only it sampled for the other rank.
    for d in drivers:
        d.step({"a": 1})
        r = d.reqs["a"]
        end = len(r.tokens)  # the token just sampled is at end - 1; the runner has not been sent it
        blocks = d.allocate(max(0, -(-end // BS) - len(r.blocks)))
        blind = d.runner.execute(StepPlan(d.step_id + 1, follows_step_id=d.step_id,
                                          running=[RunningRequestDelta("a", [], blocks, append_sampled=True)],
                                          chunks=[ScheduledChunk("a", end - 1, 1, end - 1, True)]))
        r.outputs.append(blind.sampled[0].token_id)
    assert ref.reqs["a"].outputs == got.reqs["a"].outputs


def test_sizes_that_do_not_divide_the_heads_are_refused(tiny_checkpoint):
    # SmolLM2-135M's shape in small: 3 KV heads, an MLP width 3 divides: sizes 1 and 3 only.
    path = tiny_checkpoint("llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=48, intermediate_size=96)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 does not divide .* 3 KV heads .* it can use 1, 3"):
        ModelRunner(ExecutorConfig(model=str(path), dtype="float32", tensor_parallel_size=2))


@pytest.mark.cuda
def test_nccl_sharded_logits_equal_the_single_gpu_runner(tiny_checkpoint):
    """The GPU path (NCCL, one GPU per rank). It has not run yet: it needs two CUDA devices."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices for --tensor-parallel-size 2")
    path = tiny_checkpoint("llama")
    single = make_runner(path, block_size=16, num_kv_blocks=32, device="cuda")
    sharded = make_runner(path, block_size=16, num_kv_blocks=32, device="cuda", tensor_parallel_size=2)
    try:
        drivers = [Driver(single, seed=6), Driver(sharded, seed=6)]
        for d in drivers:
            d.add("a", random_tokens(40, seed=13))
            d.step({"a": 32})
            d.step({"a": None})
            d.step({"a": 1})
        ref, got = drivers
        assert ref.reqs["a"].outputs == got.reqs["a"].outputs
        for p in ref.reqs["a"].logits:
            torch.testing.assert_close(got.reqs["a"].logits[p], ref.reqs["a"].logits[p], atol=1e-5, rtol=0)
    finally:
        sharded.close()
