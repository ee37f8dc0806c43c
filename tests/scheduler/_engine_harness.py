"""An in-process Engine over a stand-in for ExecutorClient: each plan is answered a moment later
with the checking FakeExecutor's result, and the stream's queue records, at every event handed to
it, how many plans had been sent by then."""

from __future__ import annotations

import asyncio
import time

from chunkwise.plan import GREEDY, ExecutorInfo, StepPlan, StepResult
from scheduler_svc.config import ServiceConfig
from scheduler_svc.engine import Engine, StreamEvent
from scheduler_svc.validation import ParsedRequest

from ._fake_executor import VOCAB_SIZE, FakeExecutor

BLOCK, NUM_BLOCKS = 16, 64


class AnsweringExecutor:
    """What the engine uses of ExecutorClient: `execute` starts the call and returns its task."""

    address = "in-process"
    step_timeout = None

    def __init__(self) -> None:
        self.fake: FakeExecutor | None = None
        self.sent: list[int] = []

    def execute(self, plan: StepPlan, epoch: str, timeout: float | None = None) -> asyncio.Future[StepResult]:
        self.sent.append(plan.step_id)

        async def answer() -> StepResult:
            await asyncio.sleep(0.002)  # the executor computing
            assert self.fake is not None
            return self.fake.execute(plan)

        return asyncio.ensure_future(answer())

    async def epoch(self, timeout: float = 2.0) -> str:
        return "e1"


class RecordingQueue(asyncio.Queue):
    def __init__(self, executor: AnsweringExecutor) -> None:
        super().__init__()
        self.executor = executor
        self.plans_sent_at_put: list[tuple[int, int, str | None]] = []  # (tokens so far, plans sent, finish)
        self.events: list[StreamEvent] = []

    def put_nowait(self, item) -> None:
        self.plans_sent_at_put.append((item.completion_tokens, len(self.executor.sent), item.finish_reason))
        self.events.append(item)
        super().put_nowait(item)


async def serve_one(max_tokens: int, **config) -> tuple[RecordingQueue, list[int]]:
    """Serve one greedy request whose prompt fits one step; `config`: ServiceConfig fields."""
    executor = AnsweringExecutor()
    config = ServiceConfig(token="t", tokenizer="/nonexistent", block_size=BLOCK, max_model_len=256,
                           max_num_batched_tokens=64, stats_interval=0, **config)
    info = ExecutorInfo(epoch="e1", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, model_path="/nonexistent",
                        architecture="fake", vocab_size=VOCAB_SIZE, max_model_len=256, eos_token_ids=(),
                        dtype="float32", device="cpu", attention_backend="fake", num_parameters=0)
    engine = Engine(config, executor, info)  # type: ignore[arg-type]
    executor.fake = FakeExecutor(NUM_BLOCKS, BLOCK, engine.scheduler)
    engine.start()
    try:
        stream = engine.submit(ParsedRequest(
            request_id="a", prompt_token_ids=[(7 * i + 3) % VOCAB_SIZE for i in range(20)], sampling=GREEDY,
            max_tokens=max_tokens, stop=(), stop_token_ids=(), ignore_eos=True, cache_salt=None,
            arrival_time=time.monotonic(),
        ))
        queue = stream.queue = RecordingQueue(executor)
        tokens: list[int] = []
        deadline = time.monotonic() + 30
        while True:
            event = await asyncio.wait_for(queue.get(), timeout=max(0.1, deadline - time.monotonic()))
            assert event.error is None
            tokens += event.token_ids
            if event.finish_reason is not None:
                return queue, tokens
    finally:
        await engine.stop()
