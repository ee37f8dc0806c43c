"""Scheduler + gRPC overhead per step: the share of a saturated run in which the executor is idle.

    .venv/bin/python bench/overhead.py [--repeats 3] [--json bench/results/overhead.json]

What is measured, from the scheduler's Prometheus endpoint (no instrumentation of our own):
- executor compute: the sum of the executor's reported `execute_seconds`
  (chunkwise:executor_step_duration_seconds_sum);
- the ExecuteStep call as the scheduler sees it (chunkwise:step_duration_seconds_sum): compute
  plus plan/result (de)serialisation on both sides and the loopback transport;
- the run's wall time, first send to last completion, with every request submitted at once so the
  scheduler always has work (closed loop, all in flight).
idle = wall - compute: scheduling, the RPC's own cost, detokenising and streaming to clients,
and the event loop's turns. idle / wall is the fraction asked for; idle / steps is the cost of a
step. The first and last few steps of a run have less than the full batch, which is real
overhead too.

Three workloads on the same stack (CP+PC, budget 1024):
- prefill-heavy: the seed's shape (637-token prompts, 64 outputs), steps of ~1000 tokens;
- decode-heavy: 32 requests of 64-token prompts and 128 outputs, so nearly every step is a
  batch of 32 decodes (small steps, where a fixed per-step cost shows most);
- tiny model, decode-heavy: the tiny random checkpoint, whose forward pass is so cheap that the
  idle time is nearly all overhead (the floor of a step's cost in scheduler, gRPC and client).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from benchutil import write_json

ROOT = Path(__file__).resolve().parents[1]
# The tiny random checkpoint is made by the tests' own fixture code.
sys.path.insert(0, str(ROOT / "tests"))

from chunkwise_tools import loadtest as lt  # noqa: E402


WORKLOADS = {
    "prefill-heavy": dict(num=32, input_len=637, prefix_len=180, groups=8, output_len=64),
    "decode-heavy": dict(num=32, input_len=64, prefix_len=0, groups=1, output_len=128),
}


async def run(ns) -> dict:
    from chunkwise.model_source import resolve_model

    scheduler = ["--max-model-len", "1024", "--max-num-batched-tokens", "1024"]
    targets = [("SmolLM2-135M", str(resolve_model(ns.model)), ["--dtype", ns.dtype], list(WORKLOADS))]
    if not ns.no_tiny:
        from model_fixtures import make_tiny_checkpoint

        tiny = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="overhead-tiny-")), "llama",
                                    max_position_embeddings=2048)
        targets.append(("tiny-random", str(tiny), ["--dtype", "float32"], ["decode-heavy"]))
    rows = []
    for model_name, model_dir, executor_args, workloads in targets:
        vocab = lt.model_vocab_size(model_dir)
        ms = await asyncio.to_thread(lt.ManagedStack, model_dir, lt.ServerConfig("CP+PC", scheduler), executor_args)
        try:
            for rnd in range(ns.repeats):
                for w in workloads:
                    spec = WORKLOADS[w]
                    reqs = lt.random_dataset(spec["num"], input_len=spec["input_len"], output_len=spec["output_len"],
                                             prefix_len=spec["prefix_len"], num_prefix_groups=spec["groups"],
                                             vocab_size=vocab, seed=rnd)
                    res = await lt.run_load(lt.ChunkwiseBackend(ms.address), reqs, cache_salt=f"ov-{rnd}-{w}",
                                            label=w, warmup=lt.warmup_requests(2, vocab, rnd), probe=ms.step_times,
                                            keep_itl=False, max_duration=600, request_timeout=600)
                    ov = res["step_overhead"] or {}
                    row = {"model": model_name, "workload": w, "round": rnd, "duration_s": res["duration_s"],
                           "failed": res["failed"], "loadavg_1m": os.getloadavg()[0], **ov}
                    rows.append(row)
                    print(f"{model_name:13s} {w:14s} r{rnd}: {res['duration_s']:6.1f} s, {ov.get('steps', 0):5.0f} steps, "
                          f"executor {ov.get('executor_ms_per_step', 0):7.2f} ms/step, idle "
                          f"{ov.get('idle_ms_per_step', 0):6.2f} ms/step = {ov.get('executor_idle_fraction', 0):6.1%} "
                          f"(in RPC {ov.get('rpc_fraction', 0):5.1%}), exec CPU {ov.get('executor_cpu_utilization', 0):4.0%}",
                          flush=True)
        finally:
            ms.stop()
    summary = {}
    for r in rows:
        key = f"{r['model']}/{r['workload']}"
        summary.setdefault(key, {})
        for f in ("executor_idle_fraction", "rpc_fraction", "idle_ms_per_step", "executor_ms_per_step",
                  "executor_cpu_utilization"):
            summary[key].setdefault(f, []).append(r.get(f))
    summary = {k: {f: lt.spread(v) for f, v in d.items()} for k, d in summary.items()}
    return {"schema": "chunkwise.bench.overhead/1", "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "scheduler_args": scheduler, "dtype": ns.dtype,
            "workloads": WORKLOADS, "summary": summary, "runs": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-tiny", action="store_true")
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = asyncio.run(run(ns))
    print()
    print(f"{'model/workload':32s} {'idle frac (med, min-max)':>28s} {'idle ms/step':>14s} {'exec ms/step':>14s}")
    for k, s in result["summary"].items():
        f, i, e = s["executor_idle_fraction"], s["idle_ms_per_step"], s["executor_ms_per_step"]
        print(f"{k:32s} {f['median']:>10.1%} ({f['min']:.1%}-{f['max']:.1%}) {i['median']:>14.2f} {e['median']:>14.2f}")
    write_json(ns.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
