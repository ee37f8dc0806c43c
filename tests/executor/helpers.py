"""Test helpers for the executor: a runner factory, HF references, and a minimal scheduler
stand-in (`Driver`) that allocates blocks and turns "compute n tokens of request r" into
incremental StepPlans the way the real scheduler does."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from chunkwise import codec
from chunkwise.auth import bearer_metadata
from chunkwise.plan import (
    GREEDY,
    NewRequestData,
    RunningRequestDelta,
    SamplingParams,
    ScheduledChunk,
    StepPlan,
    StepResult,
)
from executor_svc.compute_loop import ComputeLoop
from executor_svc.config import ExecutorConfig
from executor_svc.engine import ModelRunner


def make_runner(path: Path, block_size: int = 8, num_kv_blocks: int = 96, **config) -> ModelRunner:
    config.setdefault("dtype", "float32")  # exactness is checked in float32 (auto may pick bf16)
    runner = ModelRunner(ExecutorConfig(model=str(path), num_kv_blocks=num_kv_blocks, **config))
    runner.initialize(block_size)
    return runner


def random_tokens(n: int, seed: int, vocab: int = 384) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()  # avoid bos/eos/pad ids


@torch.no_grad()
def hf_logits(ref, tokens: list[int]) -> torch.Tensor:
    """Reference float32 logits [len(tokens), vocab] from transformers."""
    return ref(torch.tensor([tokens])).logits[0].float()


@dataclass
class DriverRequest:
    tokens: list[int]
    blocks: list[int]
    sampling: SamplingParams
    computed: int  # next chunk's num_computed_tokens
    cached: int  # positions below this hold KV from shared blocks (first chunk's kv_write_start)
    shared: int = 0  # leading blocks borrowed from another request (never freed here)
    sent: bool = False
    sent_tokens: int = 0
    sent_blocks: int = 0
    outputs: list[int] = field(default_factory=list)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> logits row


class Driver:
    """Feeds a ModelRunner incremental plans. Blocks come from a free list in a scrambled order
    so block tables are not contiguous."""

    def __init__(self, runner: ModelRunner, seed: int = 0):
        self.runner = runner
        self.bs = runner.block_size
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(runner.num_kv_blocks, generator=g).tolist()
        self.reqs: dict[str, DriverRequest] = {}
        self.finished: list[str] = []
        self.step_id = 0
        self.plans: list[StepPlan] = []

    def allocate(self, n: int) -> list[int]:
        assert len(self.free) >= n, "test ran out of KV blocks"
        out, self.free = self.free[:n], self.free[n:]
        return out

    def add(self, rid: str, tokens: list[int], sampling: SamplingParams = GREEDY,
            cached_blocks: list[int] = (), cached_tokens: int | None = None,
            start: int | None = None) -> DriverRequest:
        """Queue a request. `cached_blocks` become the head of its block table and hold KV for
        the first `cached_tokens` positions (default: all of them); its first chunk starts at
        `start` (default: min(cached_tokens, len - 1), as a scheduler must compute >= 1 token)."""
        cached = len(cached_blocks) * self.bs if cached_tokens is None else cached_tokens
        cached = min(cached, len(tokens))
        first = min(cached, len(tokens) - 1) if start is None else start
        r = DriverRequest(list(tokens), list(cached_blocks), sampling, first, cached, shared=len(cached_blocks))
        self.reqs[rid] = r
        return r

    def finish(self, rid: str) -> None:
        r = self.reqs.pop(rid)
        self.free.extend(r.blocks[r.shared:])
        self.finished.append(rid)

    def remaining(self, rid: str) -> int:
        r = self.reqs[rid]
        return len(r.tokens) - r.computed

    def step(self, work: dict[str, int | None]) -> StepResult:
        """Compute `n` tokens (None: everything left) of each request in `work`, in order."""
        new, running, chunks = [], [], []
        for rid, n in work.items():
            r = self.reqs[rid]
            n = self.remaining(rid) if n is None else n
            end = r.computed + n
            need = -(-end // self.bs)
            if need > len(r.blocks):
                r.blocks.extend(self.allocate(need - len(r.blocks)))
            write_start = max(r.computed, min(r.cached, end))
            chunks.append(ScheduledChunk(rid, r.computed, n, write_start, end == len(r.tokens)))
        for rid, r in self.reqs.items():
            if not r.sent and rid in work:
                new.append(NewRequestData(rid, list(r.tokens), list(r.blocks), r.sampling))
                r.sent, r.sent_tokens, r.sent_blocks = True, len(r.tokens), len(r.blocks)
            elif r.sent and (len(r.tokens) > r.sent_tokens or len(r.blocks) > r.sent_blocks):
                running.append(RunningRequestDelta(rid, r.tokens[r.sent_tokens:], r.blocks[r.sent_blocks:]))
                r.sent_tokens, r.sent_blocks = len(r.tokens), len(r.blocks)
        self.step_id += 1
        plan = StepPlan(self.step_id, list(self.finished), new, running, chunks)
        self.finished = []
        self.plans.append(plan)
        result, logits = self.runner.execute_with_logits(plan)
        for c in chunks:
            r = self.reqs[c.req_id]
            for i, row in enumerate(logits[c.req_id]):
                r.logits[c.num_computed_tokens + i] = row
            r.computed = c.end
        for s in result.sampled:
            r = self.reqs[s.req_id]
            r.tokens.append(s.token_id)
            r.outputs.append(s.token_id)
        return result

    def logits_matrix(self, rid: str, start: int, end: int) -> torch.Tensor:
        r = self.reqs[rid]
        return torch.stack([r.logits[p] for p in range(start, end)])


def run_chunked_cached_mixed(runner: ModelRunner) -> tuple[Driver, list[tuple[str, int]]]:
    """One short scenario with every kind of row: "warm"'s prompt in two chunks, "dec" prefilled
    and then decoding in every step, "a" hitting warm's cached blocks of the 32 tokens they share
    and computing the rest in chunks of 7, 1 and 16 beside decodes, then its last chunk. The
    block size must divide 32. Returns the driver and, for checking, each request with the
    first position whose logits it computed."""
    d = Driver(runner, seed=3)
    bs = runner.block_size
    assert 32 % bs == 0, bs
    shared = random_tokens(32, seed=20)
    warm = d.add("warm", shared + random_tokens(11, seed=21))
    d.step({"warm": 20})
    d.step({"warm": None})
    d.add("dec", random_tokens(9, seed=22))
    d.step({"dec": None, "warm": 1})
    d.add("a", shared + random_tokens(30, seed=23), cached_blocks=warm.blocks[: 32 // bs])
    for n in (7, 1, 16):
        d.step({"dec": 1, "a": n, "warm": 1})
    d.step({"a": None, "dec": 1})
    return d, [("warm", 0), ("dec", 0), ("a", 32)]


class ServedComputeLoop:
    """A ComputeLoop served by a thread of its own (the executor serves it on its main thread)."""

    def __init__(self):
        self.loop = ComputeLoop()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop.serve, args=(self.stop,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()


def prefill(step: int) -> StepPlan:
    """Step `step`: request "a" (10 prompt tokens in blocks 3 and 4) prefilled whole, sampled."""
    return StepPlan(step, new_requests=[NewRequestData("a", list(range(10, 20)), [3, 4], GREEDY)],
                    chunks=[ScheduledChunk("a", 0, 10, 0, True)])


def blind_decode(step: int, position: int) -> StepPlan:
    """A decode of "a" at `position` that follows step - 1 and appends the token sampled there
    (async scheduling: the scheduler has not seen it yet)."""
    return StepPlan(step, follows_step_id=step - 1, running=[RunningRequestDelta("a", [], [], append_sampled=True)],
                    chunks=[ScheduledChunk("a", position, 1, position, True)])


class StepNotRun(Exception):
    """The executor answered a step with StepResult.error."""

    def __init__(self, step_id: int, code: str, message: str):
        super().__init__(f"step {step_id}: {code}: {message}")
        self.step_id, self.code, self.message = step_id, code, message


class StepStreamCall:
    """One StepStream call driven from a test: `send` queues a plan, `result` waits for the next
    answer (StepNotRun for a step answered with an error; a grpc.RpcError once the call ended),
    `step` does both."""

    def __init__(self, stub, epoch: str, token: str, timeout: float = 60):
        self.epoch = epoch
        self._plans: queue.SimpleQueue = queue.SimpleQueue()
        self._responses = stub.StepStream(iter(self._plans.get, None), metadata=bearer_metadata(token),
                                          timeout=timeout)

    def send(self, plan: StepPlan, epoch: str | None = None) -> None:
        self._plans.put(codec.plan_to_proto(plan, epoch if epoch is not None else self.epoch))

    def result(self) -> StepResult:
        msg = next(self._responses)
        if msg.HasField("error"):
            raise StepNotRun(msg.step_id, msg.error.code, msg.error.message)
        return codec.result_from_proto(msg)

    def step(self, plan: StepPlan) -> StepResult:
        self.send(plan)
        return self.result()

    def cancel(self) -> None:
        self._responses.cancel()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._plans.put(None)
        self.cancel()
