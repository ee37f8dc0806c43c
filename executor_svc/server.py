"""The executor's gRPC shell: a thin layer that decodes plans and hands them to the ModelRunner.

Steps run one at a time (the runner owns the KV cache and per-request state); the lock makes
that explicit rather than relying on the scheduler sending one plan at a time.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from chunkwise import codec
from chunkwise.auth import TokenAuthInterceptor, server_credentials
from chunkwise.limits import EXECUTOR_MAX_MESSAGE_BYTES
from chunkwise.v1 import executor_pb2 as pb
from chunkwise.v1 import executor_pb2_grpc as pb_grpc
from executor_svc.engine import ModelRunner, PlanError

log = logging.getLogger("chunkwise.executor")

MAX_BLOCK_SIZE = 1024


class ExecutorServicer(pb_grpc.ExecutorServicer):
    def __init__(self, runner: ModelRunner):
        self._runner = runner
        self._lock = threading.Lock()
        self._epoch = ""  # empty until the first Initialize
        self._block_size = 0
        self._num_kv_blocks = 0

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
                num_blocks = self._runner.initialize(bs)
            except ValueError as e:  # e.g. a block size the attention backend cannot page with
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            # Every handshake starts a new epoch: the runner dropped all request state, so plans
            # built against an older epoch must be refused rather than half-applied.
            self._epoch = uuid.uuid4().hex
            self._block_size, self._num_kv_blocks = bs, num_blocks
            log.info("initialized: block_size=%d num_kv_blocks=%d epoch=%s", bs, num_blocks, self._epoch)
            return pb.InitializeResponse(
                executor_epoch=self._epoch,
                model=codec.model_info_to_proto(self._runner.info),
                block_size=bs,
                num_kv_blocks=num_blocks,
            )

    def GetEpoch(self, request: pb.GetEpochRequest, context) -> pb.GetEpochResponse:
        # No lock: it must answer while a long step runs, and reading one str is atomic.
        return pb.GetEpochResponse(executor_epoch=self._epoch)

    def ExecuteStep(self, request: pb.StepPlan, context) -> pb.StepResult:
        with self._lock:
            if not context.is_active():  # the scheduler timed out on this step and resynchronises
                context.abort(grpc.StatusCode.CANCELLED, "the caller went away before the step ran")
            if not self._epoch:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "executor not initialized; call Initialize")
            if request.executor_epoch != self._epoch:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"plan is for executor epoch {request.executor_epoch!r}, current is {self._epoch!r}",
                )
            plan = codec.plan_from_proto(request)
            try:
                result = self._runner.execute(plan)  # times itself: StepResult.execute_seconds
            except PlanError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {plan.step_id}: {e}")
            return codec.result_to_proto(result)


def build_server(
    runner: ModelRunner, host: str, port: int, token: str, tls_cert_file: str | None = None,
    tls_key_file: str | None = None,
) -> tuple[grpc.Server, int]:
    """Create (not start) the server; returns it with the bound port (useful with port 0).

    Every call but health checks must carry `token`; TLS when both PEM files are given.
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
    pb_grpc.add_ExecutorServicer_to_server(ExecutorServicer(runner), server)
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
