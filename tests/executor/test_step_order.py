"""The executor's gRPC server runs steps in order: with async scheduling two ExecuteStep calls can be
at the server at once, and the one that follows the other must wait for it, and must be refused
(FAILED_PRECONDITION) when the step it follows did not run."""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import pytest

from chunkwise import codec
from chunkwise.auth import bearer_metadata
from chunkwise.plan import RunningRequestDelta, ScheduledChunk, StepPlan
from chunkwise.v1 import executor_pb2 as pb
from chunkwise.v1 import executor_pb2_grpc as pb_grpc
from executor_svc.server import build_server

from .helpers import ServedComputeLoop, blind_decode, make_runner, prefill

TOKEN = "step-order-test-token"


@pytest.fixture(params=["inline", "compute-loop"])
def executor(tiny_llama_path, request):
    """The server running steps on its handler threads (inline) and on a compute loop's thread,
    as `python -m executor_svc` does (there: the main thread)."""
    runner = make_runner(tiny_llama_path, block_size=8, num_kv_blocks=16)
    with contextlib.ExitStack() as stack:
        loop = stack.enter_context(ServedComputeLoop()).loop if request.param == "compute-loop" else None
        server, port = build_server(runner, "127.0.0.1", 0, TOKEN, compute=loop)
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.ExecutorStub(channel)
        epoch = stub.Initialize(pb.InitializeRequest(block_size=8), metadata=bearer_metadata(TOKEN),
                                timeout=30).executor_epoch
        yield stub, epoch
        channel.close()
        server.stop(None)


def call(stub, epoch, plan, timeout=30):
    return codec.result_from_proto(stub.ExecuteStep(codec.plan_to_proto(plan, epoch), metadata=bearer_metadata(TOKEN),
                                                    timeout=timeout))


def test_a_plan_that_arrives_before_the_step_it_follows_waits_for_it(executor):
    stub, epoch = executor
    first = call(stub, epoch, prefill(1)).sampled[0].token_id
    results = {}
    early = threading.Thread(target=lambda: results.setdefault(3, call(stub, epoch, blind_decode(3, 11))))
    early.start()  # step 3 before step 2
    time.sleep(0.5)
    assert early.is_alive(), "step 3 ran before step 2, which it follows"
    results[2] = call(stub, epoch, blind_decode(2, 10))
    early.join(30)
    assert not early.is_alive()
    # The same tokens as one step at a time with the tokens sent back explicitly.
    epoch = stub.Initialize(pb.InitializeRequest(block_size=8), metadata=bearer_metadata(TOKEN), timeout=30).executor_epoch
    assert call(stub, epoch, prefill(1)).sampled[0].token_id == first
    second = call(stub, epoch, StepPlan(2, running=[RunningRequestDelta("a", [first], [])],
                                        chunks=[ScheduledChunk("a", 10, 1, 10, True)])).sampled[0].token_id
    third = call(stub, epoch, StepPlan(3, running=[RunningRequestDelta("a", [second], [])],
                                       chunks=[ScheduledChunk("a", 11, 1, 11, True)])).sampled[0].token_id
    assert (results[2].sampled[0].token_id, results[3].sampled[0].token_id) == (second, third)


def test_a_plan_that_follows_a_refused_step_is_refused(executor):
    stub, epoch = executor
    call(stub, epoch, prefill(1))
    bad = StepPlan(2, follows_step_id=1, chunks=[ScheduledChunk("zz", 0, 1, 0, True)])
    with pytest.raises(grpc.RpcError) as e:
        call(stub, epoch, bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        call(stub, epoch, blind_decode(3, 10))  # builds on step 2, which did not run
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "follows step 2, which did not run" in e.value.details()


def test_a_plan_whose_step_never_comes_gives_up_by_its_deadline(executor):
    stub, epoch = executor
    call(stub, epoch, prefill(1))
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        call(stub, epoch, blind_decode(5, 10), timeout=1.0)  # follows step 4, never sent
    assert e.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert time.monotonic() - started < 5
    # and the executor still serves the step that does come
    assert call(stub, epoch, StepPlan(2, running=[RunningRequestDelta("a", [5], [])],
                                      chunks=[ScheduledChunk("a", 10, 1, 10, True)])).sampled
