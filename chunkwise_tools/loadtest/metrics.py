"""Per-request records and the metrics computed from them (vLLM benchmark_serving definitions), and the server-side counters of a run."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Sequence

METRIC_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
STAT_KEYS = ("mean", "median", "p90", "p99", "min", "max", "std")


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



def spread(values: Sequence[float]) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "rel_spread": None, "n": 0}
    med = percentile(vals, 50)
    return {
        "median": med, "min": min(vals), "max": max(vals), "n": len(vals),
        "rel_spread": (max(vals) - min(vals)) / med if med else None,
    }


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first); None where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (all its threads) from /proc; None where unavailable."""
    fields = _proc_stat(pid)
    if not fields or len(fields) < 13:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_faults_and_system_seconds(pid: int) -> tuple[int, float] | None:
    """Minor page faults (pages the kernel mapped and zeroed) and system CPU time of a process
    from /proc; None where unavailable."""
    fields = _proc_stat(pid)
    if not fields or len(fields) < 13:
        return None
    return int(fields[7]), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def step_overhead(before: dict | None, after: dict | None, duration: float) -> dict | None:
    """Where the run's wall time went, from the step-time counters.

    executor_idle_fraction = 1 - executor compute / duration: the share of the run in which the
    executor was not computing (between steps: scheduling, plan/result encoding, gRPC, streaming
    to clients). It is overhead only while requests are queued, so measure it saturated.
    rpc_fraction is the part of the idle time spent inside the step's round trip on the
    StepStream call (transport and (de)serialisation on both sides).
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
    for key in ("executor_minor_faults", "executor_system_seconds"):
        if before.get(key) is not None and after.get(key) is not None:
            out[key] = after[key] - before[key]
    if "executor" in cpu:
        # Below ~0.9 on a saturated run, the executor was not getting all cores (other load).
        out["executor_cpu_utilization"] = cpu["executor"] / (d * (os.cpu_count() or 1))
    return out
