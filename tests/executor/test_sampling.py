"""Sampling: filters, exactness of the sampler, seeded reproducibility, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from chunkwise.plan import GREEDY, SamplingParams
from executor_svc.sampling import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    first_argmax,
    mix_seed,
    processed_logits,
    sample,
)

from .helpers import Driver, make_runner, random_tokens

NEG = float("-inf")


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def kept(x: torch.Tensor) -> list[int]:
    return torch.isfinite(x[0]).nonzero().squeeze(1).tolist()


def test_top_k_keeps_the_k_best_and_ties():
    x = torch.tensor([[1.0, 5.0, 3.0, 5.0, -2.0, 3.0]])
    assert kept(apply_top_k(x, torch.tensor([1]))) == [1, 3]  # a tie with the best stays
    assert kept(apply_top_k(x, torch.tensor([2]))) == [1, 3]
    assert kept(apply_top_k(x, torch.tensor([3]))) == [1, 2, 3, 5]
    assert kept(apply_top_k(x, torch.tensor([6]))) == [0, 1, 2, 3, 4, 5]
    # per-row k
    two = torch.stack([x[0], x[0].flip(0)])
    out = apply_top_k(two, torch.tensor([4, 2]))
    assert torch.isfinite(out).sum(1).tolist() == [4, 2]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    x = logits_of([0.15, 0.5, 0.05, 0.3])
    assert kept(apply_top_p(x, torch.tensor([0.4]))) == [1]  # 0.5 alone reaches 0.4
    assert kept(apply_top_p(x, torch.tensor([0.75]))) == [1, 3]
    assert kept(apply_top_p(x, torch.tensor([0.9]))) == [0, 1, 3]
    assert kept(apply_top_p(x, torch.tensor([1.0]))) == [0, 1, 2, 3]
    assert kept(apply_top_p(x, torch.tensor([1e-6]))) == [1]  # never empty


def test_min_p_is_relative_to_the_best_token():
    x = logits_of([0.15, 0.5, 0.05, 0.3])
    assert kept(apply_min_p(x, torch.tensor([0.5]))) == [1, 3]  # >= 0.25
    assert kept(apply_min_p(x, torch.tensor([0.25]))) == [0, 1, 3]  # >= 0.125
    assert kept(apply_min_p(x, torch.tensor([0.0]))) == [0, 1, 2, 3]


def test_filters_apply_after_temperature_and_in_order():
    x = logits_of([0.5, 0.3, 0.15, 0.05])
    # top-k 3 renormalises to [.526, .316, .158], so top-p 0.82 then keeps two tokens; on the
    # unfiltered distribution (mass .8 before the third token) it would keep three.
    p = SamplingParams(temperature=1.0, top_k=3, top_p=0.82)
    assert kept(processed_logits(x, [p])) == [0, 1]
    assert kept(processed_logits(x, [SamplingParams(temperature=1.0, top_p=0.82)])) == [0, 1, 2]
    # A high temperature flattens the distribution so min-p keeps more.
    cold = processed_logits(x, [SamplingParams(temperature=0.5, min_p=0.3)])
    hot = processed_logits(x, [SamplingParams(temperature=4.0, min_p=0.3)])
    assert kept(cold) == [0, 1] and kept(hot) == [0, 1, 2, 3]


def test_greedy_is_argmax_and_ignores_seed():
    x = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    outs = sample(x, [GREEDY] * 5, seeds=[1, 2, 3, 4, 5], positions=[0] * 5)
    assert [o.token_id for o in outs] == x.argmax(1).tolist()


def test_sampling_frequencies_follow_the_distribution():
    probs = [0.5, 0.25, 0.15, 0.1, 0.0]
    n = 4000
    x = logits_of(probs).expand(n, -1)
    params = [SamplingParams(temperature=1.0)] * n
    outs = sample(x, params, seeds=list(range(n)), positions=[7] * n)
    counts = torch.bincount(torch.tensor([o.token_id for o in outs]), minlength=5).tolist()
    assert counts[4] == 0
    for c, p in zip(counts, probs):
        assert abs(c / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-9, counts


def test_filtered_tokens_are_never_sampled():
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1)).expand(500, -1)
    top3 = set(x[0].topk(3).indices.tolist())
    outs = sample(x, [SamplingParams(temperature=2.0, top_k=3)] * 500, list(range(500)), [0] * 500)
    sampled = {o.token_id for o in outs}
    assert sampled <= top3 and len(sampled) == 3


def test_noise_depends_only_on_seed_and_position():
    x = torch.randn(1, 100, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=1.5, top_p=0.95, seed=42)
    alone = sample(x, [p], [42], [10])[0].token_id
    others = torch.randn(6, 100)
    batch = torch.cat([others[:3], x, others[3:]])
    mixed = sample(batch, [SamplingParams(temperature=0.7)] * 3 + [p] + [GREEDY] * 3,
                   [1, 2, 3, 42, 4, 5, 6], [5, 6, 7, 10, 8, 9, 0])
    assert mixed[3].token_id == alone
    # Different positions draw different noise.
    draws = {sample(x, [p], [42], [pos])[0].token_id for pos in range(40)}
    assert len(draws) > 5
    assert mix_seed(42, 10) != mix_seed(42, 11) != mix_seed(43, 10)
    assert 0 <= mix_seed(-1, 2**70) < 2**63


def test_logprobs_are_from_raw_logits():
    x = torch.randn(2, 30, generator=torch.Generator().manual_seed(3))
    ref = torch.log_softmax(x, dim=-1)
    outs = sample(x, [SamplingParams(temperature=0.3, top_k=5, num_logprobs=4),
                      SamplingParams(temperature=0.0, num_logprobs=0)], [1, 2], [0, 0])
    for row, o in enumerate(outs):
        assert o.logprob == pytest.approx(ref[row, o.token_id].item(), abs=1e-6)
    top = ref[0].topk(4)
    assert [t for t, _ in outs[0].top_logprobs] == top.indices.tolist()
    assert [v for _, v in outs[0].top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert outs[1].top_logprobs == []
    no = sample(x, [GREEDY, GREEDY], [0, 0], [0, 0])
    assert no[0].logprob is None and no[0].top_logprobs == []


# ------------------------------------------------------------------ through the runner


def run_seeded(path, layout: str, seed: int = 1234, n: int = 12) -> list[int]:
    """Generate n tokens for one seeded request, batched in different company per `layout`."""
    params = SamplingParams(temperature=1.3, top_p=0.95, top_k=50, seed=seed)
    prompt = random_tokens(19, seed=100)
    runner = make_runner(path, block_size=8, num_kv_blocks=64)
    d = Driver(runner, seed=len(layout))
    if layout == "alone":
        d.add("x", prompt, params)
        d.step({"x": None})
        while len(d.reqs["x"].outputs) < n:
            d.step({"x": 1})
    else:
        d.add("noise1", random_tokens(30, seed=101), SamplingParams(temperature=1.0))
        d.add("noise2", random_tokens(5, seed=102), SamplingParams(temperature=0.9, seed=7))
        d.step({"noise1": 11})
        d.add("x", prompt, params)
        d.step({"noise1": None, "x": 4, "noise2": None})
        d.step({"x": None, "noise2": 1, "noise1": 1})
        while len(d.reqs["x"].outputs) < n:
            d.step({"noise1": 1, "x": 1} if len(d.reqs["x"].outputs) % 2 else {"x": 1})
    return d.reqs["x"].outputs[:n]


def test_seeded_sampling_is_reproducible_across_batches_and_runners(tiny_llama_path):
    alone = run_seeded(tiny_llama_path, "alone")
    mixed = run_seeded(tiny_llama_path, "mixed")  # another fresh runner, another batch mix
    assert alone == mixed
    assert run_seeded(tiny_llama_path, "alone", seed=99) != alone


def test_unseeded_requests_get_distinct_random_seeds(tiny_llama_path):
    runner = make_runner(tiny_llama_path, block_size=8, num_kv_blocks=64)
    d = Driver(runner)
    prompt = random_tokens(10, seed=103)
    hot = SamplingParams(temperature=5.0)
    d.add("a", prompt, hot)
    d.add("b", prompt, hot)
    d.step({"a": None, "b": None})
    for _ in range(9):
        d.step({"a": 1, "b": 1})
    assert d.reqs["a"].outputs != d.reqs["b"].outputs


def test_runner_logprobs_match_logits(tiny_llama_path):
    runner = make_runner(tiny_llama_path, block_size=8, num_kv_blocks=16)
    d = Driver(runner)
    d.add("x", random_tokens(12, seed=104), SamplingParams(temperature=0.8, seed=3, num_logprobs=3))
    result = d.step({"x": None})
    s = result.sampled[0]
    ref = torch.log_softmax(d.reqs["x"].logits[11], dim=-1)
    assert s.logprob == pytest.approx(ref[s.token_id].item(), abs=1e-5)
    assert [t for t, _ in s.top_logprobs] == ref.topk(3).indices.tolist()


def test_first_argmax_is_argmax_with_ties_nan_and_infinities():
    x = torch.randn(8, 49152, generator=torch.Generator().manual_seed(0))
    x[1, 100] = x[1, 7] = x[1].max() + 1  # a tie: the first one
    x[2, 9] = float("nan")  # NaN counts as maximal
    x[3] = 0.0  # all equal: index 0
    x[4] = float("-inf")  # all -inf: index 0
    x[5, 30000] = float("inf")
    x[6, -1] = x[6].max() + 1  # the last entry
    got = first_argmax(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[:7].tolist() == [int(x[0].argmax()), 7, 9, 0, 0, 30000, 49151]
