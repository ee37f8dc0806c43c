"""--compare: start a chunkwise stack per server config, run the same dataset on each in interleaved rounds, and summarise with paired ratios."""

from __future__ import annotations

import asyncio
import dataclasses
import shlex
from dataclasses import dataclass, field
from typing import Sequence

from chunkwise_tools.loadtest.backends import ChunkwiseBackend
from chunkwise_tools.loadtest.datasets import BenchRequest
from chunkwise_tools.loadtest.metrics import process_cpu_seconds, process_faults_and_system_seconds, spread
from chunkwise_tools.loadtest.prometheus import scrape_prometheus
from chunkwise_tools.loadtest.run import run_load, warmup_requests

COMPARE_SCHEMA = "chunkwise.loadtest.compare/1"


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


class ManagedStack:
    """A chunkwise stack started for one config, with its Prometheus endpoint found in its log."""

    def __init__(self, model: str | None, config: ServerConfig, common_executor_args: Sequence[str] = ()):
        from chunkwise_tools.serve import start_stack

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
        faults_sys = process_faults_and_system_seconds(self.stack.executor.popen.pid) or (None, None)
        return {
            "steps": m.get("chunkwise:step_duration_seconds_count"),
            "step_seconds": m.get("chunkwise:step_duration_seconds_sum"),
            "executor_seconds": m.get("chunkwise:executor_step_duration_seconds_sum"),
            "executor_cpu_seconds": process_cpu_seconds(self.stack.executor.popen.pid),
            "scheduler_cpu_seconds": process_cpu_seconds(self.stack.scheduler.popen.pid),
            "executor_minor_faults": faults_sys[0],
            "executor_system_seconds": faults_sys[1],
        }

    def stop(self) -> None:
        self.stack.stop()


def round_orders(names: Sequence[str], repeats: int, interleave: bool) -> list[list[str]]:
    """The order configs run in, per round: rotated each round when interleaving, so no config
    always runs first (or right after the same neighbour)."""
    names = list(names)
    if not interleave:
        return [[n] for n in names for _ in range(repeats)]
    return [names[r % len(names):] + names[: r % len(names)] for r in range(repeats)]


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

