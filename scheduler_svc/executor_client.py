"""The scheduler's side of the internal Executor API (grpc.aio, so awaiting a step never blocks
the event loop that serves clients)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from chunkwise import codec
from chunkwise.auth import bearer_metadata, channel_credentials
from chunkwise.limits import EXECUTOR_MAX_MESSAGE_BYTES
from chunkwise.plan import ExecutorInfo, StepPlan, StepResult
from chunkwise.v1 import executor_pb2 as pb
from chunkwise.v1 import executor_pb2_grpc as pb_grpc

log = logging.getLogger("chunkwise.scheduler.executor")


# gRPC's default reconnect backoff grows to 120 s; after an executor restart the scheduler would
# then learn of it long after it is back. Keep reconnect attempts at most a second apart.
_CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_receive_message_length", EXECUTOR_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", EXECUTOR_MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class ExecutorError(Exception):
    """A call to the executor failed; `code` is the gRPC status name, for logs."""

    def __init__(self, code: str, detail: str):
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


class ExecutorUnavailable(ExecutorError):
    """Unreachable, too slow (the step timeout), restarted (the plan's epoch is gone) or the call
    was cancelled: its state is suspect, and a new handshake is the way back."""


class ExecutorRejected(ExecutorError):
    """The executor answered and refused the call itself (an invalid plan, a bad token): sending
    the same again fails again."""


# Status codes that mean "lost or not there", as opposed to "refused what was sent".
_UNAVAILABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.CANCELLED,
})


def _executor_error(e: grpc.aio.AioRpcError) -> ExecutorError:
    kind = ExecutorUnavailable if e.code() in _UNAVAILABLE_CODES else ExecutorRejected
    return kind(e.code().name, e.details() or "")


class ExecutorClient:
    """Every method raises ExecutorUnavailable or ExecutorRejected, never a gRPC error: gRPC
    stays in this module and in the servers."""

    def __init__(self, address: str, token: str, *, tls_ca_file: str | None = None,
                 tls_server_name: str | None = None, step_timeout: float | None = None):
        """`tls_ca_file` set: TLS, trusting that CA. `step_timeout`: the longest a step may take
        before the call fails with DEADLINE_EXCEEDED (a hung executor must not hang clients)."""
        self.address = address
        self.step_timeout = step_timeout
        self._metadata = bearer_metadata(token)
        options = list(_CHANNEL_OPTIONS)
        if tls_ca_file:
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            self._channel = grpc.aio.secure_channel(address, channel_credentials(tls_ca_file), options=options)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        self._stub = pb_grpc.ExecutorStub(self._channel)

    async def initialize(self, block_size: int, timeout: float) -> ExecutorInfo:
        """Handshake, retrying while the executor is unreachable (it may still be loading)."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            try:
                resp = await self._stub.Initialize(
                    pb.InitializeRequest(block_size=block_size),
                    metadata=self._metadata,
                    timeout=max(1.0, min(30.0, deadline - time.monotonic())),
                    wait_for_ready=True,
                )
                break
            except grpc.aio.AioRpcError as e:
                retriable = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if not retriable or time.monotonic() + delay > deadline:
                    raise _executor_error(e) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        return codec.executor_info_from_proto(resp)

    async def epoch(self, timeout: float = 2.0) -> str:
        """The executor's current epoch."""
        try:
            resp = await self._stub.GetEpoch(pb.GetEpochRequest(), metadata=self._metadata, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise _executor_error(e) from None
        return resp.executor_epoch

    def execute(self, plan: StepPlan, epoch: str, timeout: float | None = None) -> asyncio.Task[StepResult]:
        """Encode the plan and start the call now; the task gives its result.

        Starting the call here, not in the task, puts it ahead of whatever the caller wakes next:
        grpc.aio sends a unary call from a task of its own, which runs on the event loop's next
        turn, so a caller that yields once after this knows the plan is on its way.
        """
        msg = codec.plan_to_proto(plan, epoch)
        call = self._stub.ExecuteStep(
            msg, metadata=self._metadata, timeout=timeout if timeout is not None else self.step_timeout
        )
        return asyncio.ensure_future(self._step_result(call, plan.step_id))

    @staticmethod
    async def _step_result(call, step_id: int) -> StepResult:
        # Cancelling this task (a dropped step) cancels the call too: grpc.aio's await does that.
        try:
            resp = await call
        except grpc.aio.AioRpcError as e:
            raise _executor_error(e) from None
        result = codec.result_from_proto(resp)
        if result.step_id != step_id:
            raise ExecutorRejected("INTERNAL", f"executor answered step {result.step_id} for plan {step_id}")
        return result

    async def close(self) -> None:
        await self._channel.close()
