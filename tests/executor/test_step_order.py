"""The executor's StepStream runs a stream's steps in order: with async scheduling plan n+1
arrives while n runs and must run right after it, on the state n left; a plan must be refused
(answered with an error, the stream going on) when the step it follows did not run or was not the
step before it, or its epoch is gone."""

from __future__ import annotations

import contextlib

import grpc
import pytest

from chunkwise.auth import bearer_metadata
from chunkwise.plan import RunningRequestDelta, ScheduledChunk, StepPlan
from chunkwise.v1 import executor_pb2 as pb
from chunkwise.v1 import executor_pb2_grpc as pb_grpc
from executor_svc.server import build_server

from .helpers import ServedComputeLoop, StepNotRun, StepStreamCall, blind_decode, make_runner, prefill

TOKEN = "step-order-test-token"


@pytest.fixture(params=["inline", "compute-loop"])
def executor(tiny_llama_path, request):
    """The server running steps on the stream's reader thread (inline) and on a compute loop's
    thread, as `python -m executor_svc` does (there: the main thread). Yields the stub, a function
    that starts a new epoch and returns it, and the list of step ids the runner executed."""
    runner = make_runner(tiny_llama_path, block_size=8, num_kv_blocks=16)
    executed: list[int] = []
    execute = runner.execute

    def recorded(plan):
        executed.append(plan.step_id)
        return execute(plan)

    runner.execute = recorded
    with contextlib.ExitStack() as stack:
        loop = stack.enter_context(ServedComputeLoop()).loop if request.param == "compute-loop" else None
        server, port = build_server(runner, "127.0.0.1", 0, TOKEN, compute=loop)
        server.start()
        stack.callback(server.stop, None)
        channel = stack.enter_context(grpc.insecure_channel(f"127.0.0.1:{port}"))
        stub = pb_grpc.ExecutorStub(channel)

        def handshake() -> str:
            return stub.Initialize(pb.InitializeRequest(block_size=8), metadata=bearer_metadata(TOKEN),
                                   timeout=30).executor_epoch

        yield stub, handshake, executed


def test_plans_sent_ahead_run_in_order_on_the_state_the_step_before_left(executor):
    stub, handshake, _ = executor
    with StepStreamCall(stub, handshake(), TOKEN) as steps:
        steps.send(prefill(1))
        steps.send(blind_decode(2, 10))  # both sent before the first result
        steps.send(blind_decode(3, 11))
        pipelined = [steps.result().sampled[0].token_id for _ in range(3)]
    # The same tokens one step at a time, with each sampled token sent back explicitly.
    with StepStreamCall(stub, handshake(), TOKEN) as steps:
        first = steps.step(prefill(1)).sampled[0].token_id
        second = steps.step(StepPlan(2, running=[RunningRequestDelta("a", [first], [])],
                                     chunks=[ScheduledChunk("a", 10, 1, 10, True)])).sampled[0].token_id
        third = steps.step(StepPlan(3, running=[RunningRequestDelta("a", [second], [])],
                                    chunks=[ScheduledChunk("a", 11, 1, 11, True)])).sampled[0].token_id
    assert pipelined == [first, second, third]


def test_a_refused_step_is_answered_in_its_turn_and_the_step_behind_it_does_not_run(executor):
    stub, handshake, executed = executor
    epoch = handshake()
    with StepStreamCall(stub, epoch, TOKEN) as steps:
        steps.send(prefill(1))
        steps.send(StepPlan(2, follows_step_id=1, chunks=[ScheduledChunk("zz", 0, 1, 0, True)]))  # unknown request
        steps.send(blind_decode(3, 10))  # builds on step 2
        assert len(steps.result().sampled) == 1  # step 1 is answered before the refusals
        with pytest.raises(StepNotRun) as e:
            steps.result()
        assert (e.value.step_id, e.value.code) == (2, "INVALID_ARGUMENT")
        assert "step 2" in e.value.message
        with pytest.raises(StepNotRun) as e:
            steps.result()
        assert (e.value.step_id, e.value.code) == (3, "FAILED_PRECONDITION")
        assert "follows step 2, which did not run" in e.value.message
        # The stream goes on: a plan that builds on step 3 is refused too, and one that does not
        # follow anything runs.
        with pytest.raises(StepNotRun, match="follows step 3, which did not run"):
            steps.step(blind_decode(4, 11))
        assert steps.step(StepPlan(5, running=[RunningRequestDelta("a", [7], [])],
                                   chunks=[ScheduledChunk("a", 10, 1, 10, True)])).sampled
    assert executed == [1, 2, 5]
    # A new stream may not build on a step of another stream.
    with StepStreamCall(stub, epoch, TOKEN) as steps:
        with pytest.raises(StepNotRun) as e:
            steps.step(blind_decode(6, 11))
        assert e.value.code == "FAILED_PRECONDITION"
        assert "follows step 5, which is not the step before it on this stream" in e.value.message
    assert executed == [1, 2, 5]


def test_a_plan_of_an_old_epoch_is_refused(executor):
    stub, handshake, executed = executor
    old = handshake()
    handshake()
    with StepStreamCall(stub, old, TOKEN) as steps:
        with pytest.raises(StepNotRun) as e:
            steps.step(prefill(1))
        assert e.value.code == "FAILED_PRECONDITION"
        assert "epoch" in e.value.message
    assert executed == []
