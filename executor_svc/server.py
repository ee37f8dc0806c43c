"""The executor's gRPC shell: a thin layer that decodes plans and hands them to the ModelRunner.

Steps run one at a time (the runner owns the KV cache and per-request state), in order, on the
compute loop's thread (compute_loop.py). The scheduler sends its steps on one StepStream call: a
reader thread checks each plan as it arrives and queues it for the compute loop, so with async
scheduling plan n+1 is queued while n runs and the loop goes straight on to it; the handler's
thread sends each result as its step ends. Whether the step a plan follows ran, and whether the
plan's epoch is still the current one, is checked on the compute thread just before the plan runs,
so that it never runs on top of state that step did not leave.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import uuid
from concurrent import futures
from concurrent.futures import Future
from typing import Callable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from chunkwise import codec
from chunkwise.auth import TokenAuthInterceptor, server_credentials
from chunkwise.limits import EXECUTOR_MAX_MESSAGE_BYTES
from chunkwise.plan import StepPlan, StepResult
from chunkwise.v1 import executor_pb2 as pb
from chunkwise.v1 import executor_pb2_grpc as pb_grpc
from executor_svc.compute_loop import ComputeLoop
from executor_svc.engine import ModelRunner, PlanError

log = logging.getLogger("chunkwise.executor")

MAX_BLOCK_SIZE = 1024


def _answer_within(context) -> float:
    """Seconds a handler may wait before it answers a call that has a deadline: a fifth of the time
    left (at most 250 ms) is kept back so that the answer, with its reason, reaches the caller
    before the caller's own timer ends the call with a bare "Deadline Exceeded". gRPC reports a
    huge number for a call without a deadline."""
    remaining = max(0.0, context.time_remaining())
    return min(remaining - min(0.25, remaining / 5), threading.TIMEOUT_MAX)


def _still_waiting(context) -> bool:
    # The deadline is checked too: on a busy machine a call can still look active after it passed.
    return context.is_active() and context.time_remaining() > 0


class _HandshakeAbandoned(Exception):
    """A handshake whose caller was gone, or told it had waited too long, before its turn on the
    compute loop came: not run."""


class _HandshakeTurn:
    """Decides, once, whether a queued handshake runs: the compute thread starts it only if the
    caller still waits, and the handler gives up only if it has not started. Whichever comes
    first wins under one lock, so a caller told "not run" never finds a new epoch behind it."""

    def __init__(self, context):
        self._context = context
        self._lock = threading.Lock()
        self._runs: bool | None = None  # None until decided

    def start(self) -> bool:
        """On the compute thread, in the handshake's turn: True when it is to run."""
        with self._lock:
            if self._runs is None:
                self._runs = _still_waiting(self._context)
            return self._runs

    def give_up(self) -> bool:
        """From the handler: True when the handshake will not run (it had not started)."""
        with self._lock:
            if self._runs is None:
                self._runs = False
            return not self._runs


def _put_done(finished: queue.SimpleQueue, step_id: int, done: Future) -> None:
    finished.put((step_id, done))


class StepRefused(Exception):
    """A plan refused before it ran: the code and message of its StepError."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class ExecutorServicer(pb_grpc.ExecutorServicer):
    """Handlers check a call, then submit its work to the compute loop (compute_loop.py), which runs
    it on one thread in submission order."""

    def __init__(self, runner: ModelRunner, compute: ComputeLoop | None = None):
        self._runner = runner
        # Where the torch work runs (compute_loop.py says why on one thread); inline without one.
        self._compute = compute
        self._handshake = threading.Lock()  # one Initialize at a time
        self._epoch = ""  # empty until the first Initialize; changed on the compute thread
        # The last step of this epoch that was handled (run or refused), and whether it ran: only
        # read and written by the work on the compute thread.
        self._last_step: int | None = None
        self._last_step_ran = False

    def Initialize(self, request: pb.InitializeRequest, context) -> pb.InitializeResponse:
        bs = request.block_size
        if bs < 1 or bs > MAX_BLOCK_SIZE or bs & (bs - 1):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}], got {bs}",
            )
        # A handshake waits for the step that is running, and no longer than its caller does:
        # while a long step runs the scheduler retries every second or so, and handlers that
        # waited past their callers would fill the RPC pool (GetEpoch could not answer) and then
        # each start an epoch that nobody adopts once the step ends.
        if not self._handshake.acquire(timeout=_answer_within(context)):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "another handshake is waiting for the running step")
        try:
            if not _still_waiting(context):
                # The caller gave up while a long step ran (it has retried since): starting an
                # epoch nobody will use would only invalidate the one it adopts.
                context.abort(grpc.StatusCode.CANCELLED, "the caller went away before the handshake ran")
            turn = _HandshakeTurn(context)
            handshake = self._submit(self._initialize, bs, turn)
            try:
                try:
                    num_blocks = handshake.result(timeout=_answer_within(context))
                except futures.TimeoutError:
                    if turn.give_up():
                        raise _HandshakeAbandoned() from None
                    num_blocks = handshake.result()  # it started as the wait ended: answer when done
            except _HandshakeAbandoned:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the handshake waited for the running step past its deadline")
            except ValueError as e:  # e.g. a block size the attention backend cannot page with
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            log.info("initialized: block_size=%d num_kv_blocks=%d epoch=%s", bs, num_blocks, self._epoch)
            return pb.InitializeResponse(
                executor_epoch=self._epoch,
                model=codec.model_info_to_proto(self._runner.info),
                block_size=bs,
                num_kv_blocks=num_blocks,
            )
        finally:
            self._handshake.release()

    def _initialize(self, block_size: int, turn: _HandshakeTurn) -> int:
        """On the compute thread, after every step submitted before it."""
        if not turn.start():
            raise _HandshakeAbandoned()
        num_blocks = self._runner.initialize(block_size)
        # Every handshake starts a new epoch: the runner dropped all request state, so plans
        # built against an older epoch must be refused rather than half-applied.
        self._epoch = uuid.uuid4().hex
        self._last_step, self._last_step_ran = None, False
        return num_blocks

    def GetEpoch(self, request: pb.GetEpochRequest, context) -> pb.GetEpochResponse:
        # No lock: it must answer while a long step runs, and reading one str is atomic.
        return pb.GetEpochResponse(executor_epoch=self._epoch)

    def StepStream(self, request_iterator, context) -> Iterator[pb.StepResult]:
        # (step id, future) of each step once it is done, in submission order (the compute loop
        # finishes work in that order), then None when no more will come. Queued by the future's
        # callback on the compute thread, so this thread wakes once per step, when it can answer.
        finished: queue.SimpleQueue[tuple[int, Future] | None] = queue.SimpleQueue()
        reader = threading.Thread(target=self._accept_plans, args=(request_iterator, context, finished),
                                  name="executor-plans", daemon=True)
        reader.start()
        while (step := finished.get()) is not None:
            yield self._answer(*step, context)

    def _accept_plans(self, plans, context, finished: queue.SimpleQueue) -> None:
        """The reader thread of one StepStream: queue each plan for the compute loop as it comes,
        until the stream ends. A plan refused here is refused through the loop too, so that its
        answer comes after those of the steps before it."""
        previous: int | None = None
        try:
            for request in plans:
                try:
                    self._check_plan(request, previous)
                except StepRefused as e:
                    step = self._submit(self._refuse, request.step_id, e)
                else:
                    plan = codec.plan_from_proto(request)
                    step = self._submit(self._run_step, request.executor_epoch, plan, context.is_active)
                step.add_done_callback(functools.partial(_put_done, finished, request.step_id))
                previous = request.step_id
        except Exception as e:  # the call ended (cancelled, the connection dropped)
            log.debug("step stream ended: %s", e)
        finally:  # after every step queued before it
            self._submit(lambda: None).add_done_callback(lambda _: finished.put(None))

    def _check_plan(self, request: pb.StepPlan, previous: int | None) -> None:
        """What can be refused before a plan is queued: a stale epoch, a plan that follows a step
        this stream did not carry just before it."""
        if not self._epoch:
            raise StepRefused(grpc.StatusCode.FAILED_PRECONDITION, "executor not initialized; call Initialize")
        if request.executor_epoch != self._epoch:
            raise StepRefused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"plan is for executor epoch {request.executor_epoch!r}, current is {self._epoch!r}")
        if request.HasField("follows_step_id") and request.follows_step_id != previous:
            raise StepRefused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"step {request.step_id} follows step {request.follows_step_id}, which is not the "
                              f"step before it on this stream ({previous})")

    def _refuse(self, step_id: int, refusal: StepRefused) -> StepResult:
        """On the compute thread, in the refused plan's turn: it did not run."""
        self._last_step, self._last_step_ran = step_id, False
        raise refusal

    def _answer(self, step_id: int, step: Future, context) -> pb.StepResult:
        """A step's result once it ran, or why it did not."""
        try:
            return codec.result_to_proto(step.result())  # the result times itself (execute_seconds)
        except StepRefused as e:
            error = pb.StepError(code=e.code.name, message=e.message)
        except PlanError as e:
            error = pb.StepError(code="INVALID_ARGUMENT", message=str(e))
        except Exception as e:
            if self._runner.tp.size > 1:
                # A collective failed: a rank (on another host) is gone, and the ranks' states
                # have parted. End the stream as "executor lost" and exit, to be restarted whole.
                log.error("tensor-parallel collective failed (%s); exiting", e)
                threading.Timer(0.5, os._exit, (1,)).start()
                context.abort(grpc.StatusCode.UNAVAILABLE, "a tensor-parallel rank failed; the executor is restarting")
            log.exception("a step failed")
            error = pb.StepError(code="INTERNAL", message=f"{type(e).__name__}: {e}")
        return pb.StepResult(step_id=step_id, error=error)

    def _run_step(self, epoch: str, plan: StepPlan, caller_active: Callable[[], bool]) -> StepResult:
        """On the compute thread, right after the step submitted before it."""
        if epoch != self._epoch:  # a handshake ran since the plan was submitted
            raise StepRefused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"plan is for executor epoch {epoch!r}, current is {self._epoch!r}")
        ran = False
        try:
            follows = plan.follows_step_id
            if follows is not None and (self._last_step != follows or not self._last_step_ran):
                raise StepRefused(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"step {plan.step_id} follows step {follows}, which did not run")
            if not caller_active():  # the scheduler gave up on the stream (a step timed out, a restart)
                raise StepRefused(grpc.StatusCode.CANCELLED, "the caller went away before the step ran")
            try:
                result = self._runner.execute(plan)
            except PlanError as e:
                raise PlanError(f"step {plan.step_id}: {e}") from None
            ran = True
            return result
        finally:
            self._last_step, self._last_step_ran = plan.step_id, ran

    def _submit(self, fn, *args) -> Future:
        """`fn(*args)` on the compute loop, or here and now without one."""
        if self._compute is not None:
            return self._compute.submit(fn, *args)
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except Exception as e:
            done.set_exception(e)
        return done


def build_server(
    runner: ModelRunner, host: str, port: int, token: str, tls_cert_file: str | None = None,
    tls_key_file: str | None = None, compute: ComputeLoop | None = None,
) -> tuple[grpc.Server, int]:
    """Create (not start) the server; returns it with the bound port (useful with port 0).

    Every call but health checks must carry `token`; TLS when both PEM files are given. With
    `compute`, the runner's work runs on the thread serving that loop (else on gRPC's threads).
    """
    if not token:
        raise ValueError("the executor needs a shared token: it refuses every call without one")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="executor-rpc"),
        interceptors=[TokenAuthInterceptor([token])],
        options=[
            ("grpc.max_receive_message_length", EXECUTOR_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", EXECUTOR_MAX_MESSAGE_BYTES),
        ],
    )
    pb_grpc.add_ExecutorServicer_to_server(ExecutorServicer(runner, compute), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", "chunkwise.v1.Executor"):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if tls_cert_file and tls_key_file:
        bound = server.add_secure_port(f"{host}:{port}", server_credentials(tls_cert_file, tls_key_file))
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    return server, bound
