"""Async scheduling end to end: the same workload with `--async-scheduling` and with
`--no-async-scheduling` gives identical outputs, in all four CP/PC configurations.

One executor (a KV pool small enough to force preemption) serves a scheduler per configuration
and mode in turn; each handshake starts a new epoch. The workload mixes greedy and seeded
sampling, stop token ids, stop strings, max_tokens of 1 and 2 (ending on the first step
boundaries), ignore_eos runs to max_tokens, and a stream cancelled mid-way. Greedy outputs are
also checked against transformers, and after each run nothing is left running and no block is
held. An executor SIGKILL with two steps in flight is in test_executor_faults.py (async is on
there).
"""

from __future__ import annotations

import random
import secrets
from concurrent.futures import ThreadPoolExecutor

import pytest

from client import Client
from chunkwise_tools.serve import start_executor, start_scheduler
from reliability_helpers import BLOCK, MAX_MODEL_LEN, START_TIMEOUT, assert_no_leak, wait_idle

KV_BLOCKS = 20  # 320 token slots: one max-length request fits, the whole burst does not
COMBOS = [(True, True), (True, False), (False, True), (False, False)]


def combo_id(chunked: bool, caching: bool) -> str:
    return {(True, True): "CP+PC", (True, False): "CP-only", (False, True): "PC-only"}.get((chunked, caching), "neither")


def flags(chunked: bool, caching: bool, async_scheduling: bool) -> list[str]:
    return [
        "--block-size", str(BLOCK), "--max-model-len", str(MAX_MODEL_LEN), "--stats-interval", "0",
        "--max-num-batched-tokens", "64" if chunked else str(MAX_MODEL_LEN),
        "--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill",
        "--enable-prefix-caching" if caching else "--no-enable-prefix-caching",
        "--async-scheduling" if async_scheduling else "--no-async-scheduling",
    ]


def workload() -> list[dict]:
    rng = random.Random(12)
    shared = [rng.randrange(3, 384) for _ in range(40)]

    def prompt(n):
        return shared + [rng.randrange(3, 384) for _ in range(n)]

    reqs = []
    for i in range(4):  # greedy; 0 and 1 get stop tokens mid-way
        reqs.append(dict(prompt_token_ids=prompt(40 + 13 * i), max_tokens=48, temperature=0, ignore_eos=True))
    # 2 and 3 end at 226 and 239 tokens (15 blocks each, 30 > KV_BLOCKS). The rest of the burst is
    # short, so the second of the two is admitted (7-8 prompt blocks) long before the first ends,
    # and they cannot both grow to the end: one is preempted in every mode and configuration,
    # rather than only when the threads' arrival order happens to make the burst overlap.
    reqs[2]["max_tokens"] = reqs[3]["max_tokens"] = 120
    for i in range(2):  # seeded sampling
        reqs.append(dict(prompt_token_ids=prompt(20 + i), max_tokens=30, temperature=0.9, top_p=0.9, seed=7 + i,
                         ignore_eos=True))
    reqs.append(dict(prompt_token_ids=prompt(9), max_tokens=1, temperature=0))  # ends at its first step
    reqs.append(dict(prompt_token_ids=prompt(10), max_tokens=2, temperature=0))
    reqs.append(dict(prompt="the cat sat on the mat and", max_tokens=40, temperature=0, stop=["e"]))
    reqs.append(dict(prompt="a tale of two cities", max_tokens=40, temperature=0.8, seed=3, stop=["th", "s "]))
    return reqs


def with_stop_tokens(reqs: list[dict], reference) -> list[dict]:
    """Give two greedy requests a stop token id that transformers' continuation has mid-way."""
    out = [dict(r) for r in reqs]
    for i in (0, 1):
        want = reference.greedy(out[i]["prompt_token_ids"], out[i]["max_tokens"])
        out[i]["stop_token_ids"] = [want[min(10 + 7 * i, len(want) - 1)]]
    return out


def cancelled_prompt(reqs: list[dict]) -> list[int]:
    """The prompt of the stream `run` cancels: the first greedy request's first 24 tokens."""
    return reqs[0]["prompt_token_ids"][:24]


def run(address: str, reqs: list[dict]):
    def one(kw):
        with Client(address, timeout=120) as c:
            return c.generate(**kw)

    with ThreadPoolExecutor(len(reqs)) as pool:
        results = list(pool.map(one, reqs))
    with Client(address, timeout=120) as c:
        # A stream cancelled after three tokens: it is aborted and its blocks are freed. Its
        # prompt is short and it may run to max_model_len, so that the cancel reaches the server
        # long before the request could end by itself (with max_tokens 100 on an 80-token
        # prompt, a client stalled ~0.1 s on a loaded machine once let it finish by length).
        got, prompt = [], cancelled_prompt(reqs)
        for chunk in c.stream(prompt_token_ids=prompt, max_tokens=MAX_MODEL_LEN - len(prompt), temperature=0,
                              ignore_eos=True):
            got += chunk.token_ids
            if len(got) >= 3:
                break
        stats = wait_idle(c)
    return results, got, stats


@pytest.fixture(scope="module")
def executor(model_dir):
    token = secrets.token_urlsafe(24)
    proc = start_executor(model_dir, token, ["--dtype", "float32", "--num-kv-blocks", str(KV_BLOCKS)],
                          timeout=START_TIMEOUT)
    try:
        yield proc, token
    finally:
        proc.terminate()
        proc.wait_or_kill(15)


def serve(executor, chunked, caching, async_scheduling, reqs):
    proc, token = executor
    scheduler = start_scheduler(proc.address, token, flags(chunked, caching, async_scheduling), timeout=START_TIMEOUT)
    try:
        return run(scheduler.address, reqs)
    finally:
        scheduler.terminate()
        scheduler.wait_or_kill(15)


def summary(results):
    return [(r.token_ids, r.finish_reason, r.text, r.usage.completion_tokens) for r in results]


@pytest.mark.parametrize("chunked,caching", COMBOS, ids=[combo_id(*c) for c in COMBOS])
def test_async_and_sync_scheduling_give_identical_outputs(executor, reference, chunked, caching):
    reqs = with_stop_tokens(workload(), reference)
    sync, sync_cancelled, sync_stats = serve(executor, chunked, caching, False, reqs)
    async_, async_cancelled, async_stats = serve(executor, chunked, caching, True, reqs)

    assert summary(async_) == summary(sync)
    for kw, r in zip(reqs, async_):
        if kw.get("temperature") == 0 and "prompt_token_ids" in kw:
            want = reference.greedy(kw["prompt_token_ids"], kw["max_tokens"])  # ends at EOS
            n = min(len(want), len(r.token_ids))
            assert n and r.token_ids[:n] == want[:n]
            if "stop_token_ids" in kw:  # ended on its stop token, and nothing after it was returned
                assert r.finish_reason == "stop" and r.token_ids[-1] == kw["stop_token_ids"][0]
    assert [len(r.token_ids) for r in async_[6:8]] == [1, 2]
    for kw, r in zip(reqs[8:], async_[8:]):  # stop strings: the text ends before the stop, none after
        assert r.finish_reason in ("stop", "length")
        assert not any(s in r.text for s in kw["stop"])
    assert async_cancelled == sync_cancelled == reference.greedy(cancelled_prompt(reqs), 3)
    for st in (sync_stats, async_stats):
        assert_no_leak(st)
        assert st["requests_finished"]["abort"] == 1
    # The pool is too small for the burst: both modes preempt, and stay exact.
    assert async_stats["preemptions"] > 0 and sync_stats["preemptions"] > 0
