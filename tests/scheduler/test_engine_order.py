"""The step loop's order within a turn: the next plan is sent before a step's outputs reach the
streams, so the executor does not wait for the streams' writes (scheduler_svc/engine.py).

The engine runs in-process against a stand-in for ExecutorClient that answers each plan with the
checking FakeExecutor's result a moment later, and each stream's queue records, at every event
handed to it, how many plans had been sent by then.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from chunkwise.plan import GREEDY, ExecutorInfo, StepPlan, StepResult
from scheduler_svc.config import ServiceConfig
from scheduler_svc.engine import Engine
from scheduler_svc.validation import ParsedRequest

from ._fake_executor import VOCAB_SIZE, FakeExecutor

BLOCK, NUM_BLOCKS, MAX_TOKENS = 16, 64, 6


class _AnsweringExecutor:
    """What the engine uses of ExecutorClient: `execute` starts the call and returns its task."""

    address = "in-process"
    step_timeout = None

    def __init__(self) -> None:
        self.fake: FakeExecutor | None = None
        self.sent: list[int] = []

    def execute(self, plan: StepPlan, epoch: str, timeout: float | None = None) -> asyncio.Task[StepResult]:
        self.sent.append(plan.step_id)

        async def answer() -> StepResult:
            await asyncio.sleep(0.002)  # the executor computing
            assert self.fake is not None
            return self.fake.execute(plan)

        return asyncio.ensure_future(answer())

    async def epoch(self, timeout: float = 2.0) -> str:
        return "e1"


class _RecordingQueue(asyncio.Queue):
    def __init__(self, executor: _AnsweringExecutor) -> None:
        super().__init__()
        self.executor = executor
        self.plans_sent_at_put: list[tuple[int, int, str | None]] = []  # (tokens so far, plans sent, finish)

    def put_nowait(self, item) -> None:
        self.plans_sent_at_put.append((item.completion_tokens, len(self.executor.sent), item.finish_reason))
        super().put_nowait(item)


async def _serve_one(async_scheduling: bool) -> tuple[_RecordingQueue, list[int]]:
    executor = _AnsweringExecutor()
    config = ServiceConfig(token="t", tokenizer="/nonexistent", block_size=BLOCK, max_model_len=256,
                           max_num_batched_tokens=64, async_scheduling=async_scheduling, stats_interval=0)
    info = ExecutorInfo(epoch="e1", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, model_path="/nonexistent",
                        architecture="fake", vocab_size=VOCAB_SIZE, max_model_len=256, eos_token_ids=(),
                        dtype="float32", device="cpu", attention_backend="fake")
    engine = Engine(config, executor, info)  # type: ignore[arg-type]
    executor.fake = FakeExecutor(NUM_BLOCKS, BLOCK, engine.scheduler)
    engine.start()
    try:
        stream = engine.submit(ParsedRequest(
            request_id="a", prompt_token_ids=[(7 * i + 3) % VOCAB_SIZE for i in range(20)], sampling=GREEDY,
            max_tokens=MAX_TOKENS, stop=(), stop_token_ids=(), ignore_eos=True, cache_salt=None,
            arrival_time=time.monotonic(),
        ))
        queue = stream.queue = _RecordingQueue(executor)
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


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_next_plan_is_sent_before_outputs_are_streamed(async_scheduling):
    queue, tokens = asyncio.run(_serve_one(async_scheduling))
    assert len(tokens) == MAX_TOKENS
    # One request whose prompt fits one step: its k-th token comes from its k-th step. When that
    # token is handed to its stream, the plans of the steps in flight behind it (one more with
    # async scheduling: k+2 in all; k+1 without) must already have been sent, up to the step of its
    # last token (the core plans no step beyond max_tokens).
    in_flight = 2 if async_scheduling else 1
    puts = queue.plans_sent_at_put
    assert [k for k, _, _ in puts] == list(range(1, MAX_TOKENS + 1))
    for k, plans_sent, finish in puts:
        if finish is None:
            assert plans_sent >= min(k + in_flight, MAX_TOKENS), f"token {k} was streamed with only {plans_sent} plans sent"
