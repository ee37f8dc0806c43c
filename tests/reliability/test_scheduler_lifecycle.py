"""The scheduler process going away: killed (clients get UNAVAILABLE promptly; the SDK retries
the idempotent stats call until it is back) and stopped with SIGTERM (it stops admitting, lets
running requests finish within the grace period, aborts the rest when it ends, and exits 0)."""

from __future__ import annotations

import random
import signal
import threading
import time

import grpc
import pytest

from client import ChunkwiseError, Client
from reliability_helpers import Deployment, StreamInThread, assert_no_leak, health, paused, wait_idle, wait_until


@pytest.fixture(scope="module")
def dep(model_dir):
    with Deployment(model_dir, ["--num-kv-blocks", "64"]).start() as d:
        yield d


def rand_prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(rng.randrange(20, 50))] for _ in range(n)]


def test_killed_scheduler_unavailable_promptly_and_stats_retried(dep, reference):
    (p_long, p_after) = rand_prompts(200, 2)
    stream = StreamInThread(dep.address, p_long, max_tokens=200, temperature=0, ignore_eos=True)
    assert stream.first_chunk.wait(60)
    with paused(dep.executor):  # the stream is certainly in flight when its server dies
        Deployment.kill(dep.scheduler, signal.SIGKILL)
        t0 = time.monotonic()
        stream.join(30)
    assert stream.error is not None and stream.error.code == grpc.StatusCode.UNAVAILABLE, stream.error
    assert time.monotonic() - t0 < 10

    # No retries: an idempotent call fails fast while nothing listens.
    with Client(dep.address, retry_timeout=0) as c:
        t0 = time.monotonic()
        with pytest.raises(ChunkwiseError) as info:
            c.stats()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 10
        with pytest.raises(ChunkwiseError) as info:  # generation is never retried by the SDK
            c.generate(prompt_token_ids=p_after, max_tokens=4)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE

    # With retries, stats() rides out the restart on the same address.
    got: dict = {}

    def poll():
        with Client(dep.address, retry_timeout=120) as c:
            try:
                got["stats"] = c.stats()
            except ChunkwiseError as e:
                got["error"] = e

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    dep.start_scheduler()
    poller.join(120)
    assert "stats" in got, got
    assert got["stats"]["steps"] == 0  # answered by the new process

    with dep.client(timeout=60) as c:
        r = c.generate(prompt_token_ids=p_after, max_tokens=10, temperature=0)
        reference.check(p_after, 10, r.token_ids)
        assert_no_leak(wait_idle(c))


def test_sigterm_finishes_running_requests_and_refuses_new_ones(dep, reference):
    Deployment.kill(dep.scheduler, signal.SIGTERM)
    dep.start_scheduler(["--shutdown-grace", "60"])
    # Up to 200 tokens, and prompts whose greedy continuations run 135-200 tokens before EOS: with
    # 60 (and a prompt that met EOS after 6), a machine loaded three-fold once saw every request
    # finish between its first token and the pause, leaving nothing to drain.
    prompts = rand_prompts(206, 4)
    streams = [StreamInThread(dep.address, p, max_tokens=200, temperature=0) for p in prompts]
    for s in streams:
        assert s.first_chunk.wait(60)
    with paused(dep.executor):  # keep them running while we look at the draining server
        with Client(dep.address, timeout=30) as c:
            assert c.stats()["num_running"] == 4
        dep.scheduler.popen.send_signal(signal.SIGTERM)
        wait_until(lambda: health(dep.address) == "NOT_SERVING", 30, "the scheduler to start draining")
        with Client(dep.address, timeout=30) as c:
            with pytest.raises(ChunkwiseError) as info:
                c.generate(prompt_token_ids=prompts[0], max_tokens=4)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in info.value.message
    for s in streams:
        s.join(60)
        assert s.error is None, s.error
        reference.check(s.prompt, 200, s.tokens)
    assert dep.scheduler.popen.wait(30) == 0


def test_sigterm_aborts_what_the_grace_period_cannot_finish(dep):
    dep.start_scheduler(["--shutdown-grace", "1"])
    (prompt,) = rand_prompts(202, 1)
    stream = StreamInThread(dep.address, prompt, max_tokens=200, temperature=0, ignore_eos=True)
    assert stream.first_chunk.wait(60)  # 200 tokens: still running when the pause lands
    with paused(dep.executor):  # it cannot finish in time
        t0 = time.monotonic()
        dep.scheduler.popen.send_signal(signal.SIGTERM)
        stream.join(30)
        assert stream.error is not None and stream.error.code == grpc.StatusCode.UNAVAILABLE, stream.error
        assert "shutting down" in stream.error.message
        assert dep.scheduler.popen.wait(30) == 0
        assert time.monotonic() - t0 < 20
    # The executor is fine: a new scheduler (new epoch) serves at once.
    dep.start_scheduler()
    with dep.client(timeout=60) as c:
        c.generate(prompt_token_ids=prompt, max_tokens=4, temperature=0)
        assert_no_leak(wait_idle(c))
