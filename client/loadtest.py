"""Load-test a serving endpoint: `python -m client.loadtest` (also `chunkwise bench`).

    # 100 prompts of the seed's shape at 2 requests/s (Poisson) against a running scheduler
    python -m client.loadtest --address 127.0.0.1:50051 --num-prompts 100 --request-rate 2

    # closed loop, at most 8 in flight, multi-turn chat prompts, result JSON and plots
    python -m client.loadtest --dataset multi-turn --max-concurrency 8 --result-json out.json --plot-dir plots

    # start each server config in turn on the same dataset and seed, print one table with ratios
    python -m client.loadtest --compare \\
        "neither=--no-enable-chunked-prefill --no-enable-prefix-caching" \\
        "CP+PC=--enable-chunked-prefill --enable-prefix-caching" --repeats 2

Datasets (token ids, so any checkpoint works, tokenizer or not):
- `random`: each prompt is a shared prefix of its group followed by random tokens; the default is
  the seed's shape (637 prompt tokens, ~180 of them a prefix shared within a group, 200 output).
- `multi-turn`: conversations; turn k's prompt is the system prompt and every earlier user and
  assistant message plus a new user message, so it repeats turn k-1's prompt as its prefix.
- `jsonl`: one JSON object a line with `prompt` (text), `prompt_token_ids` or `messages`, and
  optionally `max_tokens` (or `output_len`).

Metrics follow vLLM's benchmark_serving definitions: TTFT is send to first token; TPOT is
(e2e - TTFT) / (output tokens - 1) per request; ITL is every gap between two successive streamed
chunks that carry tokens, pooled over requests; e2e is send to the last chunk. Throughputs divide
by the measured duration (first send to last completion, warm-up excluded). Percentiles
interpolate linearly between order statistics (numpy's default).

Only loopback targets are accepted unless --allow-remote is given; every run is bounded by
--num-prompts and --max-duration and stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import json
import math
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

SCHEMA = "chunkwise.loadtest/1"
COMPARE_SCHEMA = "chunkwise.loadtest.compare/1"
MAX_PROMPTS = 100_000
METRIC_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
STAT_KEYS = ("mean", "median", "p90", "p99", "min", "max", "std")


# ---- datasets ---------------------------------------------------------------------------------


@dataclass
class BenchRequest:
    """One request of a dataset. Exactly one of the three prompt fields is set."""

    max_tokens: int
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    group: int = -1  # prefix group or conversation, -1: none

    @property
    def prompt_len(self) -> int | None:
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else None


def _token_range(vocab_size: int) -> tuple[int, int]:
    """Ids to draw random tokens from: skip the lowest ids, where special tokens usually sit."""
    if vocab_size < 8:
        raise ValueError(f"vocab_size must be at least 8, got {vocab_size}")
    return min(100, vocab_size // 4), vocab_size - 1


def _lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in [mean * (1 - r), mean * (1 + r)], at least 1."""
    if range_ratio <= 0:
        return max(1, mean)
    lo, hi = int(mean * (1 - range_ratio)), int(math.ceil(mean * (1 + range_ratio)))
    return max(1, rng.randint(lo, hi))


def random_dataset(
    num_prompts: int,
    *,
    input_len: int = 637,
    output_len: int = 200,
    prefix_len: int = 180,
    num_prefix_groups: int = 8,
    range_ratio: float = 0.0,
    output_range_ratio: float = 0.0,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts of `input_len` tokens (on average) whose first `prefix_len` are shared in a group.

    Request i belongs to group i % num_prefix_groups, so the groups interleave in arrival order;
    with G groups the first G requests miss and the rest can hit prefix_len tokens (rounded down to
    whole KV blocks by the server): hit rate ~ (1 - G/N) * prefix_len / input_len.
    """
    if prefix_len > input_len:
        raise ValueError(f"prefix_len ({prefix_len}) must not exceed input_len ({input_len})")
    if num_prefix_groups < 1:
        raise ValueError("num_prefix_groups must be >= 1")
    rng = random.Random(seed)
    lo, hi = _token_range(vocab_size)
    prefixes = [[rng.randint(lo, hi) for _ in range(prefix_len)] for _ in range(num_prefix_groups)]
    out = []
    for i in range(num_prompts):
        group = i % num_prefix_groups
        n = max(_lengths(rng, input_len, range_ratio), prefix_len + 1)
        suffix = [rng.randint(lo, hi) for _ in range(n - prefix_len)]
        out.append(BenchRequest(_lengths(rng, output_len, output_range_ratio), prefixes[group] + suffix, group=group))
    return out


def multi_turn_dataset(
    num_conversations: int,
    *,
    turns: int = 4,
    system_len: int = 200,
    user_len: int = 60,
    answer_len: int = 60,
    output_len: int = 60,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[BenchRequest]:
    """Chat-shaped prompts: turn k = system + (user, assistant) * (k - 1) + user.

    The assistant messages are synthetic (random tokens standing for earlier answers), so the
    dataset is fixed before the run. Requests are ordered turn by turn across conversations
    (all first turns, then all second turns, ...); with a request rate or a concurrency cap that
    spaces them, a turn arrives after the previous turn of its conversation was computed, and its
    prompt's prefix is in the cache (sent all at once, most turns race their predecessors).
    """
    rng = random.Random(seed)
    lo, hi = _token_range(vocab_size)

    def tokens(n: int) -> list[int]:
        return [rng.randint(lo, hi) for _ in range(n)]

    conversations = []
    for _ in range(num_conversations):
        history = tokens(system_len)
        prompts = []
        for _ in range(turns):
            history = history + tokens(user_len)
            prompts.append(list(history))
            history = history + tokens(answer_len)
        conversations.append(prompts)
    return [
        BenchRequest(output_len, conversations[c][t], group=c)
        for t in range(turns)
        for c in range(num_conversations)
    ]


def jsonl_dataset(path: str | Path, *, default_output_len: int = 200, limit: int | None = None) -> list[BenchRequest]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            max_tokens = int(obj.get("max_tokens", obj.get("output_len", default_output_len)))
            given = [k for k in ("prompt", "prompt_token_ids", "messages") if k in obj]
            if len(given) != 1:
                raise ValueError(f"{path}:{lineno}: needs exactly one of prompt, prompt_token_ids, messages")
            req = BenchRequest(max_tokens, group=int(obj.get("group", -1)))
            setattr(req, given[0], obj[given[0]])
            out.append(req)
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def dataset_summary(requests: Sequence[BenchRequest]) -> dict:
    lens = [r.prompt_len for r in requests if r.prompt_len is not None]
    return {
        "num_requests": len(requests),
        "mean_prompt_len": sum(lens) / len(lens) if lens else None,
        "mean_max_tokens": sum(r.max_tokens for r in requests) / len(requests) if requests else None,
        "num_groups": len({r.group for r in requests if r.group >= 0}),
    }


# ---- arrivals ---------------------------------------------------------------------------------


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


# ---- metrics ----------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between order statistics."""
    if not values:
        return float("nan")
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict:
    if not values:
        return {k: None for k in STAT_KEYS}
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return {
        "mean": mean,
        "median": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "min": min(values),
        "max": max(values),
        "std": math.sqrt(var),
    }


@dataclass
class RequestRecord:
    """What one request did, in seconds relative to its own send time."""

    index: int
    ok: bool = False
    error: str = ""
    send_time: float = 0.0  # seconds since the run's start
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    e2el: float | None = None
    itl: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft is None or self.e2el is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


class StreamTimer:
    """Collects chunk arrival times of one streamed request."""

    def __init__(self, record: RequestRecord):
        self.record = record
        self.start = time.perf_counter()
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.record.ttft = now - self.start
        else:
            self.record.itl.append(now - self.last)
        self.last = now
        self.record.output_tokens += n

    def done(self) -> None:
        self.record.e2el = time.perf_counter() - self.start


def compute_metrics(records: Sequence[RequestRecord], duration: float) -> dict:
    ok = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    d = max(duration, 1e-9)
    ms = lambda xs: [1000.0 * x for x in xs]  # noqa: E731
    return {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / d,
        "input_throughput": input_tokens / d,
        "output_throughput": output_tokens / d,
        "total_token_throughput": (input_tokens + output_tokens) / d,
        "client_cached_token_fraction": cached / input_tokens if input_tokens else 0.0,
        "ttft_ms": summarize(ms([r.ttft for r in ok if r.ttft is not None])),
        "tpot_ms": summarize(ms([r.tpot for r in ok if r.tpot is not None])),
        "itl_ms": summarize(ms([x for r in ok for x in r.itl])),
        "e2el_ms": summarize(ms([r.e2el for r in ok if r.e2el is not None])),
    }


# Stats fields that only grow (GetStats' counters, and the vLLM Prometheus counters mapped onto
# these names): a run's share is after - before. Every other field is a gauge (num_running,
# kv_blocks_total, block_size, ...) or a label (executor_epoch, dtype): reported as read after.
COUNTER_FIELDS = frozenset({
    "steps", "prefix_cache_queries", "prefix_cache_hits", "resumed_cached_tokens", "prefill_tokens",
    "decode_tokens", "preemptions", "recomputed_tokens", "prefix_holds", "executor_restarts",
    "prompt_tokens", "generation_tokens",
})


def stats_delta(before: dict | None, after: dict | None) -> dict | None:
    """The server's stats for the run: counters as after minus before, gauges as read after."""
    if before is None or after is None:
        return None
    out = {}
    for k, v in after.items():
        if k in COUNTER_FIELDS and isinstance(v, (int, float)) and isinstance(before.get(k), (int, float)):
            out[k] = v - before[k]
        elif k == "requests_finished" and isinstance(v, dict):
            was = before.get(k) or {}
            out[k] = {reason: n - was.get(reason, 0) for reason, n in v.items()}
        else:
            out[k] = v
    queries, hits = out.get("prefix_cache_queries"), out.get("prefix_cache_hits")
    if queries is not None and hits is not None:
        out["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
    return out


# ---- backends ---------------------------------------------------------------------------------


def check_loopback(host: str) -> None:
    if host in ("localhost",):
        return
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"{host!r} is not a loopback address; pass --allow-remote to target it")


class ChunkwiseBackend:
    """chunkwise's public gRPC API through the SDK's AsyncClient."""

    name = "chunkwise"

    def __init__(self, address: str, api_key: str | None = None):
        self.address = address
        self.api_key = api_key
        self._client = None

    async def open(self) -> None:
        from client.sdk import AsyncClient

        self._client = AsyncClient(self.address, api_key=self.api_key)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def stats(self) -> dict | None:
        return await self._client.stats()

    async def send(self, req: BenchRequest, record: RequestRecord, *, cache_salt: str, timeout: float) -> None:
        kwargs = dict(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True, cache_salt=cache_salt,
                      timeout=timeout)
        timer = StreamTimer(record)
        last = None
        async for chunk in self._client.stream(req.prompt, req.prompt_token_ids, req.messages, **kwargs):
            timer.tokens(len(chunk.token_ids))
            last = chunk
        timer.done()
        if last is not None and last.usage is not None:
            record.prompt_tokens = last.usage.prompt_tokens
            record.output_tokens = last.usage.completion_tokens
            record.cached_tokens = last.usage.cached_prompt_tokens
            record.finish_reason = last.finish_reason
        record.ok = record.finish_reason in ("length", "stop")
        if not record.ok:
            record.error = f"finish_reason={record.finish_reason}"


class OpenAIBackend:
    """An OpenAI-compatible /v1/completions server (vLLM's), streamed over plain HTTP/1.1.

    Written on asyncio streams so the load tester needs no HTTP library. Token-id prompts go as
    a list of ids; `ignore_eos` and `cache_salt` are vLLM's extensions.
    """

    name = "openai"

    def __init__(self, base_url: str, model: str):
        from urllib.parse import urlsplit

        u = urlsplit(base_url)
        if u.scheme != "http":
            raise ValueError(f"only http:// base URLs are supported, got {base_url!r}")
        self.host, self.port = u.hostname, u.port or 80
        self.path = u.path.rstrip("/") + "/v1/completions"
        self.model = model

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def stats(self) -> dict | None:
        """vLLM's prefix-cache counters from its /metrics, named like chunkwise's stats."""
        try:
            m = await asyncio.to_thread(scrape_prometheus, f"http://{self.host}:{self.port}/metrics")
        except OSError:
            return None
        out = {}
        for ours, theirs in (("prefix_cache_queries", "vllm:prefix_cache_queries_total"),
                             ("prefix_cache_hits", "vllm:prefix_cache_hits_total"),
                             ("preemptions", "vllm:num_preemptions_total"),
                             ("prompt_tokens", "vllm:prompt_tokens_total"),
                             ("generation_tokens", "vllm:generation_tokens_total")):
            if theirs in m:
                out[ours] = m[theirs]
        return out or None

    async def _post_stream(self, body: dict):
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            data = json.dumps(body).encode()
            head = (
                f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                "Content-Type: application/json\r\nAccept: text/event-stream\r\nConnection: close\r\n"
                f"Content-Length: {len(data)}\r\n\r\n"
            )
            writer.write(head.encode() + data)
            await writer.drain()
            status = (await reader.readline()).decode("latin-1").split()
            headers = {}
            while True:
                line = (await reader.readline()).decode("latin-1").strip()
                if not line:
                    break
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            if len(status) < 2 or status[1] != "200":
                rest = await reader.read(2000)
                raise RuntimeError(f"HTTP {' '.join(status[1:])}: {rest[:500]!r}")
            chunked = headers.get("transfer-encoding", "").lower() == "chunked"
            buf = b""
            async for piece in _http_body(reader, chunked):
                buf += piece
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:"):
                            payload = line[5:].strip()
                            if payload == b"[DONE]":
                                return
                            yield json.loads(payload)
        finally:
            writer.close()

    async def send(self, req: BenchRequest, record: RequestRecord, *, cache_salt: str, timeout: float) -> None:
        if req.messages is not None:
            raise ValueError("the openai backend sends completions; use prompt or prompt_token_ids")
        body = {
            "model": self.model,
            "prompt": req.prompt_token_ids if req.prompt_token_ids is not None else req.prompt,
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if cache_salt:
            body["cache_salt"] = cache_salt
        timer = StreamTimer(record)
        usage = None

        async def consume():
            nonlocal usage
            async for event in self._post_stream(body):
                choices = event.get("choices") or []
                if choices:
                    c = choices[0]
                    n = len(c.get("token_ids") or []) or (1 if c.get("text") else 0)
                    timer.tokens(n)
                    if c.get("finish_reason"):
                        record.finish_reason = c["finish_reason"]
                if event.get("usage"):
                    usage = event["usage"]

        await asyncio.wait_for(consume(), timeout)
        timer.done()
        if usage:
            record.prompt_tokens = usage.get("prompt_tokens", 0)
            record.output_tokens = usage.get("completion_tokens", record.output_tokens)
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens = details.get("cached_tokens") or 0
        record.ok = record.finish_reason in ("length", "stop")
        if not record.ok:
            record.error = f"finish_reason={record.finish_reason}"


async def _http_body(reader: asyncio.StreamReader, chunked: bool):
    if not chunked:
        while True:
            piece = await reader.read(65536)
            if not piece:
                return
            yield piece
    while True:
        size_line = await reader.readline()
        if not size_line:
            return
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        piece = await reader.readexactly(size)
        await reader.readexactly(2)  # CRLF
        yield piece


# ---- the run ----------------------------------------------------------------------------------


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


# ---- server configs for --compare --------------------------------------------------------------


@dataclass
class ServerConfig:
    name: str
    scheduler_args: list[str]
    executor_args: list[str] = field(default_factory=list)


def parse_config(spec: str) -> ServerConfig:
    """'NAME=--flag value --flag' (scheduler flags); executor flags go after ' || '."""
    name, sep, rest = spec.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"config must be NAME=FLAGS, got {spec!r}")
    sched, _, execu = rest.partition("||")
    return ServerConfig(name.strip(), shlex.split(sched), shlex.split(execu))


def scrape_prometheus(url: str, timeout: float = 5.0) -> dict[str, float]:
    """A Prometheus text endpoint's samples (name -> value, label sets summed)."""
    from urllib.request import urlopen

    with urlopen(url, timeout=timeout) as resp:  # noqa: S310 (a loopback URL we built)
        text = resp.read().decode()
    return parse_prometheus(text)


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format -> {metric name: value}, summing a metric's label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "}" in line:
            name, _, rest = line.partition("{")
            value = rest.rpartition("}")[2].split()
        else:
            name, *value = line.split()
        try:
            out[name.strip()] = out.get(name.strip(), 0.0) + float(value[0])
        except (ValueError, IndexError):
            pass
    return out


class ManagedStack:
    """A chunkwise stack started for one config, with its Prometheus endpoint found in its log."""

    def __init__(self, model: str | None, config: ServerConfig, common_executor_args: Sequence[str] = ()):
        from client.serve import start_stack

        self.config = config
        self.stack = start_stack(
            model,
            executor_args=[*common_executor_args, *config.executor_args],
            scheduler_args=["--stats-interval", "0", "--metrics-port", "0", *config.scheduler_args],
            timeout=600,
        )
        self.metrics_url = None
        for line in self.stack.scheduler.log_lines:
            if "chunkwise metrics on " in line:
                self.metrics_url = line.split("chunkwise metrics on ", 1)[1].strip()
        self.address = self.stack.address

    def step_times(self) -> dict | None:
        """Cumulative step wall time (scheduler side) and executor compute time, in seconds."""
        if not self.metrics_url:
            return None
        m = scrape_prometheus(self.metrics_url)
        return {
            "steps": m.get("chunkwise:step_duration_seconds_count"),
            "step_seconds": m.get("chunkwise:step_duration_seconds_sum"),
            "executor_seconds": m.get("chunkwise:executor_step_duration_seconds_sum"),
            "executor_cpu_seconds": process_cpu_seconds(self.stack.executor.popen.pid),
            "scheduler_cpu_seconds": process_cpu_seconds(self.stack.scheduler.popen.pid),
        }

    def stop(self) -> None:
        self.stack.stop()


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (all its threads) from /proc; None where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def step_overhead(before: dict | None, after: dict | None, duration: float) -> dict | None:
    """Where the run's wall time went, from the step-time counters.

    executor_idle_fraction = 1 - executor compute / duration: the share of the run in which the
    executor was not computing (between steps: scheduling, plan/result encoding, gRPC, streaming
    to clients). It is overhead only while requests are queued, so measure it saturated.
    rpc_fraction is the part of the idle time spent inside the ExecuteStep call (transport and
    (de)serialisation on both sides).
    """
    keys = ("steps", "step_seconds", "executor_seconds")
    if not before or not after or any(before.get(k) is None or after.get(k) is None for k in keys):
        return None
    steps = after["steps"] - before["steps"]
    step_s = after["step_seconds"] - before["step_seconds"]
    exec_s = after["executor_seconds"] - before["executor_seconds"]
    d = max(duration, 1e-9)
    out = {
        "steps": steps,
        "executor_seconds": exec_s,
        "step_rpc_seconds": step_s,
        "executor_idle_fraction": 1.0 - exec_s / d,
        "rpc_fraction": (step_s - exec_s) / d,
        "outside_rpc_fraction": (d - step_s) / d,
        "idle_ms_per_step": 1000.0 * (d - exec_s) / steps if steps else None,
        "executor_ms_per_step": 1000.0 * exec_s / steps if steps else None,
    }
    cpu = {}
    for who in ("executor", "scheduler"):
        b, a = before.get(f"{who}_cpu_seconds"), after.get(f"{who}_cpu_seconds")
        if b is not None and a is not None:
            cpu[who] = a - b
            out[f"{who}_cpu_seconds"] = a - b
    if "executor" in cpu:
        # Below ~0.9 on a saturated run, the executor was not getting all cores (other load).
        out["executor_cpu_utilization"] = cpu["executor"] / (d * (os.cpu_count() or 1))
    return out


def round_orders(names: Sequence[str], repeats: int, interleave: bool) -> list[list[str]]:
    """The order configs run in, per round: rotated each round when interleaving, so no config
    always runs first (or right after the same neighbour)."""
    names = list(names)
    if not interleave:
        return [[n] for n in names for _ in range(repeats)]
    return [names[r % len(names):] + names[: r % len(names)] for r in range(repeats)]


def spread(values: Sequence[float]) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "rel_spread": None, "n": 0}
    med = percentile(vals, 50)
    return {
        "median": med, "min": min(vals), "max": max(vals), "n": len(vals),
        "rel_spread": (max(vals) - min(vals)) / med if med else None,
    }


SUMMARY_FIELDS = (
    ("duration_s", lambda r: r["duration_s"]),
    ("total_token_throughput", lambda r: r["total_token_throughput"]),
    ("output_throughput", lambda r: r["output_throughput"]),
    ("request_throughput", lambda r: r["request_throughput"]),
    ("ttft_median_ms", lambda r: r["ttft_ms"]["median"]),
    ("ttft_p99_ms", lambda r: r["ttft_ms"]["p99"]),
    ("tpot_median_ms", lambda r: r["tpot_ms"]["median"]),
    ("itl_p99_ms", lambda r: r["itl_ms"]["p99"]),
    ("e2el_median_ms", lambda r: r["e2el_ms"]["median"]),
    ("prefix_cache_hit_rate", lambda r: (r.get("server_stats") or {}).get("prefix_cache_hit_rate")),
    ("executor_idle_fraction", lambda r: (r.get("step_overhead") or {}).get("executor_idle_fraction")),
)


def summarize_runs(runs: Sequence[dict], names: Sequence[str], baseline: str) -> dict:
    """Per config: each field's median over repeats and its spread; ratios to the baseline's
    medians, and paired ratios (this config / baseline within the same round) with their spread."""
    by_name = {n: [r for r in runs if r["label"] == n] for n in names}
    summary = {}
    for n in names:
        summary[n] = {f: spread([get(r) for r in by_name[n]]) for f, get in SUMMARY_FIELDS}
    base = summary[baseline]
    for n in names:
        for f, get in SUMMARY_FIELDS:
            b = base[f]["median"]
            m = summary[n][f]["median"]
            summary[n][f]["ratio_to_baseline"] = m / b if (m is not None and b) else None
            paired = []
            for r in by_name[n]:
                partner = [x for x in by_name[baseline] if x.get("round") == r.get("round")]
                if partner and get(r) is not None and get(partner[0]):
                    paired.append(get(r) / get(partner[0]))
            summary[n][f]["paired_ratio"] = spread(paired)
    return summary


def format_table(summary: dict, names: Sequence[str], baseline: str) -> str:
    cols = [
        ("config", None), ("elapsed s", "duration_s"), ("tok/s", "total_token_throughput"),
        ("x base", "total_token_throughput"), ("spread", "total_token_throughput"),
        ("TTFT med ms", "ttft_median_ms"), ("TPOT med ms", "tpot_median_ms"), ("ITL p99 ms", "itl_p99_ms"),
        ("hit rate", "prefix_cache_hit_rate"), ("exec idle", "executor_idle_fraction"),
    ]
    rows = [[c for c, _ in cols]]
    for n in names:
        s = summary[n]
        tput = s["total_token_throughput"]
        paired = tput["paired_ratio"]["median"]

        def f(key, fmt="{:.1f}"):
            v = s[key]["median"]
            return "-" if v is None else fmt.format(v)

        rows.append([
            n + (" (base)" if n == baseline else ""),
            f("duration_s"), f("total_token_throughput"),
            "-" if paired is None else f"{paired:.3f}",
            "-" if tput["rel_spread"] is None else f"±{100 * tput['rel_spread'] / 2:.1f}%",
            f("ttft_median_ms", "{:.0f}"), f("tpot_median_ms", "{:.1f}"), f("itl_p99_ms", "{:.0f}"),
            f("prefix_cache_hit_rate", "{:.1%}"), f("executor_idle_fraction", "{:.1%}"),
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


async def run_compare(
    configs: Sequence[ServerConfig],
    requests: Sequence[BenchRequest],
    *,
    model: str | None,
    executor_args: Sequence[str] = (),
    repeats: int = 1,
    interleave: bool = True,
    baseline: str | None = None,
    vocab_size: int = 32000,
    num_warmup: int = 2,
    run_kwargs: dict | None = None,
    log=print,
) -> dict:
    """Start every config's stack once, then run the dataset on each, round after round.

    Stacks stay up between rounds; each run gets its own cache salt, so no run finds the prefix
    cache warmed by an earlier one (the shared-prefix hits all come from inside the run).
    """
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError("config names must be unique")
    baseline = baseline or names[0]
    if baseline not in names:
        raise ValueError(f"baseline {baseline!r} is not one of {names}")
    run_kwargs = dict(run_kwargs or {})
    stacks: dict[str, ManagedStack] = {}
    runs = []
    try:
        for c in configs:
            log(f"starting {c.name}: scheduler {' '.join(c.scheduler_args)} executor {' '.join([*executor_args, *c.executor_args])}")
            stacks[c.name] = await asyncio.to_thread(ManagedStack, model, c, executor_args)
        for rnd, order in enumerate(round_orders(names, repeats, interleave)):
            for name in order:
                ms = stacks[name]
                salt = f"run-{rnd}-{name}"
                result = await run_load(
                    ChunkwiseBackend(ms.address), requests, cache_salt=salt, label=name,
                    warmup=warmup_requests(num_warmup, vocab_size, rnd), probe=ms.step_times, **run_kwargs,
                )
                result["round"] = rnd
                result["server_config"] = dataclasses.asdict(ms.config)
                runs.append(result)
                log(f"round {rnd} {name}: {result['duration_s']:.1f} s, {result['total_token_throughput']:.1f} tok/s, "
                    f"{result['completed']} ok / {result['failed']} failed")
    finally:
        for ms in stacks.values():
            ms.stop()
    summary = summarize_runs(runs, names, baseline)
    return {
        "schema": COMPARE_SCHEMA,
        "baseline": baseline,
        "configs": [dataclasses.asdict(c) for c in configs],
        "executor_args": list(executor_args),
        "repeats": repeats,
        "interleave": interleave,
        "summary": summary,
        "table": format_table(summary, names, baseline),
        "runs": runs,
    }


# ---- plots ------------------------------------------------------------------------------------


def write_plots(result: dict, out_dir: str | Path) -> list[Path]:
    """Latency CDFs per run and, for a comparison, throughput per config. Needs matplotlib;
    returns [] (and says so) without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed here (bench/plot.py draws them from the "
              "JSON with bench/.venv-peers/bin/python)", file=sys.stderr)
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = result["runs"] if result.get("schema") == COMPARE_SCHEMA else [result]
    written = []
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, (key, title) in zip(axes, (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "end-to-end"))):
        for run in runs:
            reqs = [r for r in run["requests"] if r["ok"]]
            if key == "itl":
                vals = sorted(1000 * x for r in reqs for x in r.get("itl", []))
            else:
                vals = sorted(1000 * r[key] for r in reqs if r[key] is not None)
            if vals:
                ys = [(i + 1) / len(vals) for i in range(len(vals))]
                ax.step(vals, ys, where="post", label=f"{run['label'] or run['backend']} r{run.get('round', 0)}")
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = out_dir / "latency_cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    if result.get("schema") == COMPARE_SCHEMA:
        names = [c["name"] for c in result["configs"]]
        s = result["summary"]
        fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 4))
        med = [s[n]["total_token_throughput"]["median"] or 0 for n in names]
        lo = [m - (s[n]["total_token_throughput"]["min"] or m) for n, m in zip(names, med)]
        hi = [(s[n]["total_token_throughput"]["max"] or m) - m for n, m in zip(names, med)]
        ax.bar(names, med, yerr=[lo, hi], capsize=4)
        ax.set_ylabel("total tok/s (median, min-max over repeats)")
        ax.set_title("throughput by config")
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        path = out_dir / "throughput.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# ---- command line -----------------------------------------------------------------------------


def build_dataset(ns, vocab_size: int) -> list[BenchRequest]:
    if ns.dataset == "random":
        return random_dataset(
            ns.num_prompts, input_len=ns.input_len, output_len=ns.output_len, prefix_len=ns.prefix_len,
            num_prefix_groups=ns.num_prefix_groups, range_ratio=ns.range_ratio,
            output_range_ratio=ns.output_range_ratio, vocab_size=vocab_size, seed=ns.seed,
        )
    if ns.dataset == "multi-turn":
        convs = max(1, ns.num_prompts // ns.turns)
        return multi_turn_dataset(
            convs, turns=ns.turns, system_len=ns.prefix_len, user_len=ns.user_len, answer_len=ns.user_len,
            output_len=ns.output_len, vocab_size=vocab_size, seed=ns.seed,
        )
    if not ns.dataset_path:
        raise ValueError("--dataset jsonl needs --dataset-path")
    return jsonl_dataset(ns.dataset_path, default_output_len=ns.output_len, limit=ns.num_prompts)


def model_vocab_size(model: str | None) -> int:
    from chunkwise.model_source import resolve_model

    with open(Path(resolve_model(model)) / "config.json") as f:
        return int(json.load(f)["vocab_size"])


def build_parser(prog: str = "python -m client.loadtest") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("target")
    t.add_argument("--address", default="127.0.0.1:50051", help="chunkwise scheduler HOST:PORT")
    t.add_argument("--api-key", default=None)
    t.add_argument("--backend", choices=("chunkwise", "openai"), default="chunkwise",
                   help="openai: an OpenAI-compatible completions server at --base-url (e.g. vLLM)")
    t.add_argument("--base-url", default="http://127.0.0.1:8000")
    t.add_argument("--served-model-name", default=None, help="the openai backend's model name")
    t.add_argument("--model", default=None,
                   help="checkpoint for --compare's stacks and for the vocabulary size (default: the embedded model)")
    t.add_argument("--vocab-size", type=int, default=None, help="random token ids below this (default: the model's)")
    t.add_argument("--allow-remote", action="store_true", help="allow a non-loopback target")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=("random", "multi-turn", "jsonl"), default="random")
    d.add_argument("--dataset-path", default=None, help="the JSONL file for --dataset jsonl")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--input-len", type=int, default=637, help="random: mean prompt tokens")
    d.add_argument("--prefix-len", type=int, default=180, help="random: shared prefix; multi-turn: system prompt")
    d.add_argument("--num-prefix-groups", type=int, default=8, help="random: distinct shared prefixes")
    d.add_argument("--range-ratio", type=float, default=0.0, help="random: prompt length spread (0: fixed)")
    d.add_argument("--output-len", type=int, default=200, help="max_tokens per request (EOS ignored)")
    d.add_argument("--output-range-ratio", type=float, default=0.0)
    d.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    d.add_argument("--user-len", type=int, default=60, help="multi-turn: tokens per user/assistant message")
    d.add_argument("--seed", type=int, default=0)
    a = p.add_argument_group("arrivals and bounds")
    a.add_argument("--request-rate", type=float, default=math.inf, help="Poisson rate in requests/s (inf: all at once)")
    a.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (closed loop)")
    a.add_argument("--num-warmup", type=int, default=2, help="short unique requests sent first, not measured")
    a.add_argument("--max-duration", type=float, default=600.0, help="send nothing after this many seconds")
    a.add_argument("--request-timeout", type=float, default=600.0)
    a.add_argument("--cache-salt", default="", help="prefix-cache salt for the measured requests")
    c = p.add_argument_group("compare")
    c.add_argument("--compare", nargs="+", metavar="NAME=FLAGS", default=None,
                   help="start each config's stack ('NAME=scheduler flags [|| executor flags]') and run the same dataset")
    c.add_argument("--executor-arg", action="append", default=[], help="executor flag for every --compare stack")
    c.add_argument("--repeats", type=int, default=1)
    c.add_argument("--no-interleave", dest="interleave", action="store_false",
                   help="run each config's repeats back to back instead of round-robin")
    c.add_argument("--baseline", default=None, help="config the ratios divide by (default: the first)")
    o = p.add_argument_group("output")
    o.add_argument("--result-json", default=None)
    o.add_argument("--plot-dir", default=None)
    o.add_argument("--no-itl", action="store_true", help="leave per-token gaps out of the JSON")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    return p


def format_result(r: dict) -> str:
    lines = [
        f"{'backend':<28}{r['backend']} {r['label']}",
        f"{'requests ok / failed':<28}{r['completed']} / {r['failed']}",
        f"{'duration (s)':<28}{r['duration_s']:.2f}",
        f"{'request throughput (req/s)':<28}{r['request_throughput']:.3f}",
        f"{'input tok/s':<28}{r['input_throughput']:.1f}",
        f"{'output tok/s':<28}{r['output_throughput']:.1f}",
        f"{'total tok/s':<28}{r['total_token_throughput']:.1f}",
    ]
    st = r.get("server_stats") or {}
    if "prefix_cache_hit_rate" in st:
        lines.append(f"{'prefix cache hit rate':<28}{st['prefix_cache_hit_rate']:.1%} (server), "
                     f"{r['client_cached_token_fraction']:.1%} of prompt tokens cached (usage)")
    lines.append(f"{'':<14}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for key, title in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("itl_ms", "ITL ms"), ("e2el_ms", "E2E ms")):
        s = r[key]
        cells = "".join("{:>10}".format("-" if s[k] is None else f"{s[k]:.1f}") for k in ("mean", "median", "p90", "p99"))
        lines.append(f"{title:<14}{cells}")
    if r["errors"]:
        lines.append("errors: " + "; ".join(r["errors"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m client.loadtest") -> int:
    ns = build_parser(prog).parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if not 1 <= ns.num_prompts <= MAX_PROMPTS:
            raise ValueError(f"--num-prompts must be in [1, {MAX_PROMPTS}]")
        if ns.max_duration <= 0 or ns.request_timeout <= 0:
            raise ValueError("--max-duration and --request-timeout must be > 0")
        if not ns.allow_remote:
            if ns.backend == "openai":
                from urllib.parse import urlsplit

                check_loopback(urlsplit(ns.base_url).hostname or "")
            else:
                check_loopback(ns.address.rpartition(":")[0])
        vocab = ns.vocab_size or model_vocab_size(ns.model)
        requests = build_dataset(ns, vocab)
    except (ValueError, OSError) as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 2
    run_kwargs = dict(request_rate=ns.request_rate, max_concurrency=ns.max_concurrency, seed=ns.seed,
                      max_duration=ns.max_duration, request_timeout=ns.request_timeout,
                      progress=ns.progress, keep_itl=not ns.no_itl)
    print(f"dataset {ns.dataset}: {json.dumps(dataset_summary(requests))}", flush=True)
    if ns.compare:
        configs = [parse_config(s) for s in ns.compare]
        result = asyncio.run(run_compare(
            configs, requests, model=ns.model, executor_args=ns.executor_arg, repeats=ns.repeats,
            interleave=ns.interleave, baseline=ns.baseline, vocab_size=vocab, num_warmup=ns.num_warmup,
            run_kwargs=run_kwargs,
        ))
        result["dataset"] = {"name": ns.dataset, **dataset_summary(requests)}
        result["command"] = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        print(result["table"])
    else:
        if ns.backend == "openai":
            backend = OpenAIBackend(ns.base_url, ns.served_model_name or str(ns.model or "model"))
        else:
            backend = ChunkwiseBackend(ns.address, ns.api_key)
        result = asyncio.run(run_load(backend, requests, cache_salt=ns.cache_salt,
                                      warmup=warmup_requests(ns.num_warmup, vocab, ns.seed), **run_kwargs))
        result["dataset"] = {"name": ns.dataset, **dataset_summary(requests)}
        print(format_result(result))
    if ns.result_json:
        Path(ns.result_json).parent.mkdir(parents=True, exist_ok=True)
        with open(ns.result_json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {ns.result_json}")
    if ns.plot_dir:
        for path in write_plots(result, ns.plot_dir):
            print(f"wrote {path}")
    failed = result["failed"] if "failed" in result else sum(r["failed"] for r in result["runs"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
