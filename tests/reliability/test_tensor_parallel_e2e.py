"""Tensor parallelism end to end (CPU, gloo, `--tensor-parallel-size 2`): greedy outputs through the
scheduler equal transformers' in all four CP/PC configurations; killing rank 1 mid-run makes the
executor exit, the requests in flight end with UNAVAILABLE within the wait bound (no hang), and
the stack serves again once the executor is restarted. The same over "two hosts" (`--nnodes 2`,
both on loopback here): rank 1 started by its own `--node-rank 1` process, whose death fails the
next step and ends the executor."""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import subprocess
import sys

import grpc
import pytest

from client import Client
from reliability_helpers import (
    BLOCK, MAX_MODEL_LEN, Deployment, StreamInThread, assert_no_leak, free_port, wait_idle, wait_until,
)

COMBOS = [(True, True), (True, False), (False, True), (False, False)]
IDS = ["CP+PC", "CP-only", "PC-only", "neither"]


def config_flags(chunked: bool, caching: bool) -> list[str]:
    return [
        "--max-num-batched-tokens", "64" if chunked else str(MAX_MODEL_LEN),
        "--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill",
        "--enable-prefix-caching" if caching else "--no-enable-prefix-caching",
    ]


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 384) for _ in range(2 * BLOCK)]
    return [shared + [rng.randrange(3, 384) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def rank_pids(executor_pid: int) -> list[int]:
    """The executor's tensor-parallel ranks: its children started by multiprocessing's spawn."""
    children = Path(f"/proc/{executor_pid}/task/{executor_pid}/children").read_text().split()
    out = []
    for pid in map(int, children):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            out.append(pid)
    return out


@pytest.fixture(scope="module")
def dep(model_dir):
    if not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists():
        pytest.skip("needs Linux's /proc/PID/task/PID/children to find the ranks")
    d = Deployment(model_dir, ["--num-kv-blocks", "64", "--tensor-parallel-size", "2"],
                   ["--executor-wait-timeout", "4"])
    d.start_executor()
    yield d
    d.stop()


@pytest.mark.parametrize("chunked,caching", COMBOS, ids=IDS)
def test_greedy_outputs_equal_transformers(dep, reference, chunked, caching):
    dep.start_scheduler(config_flags(chunked, caching))
    try:
        ps = prompts(3, 6)

        def one(p):
            with dep.client(timeout=120) as c:
                return c.generate(prompt_token_ids=p, max_tokens=16, temperature=0)

        with ThreadPoolExecutor(len(ps)) as pool:
            results = list(pool.map(one, ps))
        for p, r in zip(ps, results):
            reference.check(p, 16, r.token_ids)
        with dep.client() as c:
            again = c.generate(prompt_token_ids=ps[0], max_tokens=16, temperature=0)
            assert again.token_ids == results[0].token_ids
            if caching:
                assert again.usage.cached_prompt_tokens > 0
            assert_no_leak(wait_idle(c))
    finally:
        Deployment.kill(dep.scheduler, signal.SIGTERM)


def test_killing_rank_1_fails_the_requests_in_flight_and_a_restart_recovers(dep, reference):
    dep.start_scheduler(config_flags(True, True))
    try:
        ranks = rank_pids(dep.executor.popen.pid)
        assert len(ranks) == 1, ranks
        streams = [StreamInThread(dep.address, p, max_tokens=150, temperature=0, ignore_eos=True)
                   for p in prompts(4, 3)]
        for s in streams:
            assert s.first_chunk.wait(60)
        os.kill(ranks[0], signal.SIGKILL)
        # Rank 0 sees its rank die and exits, rather than hang in the next collective.
        wait_until(lambda: not dep.executor.alive(), 30, "the executor to exit after its rank died")
        started = time.monotonic()
        for s in streams:
            s.join(60)
            assert s.error is not None and s.error.code == grpc.StatusCode.UNAVAILABLE, (s.error, s.finish)
        assert time.monotonic() - started < 30
        dep.start_executor()
        with dep.client(timeout=120) as c:
            p = prompts(5, 1)[0]
            wait_until(lambda: _serves(c, p), 60, "the stack to serve again")
            r = c.generate(prompt_token_ids=p, max_tokens=12, temperature=0)
            reference.check(p, 12, r.token_ids)
            assert_no_leak(wait_idle(c))
    finally:
        Deployment.kill(dep.scheduler, signal.SIGTERM)


def _serves(c: Client, prompt) -> bool:
    from client import ChunkwiseError

    try:
        c.generate(prompt_token_ids=prompt, max_tokens=1, temperature=0)
        return True
    except ChunkwiseError:
        return False


def test_two_hosts_by_node_rank(model_dir, reference):
    port = free_port()
    common = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    host1 = subprocess.Popen([sys.executable, "-m", "executor_svc", "--model", str(model_dir), "--dtype", "float32",
                              *common, "--node-rank", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dep = Deployment(model_dir, ["--num-kv-blocks", "64", *common], ["--executor-wait-timeout", "4"])
    try:
        dep.start()
        ps = prompts(6, 3)
        with dep.client(timeout=120) as c:
            for p in ps:
                reference.check(p, 12, c.generate(prompt_token_ids=p, max_tokens=12, temperature=0).token_ids)
            assert_no_leak(wait_idle(c))
        streams = [StreamInThread(dep.address, p, max_tokens=150, temperature=0, ignore_eos=True) for p in ps]
        for s in streams:
            assert s.first_chunk.wait(60)
        host1.kill()  # "the other host" goes away; its rank dies with it
        wait_until(lambda: not dep.executor.alive(), 60, "rank 0 to exit after its collective failed")
        for s in streams:
            s.join(60)
            assert s.error is not None and s.error.code == grpc.StatusCode.UNAVAILABLE, (s.error, s.finish)
    finally:
        if host1.poll() is None:
            host1.kill()
        host1.wait(30)
        dep.stop()
