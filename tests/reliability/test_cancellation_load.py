"""200 concurrent streams, half of them cancelled at random points, on a KV pool far too small
for all of them (so requests wait, get preempted and hit the prefix cache while others vanish).

Afterwards every block is free or evictable (free + cached covers the pool, none used), every
request that ran to the end equals transformers' greedy output, and every cancelled one received
a prefix of it. Cancellation comes in four kinds: breaking out of the stream (the SDK cancels the
call), cancelling the asyncio task, an Abort RPC by request id, and a client deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field

import grpc

from client import AsyncClient, ChunkwiseError
from reliability_helpers import assert_no_leak, wait_idle

NUM_STREAMS = 200
NUM_PROMPTS = 20
KINDS = ("break", "task-cancel", "abort", "deadline")


@dataclass
class Job:
    index: int
    prompt: list[int]
    max_tokens: int
    cancel: str | None  # one of KINDS, or None to run to the end
    cancel_after: int  # chunks received before cancelling (0: before the first)
    got: list[int] = field(default_factory=list)
    finish: str | None = None
    error: ChunkwiseError | None = None


def make_jobs(seed: int) -> list[Job]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 384) for _ in range(32)] for _ in range(2)]
    distinct = []
    for i in range(NUM_PROMPTS):
        suffix = [rng.randrange(3, 384) for _ in range(rng.randrange(5, 40))]
        distinct.append((prefixes[i % 2] + suffix, rng.randrange(8, 41)))
    cancelled = set(rng.sample(range(NUM_STREAMS), NUM_STREAMS // 2))
    jobs = []
    for i in range(NUM_STREAMS):
        prompt, max_tokens = distinct[rng.randrange(NUM_PROMPTS)]
        kind = rng.choice(KINDS) if i in cancelled else None
        jobs.append(Job(i, prompt, max_tokens, kind, rng.randrange(0, max_tokens)))
    return jobs


async def run_job(client: AsyncClient, job: Job) -> None:
    kw = dict(prompt_token_ids=job.prompt, max_tokens=job.max_tokens, temperature=0)
    if job.cancel == "deadline":
        kw["timeout"] = 0.05 + 0.01 * job.cancel_after  # may or may not pass before the end
    if job.cancel == "abort":
        kw["request_id"] = f"load-{job.index}"
    try:
        async with contextlib.aclosing(client.stream(**kw)) as stream:
            chunks = 0
            async for chunk in stream:
                job.got += chunk.token_ids
                job.finish = chunk.finish_reason or job.finish
                chunks += 1
                if chunks == job.cancel_after or (job.cancel_after == 0 and chunks == 1):
                    if job.cancel == "break":
                        break
                    if job.cancel == "abort":
                        await client.abort(kw["request_id"])  # the stream then ends with 'abort'
    except ChunkwiseError as e:
        job.error = e


async def run_all(address: str, jobs: list[Job]) -> None:
    async with AsyncClient(address, timeout=120) as client:
        tasks = [asyncio.create_task(run_job(client, job)) for job in jobs]
        for job, task in zip(jobs, tasks):
            if job.cancel == "task-cancel" and job.cancel_after == 0:
                task.cancel()  # before it ever got a response
        # The other task cancellations happen once some output has flowed.
        await asyncio.sleep(0)
        pending = {t for j, t in zip(jobs, tasks) if j.cancel == "task-cancel" and j.cancel_after > 0}
        while pending:
            for job, task in zip(jobs, tasks):
                if task in pending and len(job.got) >= job.cancel_after:
                    task.cancel()
                    pending.discard(task)
            pending = {t for t in pending if not t.done()}
            await asyncio.sleep(0.005)
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=150)


def test_200_streams_half_cancelled(shared, reference):
    jobs = make_jobs(seed=2024)
    with shared.client(timeout=60) as c:
        before = wait_idle(c)
        asyncio.run(run_all(shared.address, jobs))
        after = wait_idle(c, timeout=60)
    assert_no_leak(after)  # free (empty + cached, i.e. evictable) == total, used == 0

    survivors = [j for j in jobs if j.cancel is None]
    for job in survivors:
        assert job.error is None, f"job {job.index}: {job.error}"
        assert job.finish in ("length", "stop"), (job.index, job.finish)
        reference.check(job.prompt, job.max_tokens, job.got)
    for job in jobs:
        if job.cancel is not None:
            want = reference.greedy(job.prompt, job.max_tokens)
            assert job.got == want[: len(job.got)], f"cancelled job {job.index} got wrong tokens"
            if job.error is not None:  # only a deadline may surface as an error
                assert job.cancel == "deadline" and job.error.code == grpc.StatusCode.DEADLINE_EXCEEDED, job.error
            if job.cancel == "abort" and job.finish is not None:
                assert job.finish in ("abort", "length", "stop")
    finished = sum(after["requests_finished"].values()) - sum(before["requests_finished"].values())
    aborted = after["requests_finished"]["abort"] - before["requests_finished"]["abort"]
    assert len(survivors) <= finished <= NUM_STREAMS
    assert aborted <= NUM_STREAMS - len(survivors)
    assert after["preemptions"] > before["preemptions"] or after["prefix_cache_hits"] > before["prefix_cache_hits"]

