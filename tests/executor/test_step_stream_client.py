"""ExecutorClient's step stream against a real executor server (tiny model, loopback): results
come back matched to their plans, and every failure (a refused plan, a step past its deadline, a
dropped step, a restarted executor) fails that step as the engine expects, fails every step behind
it without running it, and leaves a client that opens a new stream after the next handshake."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from chunkwise.plan import ScheduledChunk, StepPlan
from executor_svc.server import build_server
from scheduler_svc.executor_client import ExecutorClient, ExecutorRejected, ExecutorUnavailable

from .helpers import ServedComputeLoop, blind_decode, make_runner, prefill

TOKEN = "executor-client-test-token"


@contextlib.contextmanager
def served(tiny_llama_path, slow_steps: dict[int, float] | None = None, failing_step: int | None = None):
    """A served executor whose runner sleeps `slow_steps[id]` s before a step and raises on
    `failing_step`; yields its address, the list of step ids the runner was given, and the server."""
    runner = make_runner(tiny_llama_path, block_size=8, num_kv_blocks=16)
    execute, executed = runner.execute, []

    def recorded(plan):
        executed.append(plan.step_id)
        time.sleep((slow_steps or {}).get(plan.step_id, 0.0))
        if plan.step_id == failing_step:
            raise RuntimeError("boom in the runner")
        return execute(plan)

    runner.execute = recorded
    with ServedComputeLoop() as loop:
        server, port = build_server(runner, "127.0.0.1", 0, TOKEN, compute=loop.loop)
        server.start()
        try:
            yield f"127.0.0.1:{port}", executed, server
        finally:
            server.stop(None)


@contextlib.asynccontextmanager
async def connected(address: str, step_timeout: float = 30.0):
    """A client that did its handshake; yields it and the epoch."""
    client = ExecutorClient(address, TOKEN, step_timeout=step_timeout)
    try:
        info = await client.initialize(8, timeout=30)
        yield client, info.epoch
    finally:
        await client.close()


async def until(predicate, timeout: float = 10.0):
    """Wait for a fact (a step started) instead of sleeping a guess: a loaded machine may take
    longer than any fixed sleep to start a step."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def settle(*steps):
    """Each step's result or exception."""
    return await asyncio.gather(*steps, return_exceptions=True)


def test_pipelined_steps_are_answered_in_order(tiny_llama_path):
    async def run(address):
        async with connected(address) as (client, epoch):
            results = await settle(*(client.execute(p, epoch)
                                     for p in (prefill(1), blind_decode(2, 10), blind_decode(3, 11))))
            return [r.step_id for r in results]

    with served(tiny_llama_path) as (address, executed, _):
        assert asyncio.run(run(address)) == [1, 2, 3]
        assert executed == [1, 2, 3]


def test_a_refused_plan_fails_as_rejected_and_the_step_behind_it_never_runs(tiny_llama_path):
    async def run(address):
        async with connected(address) as (client, epoch):
            first, bad, behind = await settle(
                client.execute(prefill(1), epoch),
                client.execute(StepPlan(2, follows_step_id=1, chunks=[ScheduledChunk("zz", 0, 1, 0, True)]), epoch),
                client.execute(blind_decode(3, 10), epoch),
            )
            # The engine's way back: a new handshake, then the next step on a new stream.
            epoch = (await client.initialize(8, timeout=30)).epoch
            again = await client.execute(prefill(4), epoch)
            return first, bad, behind, again

    with served(tiny_llama_path) as (address, executed, _):
        first, bad, behind, again = asyncio.run(run(address))
        assert first.step_id == 1 and again.step_id == 4
        assert isinstance(bad, ExecutorRejected) and bad.code == "INVALID_ARGUMENT" and "step 2" in bad.detail
        assert isinstance(behind, ExecutorUnavailable) and "follows step 2, which did not run" in behind.detail
        assert executed == [1, 2, 4]  # step 2 was tried (and refused), 3 never


def test_a_step_past_its_deadline_fails_it_and_the_steps_behind_it(tiny_llama_path):
    async def run(address):
        async with connected(address, step_timeout=0.5) as (client, epoch):
            await client.execute(prefill(1), epoch)
            started = time.monotonic()
            slow, behind = await settle(client.execute(blind_decode(2, 10), epoch),
                                        client.execute(blind_decode(3, 11), epoch, timeout=30))
            waited = time.monotonic() - started
            await asyncio.sleep(2.0)  # step 2 ends at the executor; step 3 would run now
            return slow, behind, waited

    with served(tiny_llama_path, slow_steps={2: 1.5}) as (address, executed, _):
        slow, behind, waited = asyncio.run(run(address))
        assert isinstance(slow, ExecutorUnavailable) and slow.code == "DEADLINE_EXCEEDED"
        assert isinstance(behind, ExecutorUnavailable)
        assert waited < 1.4  # by the deadline, not when the step ended
        assert executed == [1, 2]  # the stream was cancelled: step 3 was dropped where it would run


def test_cancelling_a_step_cancels_the_steps_behind_it(tiny_llama_path):
    async def run(address, executed):
        async with connected(address) as (client, epoch):
            await client.execute(prefill(1), epoch)
            dropped = client.execute(blind_decode(2, 10), epoch)
            behind = client.execute(blind_decode(3, 11), epoch)
            await until(lambda: 2 in executed)  # step 2 runs (1 s), 3 is queued
            dropped.cancel()  # what the engine's _drop_sent does
            (outcome,) = await settle(behind)
            await asyncio.sleep(1.5)
            return outcome

    with served(tiny_llama_path, slow_steps={2: 1.0}) as (address, executed, _):
        outcome = asyncio.run(run(address, executed))
        assert isinstance(outcome, ExecutorUnavailable)
        assert executed == [1, 2]


def test_a_lost_executor_fails_the_waiting_steps_as_unavailable(tiny_llama_path):
    async def run(address, executed, stop):
        async with connected(address) as (client, epoch):
            await client.execute(prefill(1), epoch)
            waiting = client.execute(blind_decode(2, 10), epoch)
            await until(lambda: 2 in executed)
            stop()  # the server goes away while step 2 runs
            (outcome,) = await settle(waiting)
            return outcome

    with served(tiny_llama_path, slow_steps={2: 1.0}) as (address, executed, server):
        outcome = asyncio.run(run(address, executed, lambda: server.stop(None)))
    assert isinstance(outcome, ExecutorUnavailable), outcome


@pytest.mark.parametrize("wrong", ["", "wrong-token"])
def test_a_stream_without_the_token_is_refused(tiny_llama_path, wrong):
    async def run(address):
        async with connected(address) as (_, epoch):  # the epoch is not secret; the token is
            pass
        intruder = ExecutorClient(address, wrong or "x", step_timeout=30)
        if not wrong:
            intruder._metadata = ()
        try:
            (outcome,) = await settle(intruder.execute(prefill(1), epoch))
            return outcome
        finally:
            await intruder.close()

    with served(tiny_llama_path) as (address, executed, _):
        outcome = asyncio.run(run(address))
        # UNAUTHENTICATED, or INTERNAL when grpc.aio's first write raced the refusal (see
        # _stream_error); test_access_control checks the code itself with a sync client.
        assert outcome.code in ("UNAUTHENTICATED", "INTERNAL"), outcome
        assert executed == []


def test_a_step_the_runner_fails_is_internal_and_the_stream_serves_on(tiny_llama_path):
    """An exception in the runner (our bug) answers that step as INTERNAL, which the engine treats
    as rejected (its requests fail); the executor keeps serving: a step behind it that builds on it
    is refused as not run, and the next independent step runs on the same stream."""
    async def run(address):
        async with connected(address) as (client, epoch):
            first, broken, behind = await settle(client.execute(prefill(1), epoch),
                                                 client.execute(blind_decode(2, 10), epoch),
                                                 client.execute(blind_decode(3, 11), epoch))
            restart = prefill(4)
            restart.finished_req_ids = ["a"]  # drop "a" and send it again in full
            again = await client.execute(restart, epoch)
            return first, broken, behind, again

    with served(tiny_llama_path, failing_step=2) as (address, _, _):
        first, broken, behind, again = asyncio.run(run(address))
    assert first.step_id == 1 and again.step_id == 4
    assert isinstance(broken, ExecutorRejected) and broken.code == "INTERNAL" and "boom in the runner" in broken.detail
    assert isinstance(behind, ExecutorUnavailable) and "follows step 2, which did not run" in behind.detail
