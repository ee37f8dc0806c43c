"""The executor runs its torch work on one thread (executor_svc/compute_loop.py says why): the loop
itself, and the gRPC server handing every handshake and step to it."""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import pytest

from chunkwise.auth import bearer_metadata
from chunkwise.plan import ScheduledChunk, StepPlan
from chunkwise.v1 import executor_pb2 as pb
from chunkwise.v1 import executor_pb2_grpc as pb_grpc
from executor_svc.compute_loop import ComputeLoop, ComputeLoopClosed
from executor_svc.server import build_server
from reliability_helpers import call_code, wait_until

from .helpers import ServedComputeLoop as Served
from .helpers import StepNotRun, StepStreamCall, blind_decode, make_runner, prefill

TOKEN = "compute-loop-test-token"


def test_calls_from_many_threads_run_on_the_serving_thread_one_at_a_time():
    ran_on, running, overlaps = [], [0], []

    def work(i):
        running[0] += 1
        overlaps.append(running[0])
        time.sleep(0.002)
        running[0] -= 1
        ran_on.append(threading.get_ident())
        return i * i

    with Served() as served:
        results = {}
        callers = [threading.Thread(target=lambda i=i: results.setdefault(i, served.loop.submit(work, i).result()))
                   for i in range(8)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(10)
        assert results == {i: i * i for i in range(8)}
        assert set(ran_on) == {served.thread.ident}
        assert max(overlaps) == 1


def test_an_exception_reaches_the_caller_and_the_loop_goes_on():
    def boom():
        raise ValueError("bad plan")

    with Served() as served:
        with pytest.raises(ValueError, match="bad plan"):
            served.loop.submit(boom).result()
        assert served.loop.submit(lambda: threading.get_ident()).result() == served.thread.ident


def test_work_queued_before_the_loop_serves_waits_for_it():
    served = Served()
    got = []
    caller = threading.Thread(target=lambda: got.append(served.loop.submit(threading.get_ident).result()))
    caller.start()
    time.sleep(0.3)
    assert not got, "the work ran before the loop served it (on the caller's thread)"
    with served:
        caller.join(10)
    assert got == [served.thread.ident]


def test_a_stopped_loop_refuses_work_and_fails_what_was_queued():
    loop = ComputeLoop()
    stop = threading.Event()
    errors = []

    def blocked_caller():
        try:
            loop.submit(lambda: None).result()
        except ComputeLoopClosed as e:
            errors.append(e)

    caller = threading.Thread(target=blocked_caller)
    caller.start()
    time.sleep(0.2)
    stop.set()
    loop.serve(stop)  # stops at once: what was queued fails, rather than leaving its caller waiting
    caller.join(5)
    assert not caller.is_alive() and len(errors) == 1
    with pytest.raises(ComputeLoopClosed):
        loop.submit(lambda: None).result()


@contextlib.contextmanager
def served_executor(runner):
    """The gRPC server over `runner` with its work on a served compute loop, initialized; yields
    the loop, the stub and the epoch."""
    with Served() as served:
        server, port = build_server(runner, "127.0.0.1", 0, TOKEN, compute=served.loop)
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.ExecutorStub(channel)
        try:
            epoch = stub.Initialize(pb.InitializeRequest(block_size=8), metadata=bearer_metadata(TOKEN),
                                    timeout=30).executor_epoch
            yield served, stub, epoch
        finally:
            channel.close()
            server.stop(None)


@contextlib.contextmanager
def released_at_exit(release: threading.Event):
    """Sets `release` however the block ends, so that a failed assertion does not leave a held
    step blocking the compute loop (and hide the failure behind the loop's shutdown check)."""
    try:
        yield
    finally:
        release.set()


def test_the_server_runs_the_handshake_and_every_step_on_the_loop_thread(tiny_llama_path):
    runner = make_runner(tiny_llama_path, block_size=8, num_kv_blocks=16)
    threads: dict[str, set[int]] = {"initialize": set(), "execute": set()}
    for name in threads:
        method = getattr(runner, name)

        def recorded(*args, _method=method, _name=name):
            threads[_name].add(threading.get_ident())
            return _method(*args)

        setattr(runner, name, recorded)
    with served_executor(runner) as (served, stub, epoch):
        with StepStreamCall(stub, epoch, TOKEN) as steps:
            steps.step(prefill(1))
            steps.send(blind_decode(2, 10))  # two plans in flight at once (async scheduling)
            steps.send(blind_decode(3, 11))
            assert len(steps.result().sampled) == len(steps.result().sampled) == 1
            # A plan the runner refuses is still an INVALID_ARGUMENT, raised on the loop's thread.
            with pytest.raises(StepNotRun) as e:
                steps.step(StepPlan(4, chunks=[ScheduledChunk("zz", 0, 1, 0, True)]))
            assert e.value.code == "INVALID_ARGUMENT"
    assert threads["initialize"] == {served.thread.ident}
    assert threads["execute"] == {served.thread.ident}


def test_a_plan_whose_caller_gave_up_while_queued_is_not_run(tiny_llama_path):
    """The scheduler gives up on a step while the step before it runs (its deadline passed) and
    cancels the stream: the plan queued behind is dropped where it would run (the scheduler
    resynchronises with a new handshake), and a new stream cannot build on it."""
    runner = make_runner(tiny_llama_path, block_size=8, num_kv_blocks=16)
    executed = []
    execute = runner.execute

    def slow_first_decode(plan):
        executed.append(plan.step_id)
        if plan.step_id == 2:
            time.sleep(1.0)
        return execute(plan)

    runner.execute = slow_first_decode
    with served_executor(runner) as (_, stub, epoch):
        with StepStreamCall(stub, epoch, TOKEN) as steps:
            steps.step(prefill(1))
            steps.send(blind_decode(2, 10))
            steps.send(blind_decode(3, 11))
            wait_until(lambda: 2 in executed, 10, "step 2 to start", 0.01)  # it runs 1 s; step 3 is queued
            steps.cancel()
            with pytest.raises(grpc.RpcError) as e:
                steps.result()
            assert e.value.code() == grpc.StatusCode.CANCELLED
        time.sleep(1.2)  # step 2 ends; step 3 would run now
        with StepStreamCall(stub, epoch, TOKEN) as steps:
            with pytest.raises(StepNotRun) as e:
                steps.step(blind_decode(4, 12))
            assert e.value.code == "FAILED_PRECONDITION"
    assert executed == [1, 2]


def test_handshakes_retried_during_a_long_step_give_up_with_their_callers(tiny_llama_path):
    """While a step runs long, the scheduler's reconnect loop sends a handshake with a short
    deadline again and again. Each handler waits only as long as its caller: the RPC pool stays
    free (GetEpoch answers throughout), and no abandoned handshake runs once the step ends, so the
    epoch changes only when a caller is there to adopt it."""
    runner = make_runner(tiny_llama_path, block_size=8, num_kv_blocks=16)
    running, release, initialized = threading.Event(), threading.Event(), []
    execute, initialize = runner.execute, runner.initialize

    def held_decode(plan):
        if plan.step_id == 2:
            running.set()
            release.wait(30)
        return execute(plan)

    def counted_initialize(block_size):
        initialized.append(block_size)
        return initialize(block_size)

    runner.execute, runner.initialize = held_decode, counted_initialize
    with served_executor(runner) as (_, stub, epoch):
        with StepStreamCall(stub, epoch, TOKEN) as steps, released_at_exit(release):
            steps.step(prefill(1))
            steps.send(blind_decode(2, 10))
            assert running.wait(10)  # step 2 holds the compute loop until released
            waiting = []  # a caller with a longer deadline holds the handshake meanwhile
            holder = threading.Thread(target=lambda: waiting.append(call_code(lambda: stub.Initialize(
                pb.InitializeRequest(block_size=8), metadata=bearer_metadata(TOKEN), timeout=4))))
            holder.start()
            time.sleep(0.2)
            for _ in range(6):  # with the holder and the step stream, more than the RPC pool's threads
                t0 = time.monotonic()
                assert call_code(lambda: stub.Initialize(pb.InitializeRequest(block_size=8),
                                                         metadata=bearer_metadata(TOKEN), timeout=0.3)) \
                    == grpc.StatusCode.DEADLINE_EXCEEDED
                assert time.monotonic() - t0 < 2.0
            assert stub.GetEpoch(pb.GetEpochRequest(), metadata=bearer_metadata(TOKEN), timeout=1).executor_epoch == epoch
            holder.join(10)
            assert waiting == [grpc.StatusCode.DEADLINE_EXCEEDED]
            # Its handler stopped waiting with it: the next handshake gets its turn to wait, and
            # answers why before its caller's deadline ends the call. On a busy machine the caller's
            # timer can still win the race, which hides the reason: only that answer is retried.
            for _ in range(5):
                with pytest.raises(grpc.RpcError) as e:
                    stub.Initialize(pb.InitializeRequest(block_size=8), metadata=bearer_metadata(TOKEN), timeout=1)
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                if e.value.details() != "Deadline Exceeded":
                    break
            assert "past its deadline" in e.value.details()
            release.set()
            assert len(steps.result().sampled) == 1
        time.sleep(0.5)  # an abandoned handshake queued behind the step would have run by now
        assert initialized == [8]  # the one served_executor made
        assert stub.GetEpoch(pb.GetEpochRequest(), metadata=bearer_metadata(TOKEN), timeout=2).executor_epoch == epoch
        fresh = stub.Initialize(pb.InitializeRequest(block_size=8), metadata=bearer_metadata(TOKEN), timeout=30)
        assert fresh.executor_epoch != epoch and initialized == [8, 8]


class _FakeCall:
    """The two things a handshake's turn reads from a gRPC call."""

    def __init__(self, active=True, remaining=10.0):
        self.active, self.remaining = active, remaining

    def is_active(self):
        return self.active

    def time_remaining(self):
        return self.remaining


def test_a_handshake_turn_is_decided_once_by_whoever_comes_first():
    """The handler gives up on a queued handshake just as its turn on the compute loop comes:
    exactly one of them decides, so a caller told "not run" never finds a new epoch behind it,
    and a handshake that started is waited for."""
    from executor_svc.server import _answer_within, _HandshakeTurn

    given_up = _HandshakeTurn(_FakeCall())
    assert given_up.give_up() and not given_up.start() and given_up.give_up()
    started = _HandshakeTurn(_FakeCall())
    assert started.start() and not started.give_up() and started.start()
    for call in (_FakeCall(active=False), _FakeCall(remaining=-0.01)):  # caller gone before its turn
        gone = _HandshakeTurn(call)
        assert not gone.start() and gone.give_up()
    # The handler answers before its caller's deadline, with time for the answer to travel.
    assert _answer_within(_FakeCall(remaining=10.0)) == pytest.approx(9.75)
    assert _answer_within(_FakeCall(remaining=0.5)) == pytest.approx(0.4)
    assert _answer_within(_FakeCall(remaining=-1.0)) == 0.0
