"""Chunked prefill + prefix caching + mixed decodes give the same logits as one full forward.

Every position's logits (execute_with_logits) are compared with transformers' logits for the
whole sequence, for prompts computed as chunks of assorted sizes, with leading blocks served from
another request's cache (num_computed_tokens / kv_write_start > 0), and with other requests'
decodes and prefills in the same batches.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_fixtures import load_reference

from .helpers import Driver, hf_logits, make_runner, random_tokens

ATOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-eager"])
def setup(request, tiny_llama_path, tiny_qwen2_path):
    """Both architectures through the compiled paged decode kernel (the default), and llama also
    through the eager fallback (--enforce-eager: folded-query SDPA over gathered blocks)."""
    path = tiny_qwen2_path if request.param == "qwen2" else tiny_llama_path
    eager = request.param.endswith("-eager")
    ref = load_reference(path)
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def reference(tokens: list[int]) -> torch.Tensor:
        key = tuple(tokens)
        if key not in cache:
            cache[key] = hf_logits(ref, tokens)
        return cache[key]

    def runner(**kwargs):
        r = make_runner(path, enforce_eager=eager, **kwargs)
        assert r.info.decode_attention == ("sdpa-folded" if eager else "paged-inductor")
        assert r.info.prefill_attention == "sdpa"  # float32
        return r

    return runner, reference


def check_request(driver: Driver, rid: str, reference, start: int) -> None:
    r = driver.reqs[rid]
    # The sampled tokens were fed back, so r.tokens is the whole sequence; its last token was
    # sampled but never computed.
    end = max(r.logits) + 1
    ref = reference(r.tokens[:end])
    torch.testing.assert_close(driver.logits_matrix(rid, start, end), ref[start:end], atol=ATOL, rtol=0)


def test_chunks_of_assorted_sizes_with_cached_prefix_and_mixed_decodes(setup):
    make, reference = setup
    runner = make(block_size=8, num_kv_blocks=96)
    d = Driver(runner, seed=1)
    shared = random_tokens(40, seed=10)  # 5 full blocks
    warm = d.add("warm", shared + random_tokens(13, seed=11))
    d.step({"warm": 17})
    d.step({"warm": None})  # finishes the prompt, samples
    check_request(d, "warm", reference, 0)

    # A decoding request that rides along in every following batch.
    dec = d.add("dec", random_tokens(21, seed=12))
    d.step({"dec": None})

    # "a" reuses the 5 cached blocks (40 tokens) of "warm" and computes the rest in chunks.
    a = d.add("a", shared + random_tokens(57, seed=13), cached_blocks=warm.blocks[:5])
    assert a.computed == 40 and a.cached == 40
    for n in (5, 16, 1, 3, 8):
        d.step({"dec": 1, "a": n})
    d.step({"a": None, "dec": 1})
    for _ in range(4):
        d.step({"a": 1, "dec": 1})

    check_request(d, "a", reference, 40)
    check_request(d, "dec", reference, 0)
    assert len(a.outputs) == 5 and len(dec.outputs) == 11


def test_recomputed_positions_below_kv_write_start(setup):
    # The scheduler may recompute queries of cached positions (num_computed_tokens <
    # kv_write_start): those rows are computed but their KV is not written.
    make, reference = setup
    runner = make(block_size=8)
    d = Driver(runner, seed=2)
    shared = random_tokens(32, seed=20)
    warm = d.add("warm", shared + random_tokens(5, seed=21))
    d.step({"warm": None})
    d.add("b", shared + random_tokens(30, seed=22), cached_blocks=warm.blocks[:4], start=20)
    d.step({"b": 20})  # positions 20..39: 20..31 recomputed, 32..39 written
    assert runner.last_layout.slot_mapping.numel() == 8
    d.step({"b": None})
    check_request(d, "b", reference, 20)


def test_fully_cached_prompt_computes_only_its_last_token(setup):
    make, reference = setup
    runner = make(block_size=8)
    d = Driver(runner, seed=3)
    prompt = random_tokens(48, seed=30)  # exactly 6 blocks
    warm = d.add("warm", list(prompt))
    d.step({"warm": None})

    before = [t.clone() for t in runner.kv_cache.layers]
    b = d.add("b", list(prompt), cached_blocks=warm.blocks[:6])
    result = d.step({"b": None})
    layout = runner.last_layout
    assert layout.num_tokens == 1 and layout.num_computed == [47] and layout.context_lens == [48]
    assert layout.slot_mapping.numel() == 0
    for old, new in zip(before, runner.kv_cache.layers):
        assert torch.equal(old.view(torch.int32), new.view(torch.int32))  # nothing written at all
    torch.testing.assert_close(b.logits[47], reference(prompt)[47], atol=ATOL, rtol=0)
    assert result.sampled[0].token_id == warm.outputs[0]
    # It then decodes normally, writing from position 48 on.
    d.step({"b": 1})
    check_request(d, "b", reference, 47)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_schedules_match_reference(setup, data):
    """Random prompt lengths, cached-prefix sizes, chunk sizes and interleavings."""
    make, reference = setup
    block_size = data.draw(st.sampled_from([4, 8, 16]), label="block_size")
    runner = make(block_size=block_size, num_kv_blocks=160)
    d = Driver(runner, seed=data.draw(st.integers(0, 100), label="seed"))
    shared = random_tokens(data.draw(st.integers(1, 60), label="shared"), seed=40)
    warm = d.add("warm", shared + random_tokens(data.draw(st.integers(1, 20)), seed=41))
    d.step({"warm": None})
    full_blocks = len(shared) // block_size
    n_cached = data.draw(st.integers(0, full_blocks), label="cached_blocks")
    reqs = {"warm": 0}
    for i in range(data.draw(st.integers(1, 3), label="n_requests")):
        rid = f"r{i}"
        tail = random_tokens(data.draw(st.integers(1, 40)), seed=50 + i)
        cached = warm.blocks[:n_cached] if i == 0 else []
        d.add(rid, shared + tail if i == 0 else tail, cached_blocks=cached)
        reqs[rid] = d.reqs[rid].computed
    active = [rid for rid in reqs if rid != "warm"] + ["warm"]
    for _ in range(data.draw(st.integers(3, 8), label="steps")):
        work = {}
        for rid in active:
            # After sampling, a request has exactly one token left: its decode.
            work[rid] = data.draw(st.integers(1, d.remaining(rid)))
        d.step(work)
    for rid, start in reqs.items():
        if d.reqs[rid].logits:
            check_request(d, rid, reference, start)


def test_decode_steps_never_wait_for_a_compile(tiny_llama_path):
    # The kernel is compiled and warmed while the runner is built; no batch size or context
    # length a step brings may compile again (that would stall every request for seconds).
    runner = make_runner(tiny_llama_path, block_size=4, num_kv_blocks=200)
    assert runner.info.decode_attention == "paged-inductor"
    d = Driver(runner, seed=4)
    with torch.compiler.set_stance("fail_on_recompile"):
        for i, n in enumerate((1, 2, 5, 33, 70, 3, 9)):
            d.add(f"r{i}", random_tokens(n, seed=60 + i))
            d.step({f"r{i}": None})
            d.step({f"r{j}": 1 for j in range(i + 1)})  # a decode batch of every request so far
