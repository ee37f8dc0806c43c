"""The executor's gRPC shell: a thin layer that decodes plans and hands them to the ModelRunner.

Steps run one at a time (the runner owns the KV cache and per-request state), in order, on the
compute loop's thread (compute_loop.py). With async scheduling the scheduler sends step n+1 while
n runs, so two ExecuteStep calls can be here at once and the thread pool may pick them up in
either order: a plan that says it follows step n is submitted only after n was, and is refused
with FAILED_PRECONDITION, just before it would run, if n did not run, so that it never runs on
top of state n did not leave.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from concurrent import futures
from concurrent.futures import Future
from typing import Callable

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
# How long a plan waits for the step it follows when the call carries no deadline.
FOLLOW_WAIT_SECONDS = 60.0


class StepRefused(Exception):
    """A plan refused where it was about to run (on the compute thread): the status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class ExecutorServicer(pb_grpc.ExecutorServicer):
    """Handlers check a call, then submit its work to the compute loop (compute_loop.py), which runs
    it on one thread in submission order. A plan that follows step n is submitted only after n was
    (it waits for that here), so when n is done the loop goes straight on to n+1, with no handler
    thread to wake in between; whether n ran is checked there, just before n+1 runs."""

    def __init__(self, runner: ModelRunner, compute: ComputeLoop | None = None):
        self._runner = runner
        # Where the torch work runs (compute_loop.py says why on one thread); inline without one.
        self._compute = compute
        self._lock = threading.Condition()  # notified whenever a step was submitted or the epoch changed
        self._epoch = ""  # empty until the first Initialize; changed on the compute thread
        # The last step of this epoch submitted to the compute loop (guarded by the lock).
        self._last_submitted: int | None = None
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
        with self._lock:
            if not context.is_active():
                # The caller gave up while a long step held the lock (it has retried since):
                # starting an epoch nobody will use would only invalidate the one it adopts.
                context.abort(grpc.StatusCode.CANCELLED, "the caller went away before the handshake ran")
            try:
                num_blocks = self._submit(self._initialize, bs).result()
            except ValueError as e:  # e.g. a block size the attention backend cannot page with
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            self._last_submitted = None
            self._lock.notify_all()  # plans waiting for a step of the old epoch give up
            log.info("initialized: block_size=%d num_kv_blocks=%d epoch=%s", bs, num_blocks, self._epoch)
            return pb.InitializeResponse(
                executor_epoch=self._epoch,
                model=codec.model_info_to_proto(self._runner.info),
                block_size=bs,
                num_kv_blocks=num_blocks,
            )

    def _initialize(self, block_size: int) -> int:
        """On the compute thread, after every step submitted before it."""
        num_blocks = self._runner.initialize(block_size)
        # Every handshake starts a new epoch: the runner dropped all request state, so plans
        # built against an older epoch must be refused rather than half-applied.
        self._epoch = uuid.uuid4().hex
        self._last_step, self._last_step_ran = None, False
        return num_blocks

    def GetEpoch(self, request: pb.GetEpochRequest, context) -> pb.GetEpochResponse:
        # No lock: it must answer while a long step runs, and reading one str is atomic.
        return pb.GetEpochResponse(executor_epoch=self._epoch)

    def ExecuteStep(self, request: pb.StepPlan, context) -> pb.StepResult:
        with self._lock:
            self._check_epoch(request, context)
            if request.HasField("follows_step_id"):
                self._wait_for_submitted(request.follows_step_id, request, context)
            plan = codec.plan_from_proto(request)
            pending = self._submit(self._run_step, request.executor_epoch, plan, context.is_active)
            self._last_submitted = request.step_id
            self._lock.notify_all()
        try:
            result = pending.result()  # times itself: StepResult.execute_seconds
        except StepRefused as e:
            context.abort(e.code, e.message)
        except PlanError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {plan.step_id}: {e}")
        except Exception as e:
            if self._runner.tp.size == 1:
                raise
            # A collective failed: a rank (on another host) is gone, and the ranks' states
            # have parted. Fail the step as "executor lost" and exit, to be restarted whole.
            log.error("step %d: tensor-parallel collective failed (%s); exiting", plan.step_id, e)
            threading.Timer(0.5, os._exit, (1,)).start()
            context.abort(grpc.StatusCode.UNAVAILABLE, "a tensor-parallel rank failed; the executor is restarting")
        return codec.result_to_proto(result)

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
            if not caller_active():  # the scheduler timed out on this step and resynchronises
                raise StepRefused(grpc.StatusCode.CANCELLED, "the caller went away before the step ran")
            result = self._runner.execute(plan)
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

    def _check_epoch(self, request: pb.StepPlan, context) -> None:
        if not self._epoch:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "executor not initialized; call Initialize")
        if request.executor_epoch != self._epoch:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"plan is for executor epoch {request.executor_epoch!r}, current is {self._epoch!r}",
            )

    def _wait_for_submitted(self, follows: int, request: pb.StepPlan, context) -> None:
        """Hold the lock's condition until step `follows` of this epoch has been submitted."""
        remaining = context.time_remaining()
        deadline = time.monotonic() + (FOLLOW_WAIT_SECONDS if remaining is None else remaining)
        while self._last_submitted is None or self._last_submitted < follows:
            left = deadline - time.monotonic()
            if left <= 0 or not context.is_active():
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"step {request.step_id} follows step {follows}, which never arrived")
            self._lock.wait(min(left, 1.0))
            self._check_epoch(request, context)  # a new handshake dropped what the plan builds on


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
