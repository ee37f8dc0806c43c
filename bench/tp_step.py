"""Tensor parallel step time on this machine: TP=2 vs TP=1, side by side, with the all-reduce and
plan-broadcast cost per step.

    .venv/bin/python bench/tp_step.py [--rounds 3] [--json bench/results/tp_step.json]

SmolLM2-135M has 3 KV heads, so it can only be split 1 or 3 ways; this uses a random Llama of
similar width that 2 divides (hidden 512, 8 query / 4 KV heads of 64, MLP 1536, 12 layers, fp32),
made by the tests' fixture code. Two step shapes, each run in interleaved rounds on both runners
(one at a time): a decode step of 32 requests x 512 context, and a 512-token prefill chunk. Per
step: wall time (min and median over repeats), and on TP=2 rank 0's time inside all-reduce (it
includes waiting for rank 1) and inside the plan broadcast. The cores are shared: with TP=2 each
rank gets one of the two, so no speed-up is expected here; the point is the cost of the
collectives.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchutil import write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SHAPE = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
             num_hidden_layers=12, vocab_size=8192, max_position_embeddings=2048)


def plans(block_size: int, context: int, batch: int, prefill: int):
    from chunkwise.plan import GREEDY, NewRequestData, ScheduledChunk, StepPlan

    blocks_per = -(-(context + 1) // block_size)
    setup = StepPlan(1, new_requests=[
        NewRequestData(f"r{i}", [(i * 7 + j) % 8000 + 3 for j in range(context + 1)],
                       list(range(i * blocks_per, (i + 1) * blocks_per)), GREEDY) for i in range(batch)])
    # KV for the context is whatever the cache holds: the cost of the step is what counts.
    decode = [ScheduledChunk(f"r{i}", context, 1, context, True) for i in range(batch)]
    base = batch * blocks_per
    pre = NewRequestData("p", [(j * 13) % 8000 + 3 for j in range(prefill)],
                         list(range(base, base + -(-prefill // block_size))), GREEDY)
    return setup, decode, pre


def measure(runner, block_size, context, batch, prefill, repeats, step0):
    from chunkwise.plan import ScheduledChunk, StepPlan
    from executor_svc.parallel import TIMINGS

    setup, decode, pre = plans(block_size, context, batch, prefill)
    runner.reset()
    # The first chunk's cached prefix is taken on trust: no need to compute the contexts first.
    runner.execute(StepPlan(step0, new_requests=setup.new_requests, chunks=list(decode)))  # warm-up
    out = {}
    step = step0 + 1
    for name in ("decode", "prefill"):
        times, ar, bc = [], [], []
        for _ in range(repeats):
            if name == "decode":
                plan = StepPlan(step, chunks=list(decode))
            else:
                plan = StepPlan(step, finished_req_ids=["p"], new_requests=[pre],
                                chunks=[ScheduledChunk("p", 0, prefill, 0, True)])
            a0, b0 = TIMINGS.all_reduce_seconds, TIMINGS.broadcast_seconds
            t0 = time.perf_counter()
            runner.execute(plan)
            times.append(time.perf_counter() - t0)
            ar.append(TIMINGS.all_reduce_seconds - a0)
            bc.append(TIMINGS.broadcast_seconds - b0)
            step += 1
        out[name] = {"min_ms": 1e3 * min(times), "median_ms": 1e3 * statistics.median(times),
                     "all_reduce_ms": 1e3 * statistics.median(ar), "broadcast_ms": 1e3 * statistics.median(bc)}
    return out, step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)

    import torch

    from executor_svc.config import ExecutorConfig
    from executor_svc.engine import ModelRunner
    from executor_svc.parallel import threads_per_rank
    from model_fixtures import make_tiny_checkpoint

    path = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="tp-bench-")), "llama", **SHAPE)
    block_size = 16
    blocks = ns.batch * (-(-(ns.context + 1) // block_size)) + -(-ns.prefill // block_size) + 8
    runners = {}
    for tp in (1, 2):
        runners[tp] = ModelRunner(ExecutorConfig(model=str(path), dtype="float32", num_kv_blocks=blocks,
                                                 tensor_parallel_size=tp))
        runners[tp].initialize(block_size)
    rows = []
    step = 10
    try:
        for rnd in range(ns.rounds):
            for tp in ((1, 2) if rnd % 2 == 0 else (2, 1)):
                # The TP=2 runner set this process to one share of the cores; TP=1 gets them all.
                torch.set_num_threads(threads_per_rank(tp))
                res, step = measure(runners[tp], block_size, ns.context, ns.batch, ns.prefill, ns.repeats, step)
                rows.append({"round": rnd, "tp": tp, **{f"{k}_{f}": v for k, d in res.items() for f, v in d.items()},
                             "loadavg_1m": os.getloadavg()[0]})
                print(f"round {rnd} TP={tp}: " + ", ".join(
                    f"{k} {d['min_ms']:.1f} ms (all-reduce {d['all_reduce_ms']:.1f}, broadcast {d['broadcast_ms']:.2f})"
                    for k, d in res.items()), flush=True)
    finally:
        runners[2].close()
    summary = {}
    for tp in (1, 2):
        mine = [r for r in rows if r["tp"] == tp]
        summary[f"tp{tp}"] = {k: min(r[k] for r in mine) if k.endswith("min_ms") else statistics.median(r[k] for r in mine)
                              for k in mine[0] if k not in ("round", "tp", "loadavg_1m")}
    for name in ("decode", "prefill"):
        summary[f"{name}_tp2_over_tp1"] = summary["tp2"][f"{name}_min_ms"] / summary["tp1"][f"{name}_min_ms"]
    print(summary)
    write_json(ns.json, {"schema": "chunkwise.bench.tp_step/1", "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                         "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
                         "model_shape": SHAPE, "context": ns.context, "batch": ns.batch, "prefill": ns.prefill,
                         "summary": summary, "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
