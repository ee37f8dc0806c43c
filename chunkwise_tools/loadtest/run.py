"""One load-test run: arrivals, warm-up, bounded sending, and the result record."""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from typing import Sequence

from chunkwise_tools.loadtest.datasets import BenchRequest, _token_range
from chunkwise_tools.loadtest.metrics import RequestRecord, compute_metrics, stats_delta, step_overhead

SCHEMA = "chunkwise.loadtest/1"
MAX_PROMPTS = 100_000


def arrival_offsets(n: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of n requests: a Poisson process of `request_rate`.

    Gaps are exponential with mean 1 / rate; rate inf sends everything at once.
    """
    if request_rate <= 0:
        raise ValueError("request_rate must be > 0 (inf: all at once)")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out



class Progress:
    """A one-line progress bar on stderr (only when it is a terminal, unless forced)."""

    def __init__(self, total: int, label: str = "", enabled: bool | None = None):
        self.total, self.label, self.done, self.failed = total, label, 0, 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.start = time.perf_counter()
        self._last_draw = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.perf_counter()
        if self.enabled and (now - self._last_draw > 0.2 or self.done == self.total):
            self._last_draw = now
            width = 30
            filled = int(width * self.done / max(self.total, 1))
            bar = "#" * filled + "." * (width - filled)
            fail = f" {self.failed} failed" if self.failed else ""
            print(f"\r{self.label}[{bar}] {self.done}/{self.total} {now - self.start:6.1f}s{fail}",
                  end="" if self.done < self.total else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.done < self.total:
            print(file=sys.stderr, flush=True)


def warmup_requests(n: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    """Short unique prompts (no shared prefix) so warm-up never seeds the prefix cache."""
    rng = random.Random(seed ^ 0x5EED)
    lo, hi = _token_range(vocab_size)
    return [BenchRequest(8, [rng.randint(lo, hi) for _ in range(64)]) for _ in range(n)]


async def run_load(
    backend,
    requests: Sequence[BenchRequest],
    *,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    warmup: Sequence[BenchRequest] = (),
    max_duration: float = 600.0,
    request_timeout: float = 600.0,
    cache_salt: str = "",
    progress: bool | None = None,
    label: str = "",
    keep_itl: bool = True,
    probe=None,
) -> dict:
    """Send `requests` at Poisson arrival times, at most `max_concurrency` in flight.

    No request is sent after `max_duration` seconds; requests still running at
    max_duration + request_timeout are cancelled and count as failed. `probe`, a blocking
    callable returning step-time counters (see ManagedStack.step_times), is read after the
    warm-up and after the run, and gives the result its "step_overhead".
    """
    if len(requests) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} requests per run")
    await backend.open()
    try:
        for i, w in enumerate(warmup):
            rec = RequestRecord(-1 - i)
            await backend.send(w, rec, cache_salt=cache_salt + ":warmup", timeout=request_timeout)
            if not rec.ok:
                raise RuntimeError(f"warm-up request failed: {rec.error}")
        stats_before = await backend.stats()
        probe_before = await asyncio.to_thread(probe) if probe else None
        offsets = arrival_offsets(len(requests), request_rate, seed)
        limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = Progress(len(requests), label, progress)
        records = [RequestRecord(i) for i in range(len(requests))]
        start = time.perf_counter()
        deadline = start + max_duration
        finish_times: list[float] = []

        async def one(i: int) -> None:
            rec = records[i]
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is not None:
                await limit.acquire()
            try:
                if time.perf_counter() > deadline:
                    rec.error = "not sent: --max-duration reached"
                    return
                rec.send_time = time.perf_counter() - start
                try:
                    await backend.send(requests[i], rec, cache_salt=cache_salt, timeout=request_timeout)
                except asyncio.CancelledError:
                    rec.ok, rec.error = False, "cancelled at the hard deadline"
                    raise
                except Exception as e:  # a failed request is a result, not a crash of the run
                    rec.ok, rec.error = False, f"{type(e).__name__}: {e}"
                if rec.ok:
                    finish_times.append(time.perf_counter())
            finally:
                if limit is not None:
                    limit.release()
                bar.update(rec.ok)

        tasks = [asyncio.create_task(one(i)) for i in range(len(requests))]
        _, pending = await asyncio.wait(tasks, timeout=max_duration + request_timeout)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        bar.close()
        end = max(finish_times) if finish_times else time.perf_counter()
        duration = end - start
        stats_after = await backend.stats()
        probe_after = await asyncio.to_thread(probe) if probe else None
    finally:
        await backend.close()
    result = {
        "schema": SCHEMA,
        "backend": backend.name,
        "label": label,
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "max_concurrency": max_concurrency,
        "seed": seed,
        "cache_salt": cache_salt,
        "num_warmup": len(warmup),
        **compute_metrics(records, duration),
        "server_stats": stats_delta(stats_before, stats_after),
        "step_overhead": step_overhead(probe_before, probe_after, duration) if probe else None,
        "errors": sorted({r.error for r in records if r.error})[:10],
        "requests": [
            {
                "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                "cached_tokens": r.cached_tokens, "send_time": r.send_time, "ttft": r.ttft,
                "tpot": r.tpot, "e2el": r.e2el, "ok": r.ok,
                **({"itl": r.itl} if keep_itl else {}),
            }
            for r in records
        ],
    }
    return result
