"""The scheduler's side of the internal Executor API (grpc.aio, so awaiting a step never blocks
the event loop that serves clients)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from chunkwise import codec
from chunkwise.auth import bearer_metadata
from chunkwise.plan import StepPlan, StepResult
from chunkwise.v1 import executor_pb2 as pb
from chunkwise.v1 import executor_pb2_grpc as pb_grpc

log = logging.getLogger("chunkwise.scheduler.executor")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ExecutorInfo:
    """What the handshake told us."""

    epoch: str
    block_size: int
    num_kv_blocks: int
    model_path: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    attention_backend: str


class ExecutorClient:
    def __init__(self, address: str, token: str):
        self.address = address
        self._metadata = bearer_metadata(token)
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
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
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        m = resp.model
        return ExecutorInfo(
            epoch=resp.executor_epoch,
            block_size=resp.block_size,
            num_kv_blocks=resp.num_kv_blocks,
            model_path=m.model_path,
            architecture=m.architecture,
            vocab_size=m.vocab_size,
            max_model_len=m.max_model_len,
            eos_token_ids=tuple(m.eos_token_ids),
            dtype=m.dtype,
            device=m.device,
            attention_backend=m.attention_backend,
        )

    async def execute(self, plan: StepPlan, epoch: str, timeout: float | None = None) -> StepResult:
        msg = codec.plan_to_proto(plan, epoch)
        resp = await self._stub.ExecuteStep(msg, metadata=self._metadata, timeout=timeout)
        result = codec.result_from_proto(resp)
        if result.step_id != plan.step_id:
            raise RuntimeError(f"executor answered step {result.step_id} for plan {plan.step_id}")
        return result

    async def close(self) -> None:
        await self._channel.close()
