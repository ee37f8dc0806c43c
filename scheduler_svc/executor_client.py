"""The scheduler's side of the internal Executor API (grpc.aio, so awaiting a step never blocks
the event loop that serves clients).

Steps travel on one StepStream call (`_StepStream`), opened with the first step after a handshake
and kept until something fails: on loopback a unary call per step cost ~0.5 ms of CPU across both
processes, a message each way on an open stream ~0.25 ms, and a fast executor's step is a few ms.
To the engine each step is still one future that gives its result or an ExecutorError."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

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


# Status codes (by name: a step's StepError carries the name) that mean "lost or not there", as
# opposed to "refused what was sent".
_UNAVAILABLE_NAMES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION", "CANCELLED"})
_CALL_REFUSED_CODES = frozenset({
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED,
})


def _step_error(code: str, message: str) -> ExecutorError:
    """A call that failed with status `code`, or a step the executor answered as not run with it
    (StepResult.error)."""
    kind = ExecutorUnavailable if code in _UNAVAILABLE_NAMES else ExecutorRejected
    return kind(code, message)


def _executor_error(e: grpc.aio.AioRpcError) -> ExecutorError:
    return _step_error(e.code().name, e.details() or "")


def _stream_error(e: grpc.aio.AioRpcError) -> ExecutorError:
    """The step stream itself ended. The executor answers a step it refuses in the stream, so an
    ending is a lost connection, a cancel or a deadline, whatever the code says: grpc.aio reports a
    write that raced the end of the call as INTERNAL ("Internal error from Core") in place of the
    call's real status. Only a refused call (wrong token, an executor without StepStream) is not."""
    kind = ExecutorRejected if e.code() in _CALL_REFUSED_CODES else ExecutorUnavailable
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
        self._steps: _StepStream | None = None  # the open StepStream call, if any

    async def initialize(self, block_size: int, timeout: float) -> ExecutorInfo:
        """Handshake, retrying while the executor is unreachable (it may still be loading). A new
        epoch ends whatever was sent before it, so the step stream is closed first."""
        self._drop_steps()
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

    def execute(self, plan: StepPlan, epoch: str, timeout: float | None = None) -> asyncio.Future[StepResult]:
        """Send the plan on the step stream (opened if none is); the future gives its result.

        The plan is queued for the stream's writer, which sends it on the event loop's next turn:
        a caller that yields once after this knows the plan is on its way. `timeout` (default the
        client's step_timeout) bounds the wait for this step's result; when it passes, the stream
        is cancelled, this step fails with DEADLINE_EXCEEDED and the steps behind it as not run
        (both ExecutorUnavailable). Cancelling the future
        cancels the stream too: every step behind it builds on it.
        """
        if self._steps is None or self._steps.closed:
            self._steps = _StepStream(self._stub, self._metadata)
        return self._steps.send(codec.plan_to_proto(plan, epoch), plan.step_id,
                                timeout if timeout is not None else self.step_timeout)

    def _drop_steps(self) -> None:
        if self._steps is not None:
            self._steps.close(ExecutorUnavailable("CANCELLED", "the step stream was closed"))
            self._steps = None

    async def close(self) -> None:
        self._drop_steps()
        await self._channel.close()


@dataclass(slots=True)
class _Waiting:
    step_id: int
    result: asyncio.Future[StepResult]
    deadline: asyncio.TimerHandle | None


class _StepStream:
    """One StepStream call: plans go out in the order they are sent, and each answer that comes
    back settles the oldest step still waiting (the executor answers in order). A step the
    executor did not run fails with its StepError (the steps behind it are answered as not run in
    turn). When the call ends, the oldest waiting step fails with the reason and those behind it as
    not run; the next step opens a new call."""

    def __init__(self, stub: pb_grpc.ExecutorStub, metadata) -> None:
        self.closed = False
        self._plans: asyncio.Queue[pb.StepPlan | None] = asyncio.Queue()
        self._waiting: deque[_Waiting] = deque()
        self._call = stub.StepStream(self._outgoing(), metadata=metadata)
        self._reader = asyncio.ensure_future(self._read())

    def send(self, msg: pb.StepPlan, step_id: int, timeout: float | None) -> asyncio.Future[StepResult]:
        loop = asyncio.get_running_loop()
        result: asyncio.Future[StepResult] = loop.create_future()
        waiting = _Waiting(step_id, result, None)
        if timeout is not None:
            waiting.deadline = loop.call_later(timeout, self._expire, waiting, timeout)
        result.add_done_callback(self._on_done)
        self._waiting.append(waiting)
        self._plans.put_nowait(msg)
        return result

    async def _outgoing(self):
        """The request iterator grpc.aio writes from (in a task of its own)."""
        while (msg := await self._plans.get()) is not None:
            yield msg

    async def _read(self) -> None:
        error: ExecutorError = ExecutorUnavailable("UNAVAILABLE", "the executor ended the step stream")
        try:
            async for resp in self._call:
                if not self._waiting:
                    error = ExecutorRejected("INTERNAL", f"executor answered step {resp.step_id}, which was not sent")
                    break
                waiting = self._waiting.popleft()
                if waiting.deadline is not None:
                    waiting.deadline.cancel()
                if resp.step_id != waiting.step_id:
                    self._waiting.appendleft(waiting)
                    error = ExecutorRejected("INTERNAL", f"executor answered step {resp.step_id} for plan {waiting.step_id}")
                    break
                if waiting.result.done():  # cancelled: the stream is being closed
                    continue
                if resp.HasField("error"):
                    waiting.result.set_exception(_step_error(resp.error.code, resp.error.message))
                else:
                    waiting.result.set_result(codec.result_from_proto(resp))
        except grpc.aio.AioRpcError as e:
            error = _stream_error(e)
        except asyncio.CancelledError:
            pass
        self.close(error)

    def _expire(self, waiting: _Waiting, timeout: float) -> None:
        if not waiting.result.done():
            self.close(ExecutorUnavailable("DEADLINE_EXCEEDED", f"step {waiting.step_id} took longer than {timeout:g} s"))

    def _on_done(self, result: asyncio.Future) -> None:
        if result.cancelled():  # the caller dropped a step: the steps behind it build on it
            self.close(ExecutorUnavailable("CANCELLED", "a step on the stream was cancelled"))

    def close(self, error: ExecutorError) -> None:
        """End the stream: `error` for the oldest waiting step, "did not run" for those behind it."""
        if self.closed:
            return
        self.closed = True
        self._call.cancel()
        self._plans.put_nowait(None)
        first = True
        while self._waiting:
            waiting = self._waiting.popleft()
            if waiting.deadline is not None:
                waiting.deadline.cancel()
            if not waiting.result.done():
                waiting.result.set_exception(error if first else ExecutorUnavailable(
                    "FAILED_PRECONDITION", f"step {waiting.step_id} was behind a failed step ({error.code})"))
            first = False
