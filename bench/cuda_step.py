"""Step time of each attention backend on one GPU, side by side: the device check's throughput run.

    .venv/bin/python bench/cuda_step.py [--rounds 3] [--json bench/results/cuda_step.json]
    .venv/bin/python bench/cuda_step.py --device cpu --layers 2 --backends torch flex   # a smoke run

A random Llama of TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 query / 4 KV heads of 64,
MLP 5632, vocab 32000; random weights: only the speed counts), made by the tests' fixture code,
bfloat16, block size 16. Three step shapes from the seed-shaped workload (637-token prompts of
which 176 hit the prefix cache, decodes at ~700 context, batch 32):
- decode: 32 decodes at 700 context;
- mixed: 31 of those decodes plus one 461-token chunk after a 176-token prefix-cache hit;
- prefill: one fresh 1024-token prompt (the token budget's worth).
Every backend that can run here (torch, flashinfer, flex; flash-attn needs block size 256 and is
left out) gets its own runner; each round runs every backend once, in an order rotated round by
round, and reports min and median over repeats. Ratios are paired per round against the torch
backend. The first steps of each runner (compiles, FlashInfer's JIT) are warm-up, not timed.
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

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
             num_hidden_layers=22, vocab_size=32000, max_position_embeddings=2048, initializer_range=0.02)
BLOCK = 16
CONTEXT, BATCH, PREFIX, CHUNK, PREFILL = 700, 32, 176, 461, 1024


def _tokens(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + j * 13) % 31000 + 3 for j in range(n)]


def step_plans(step0: int):
    """The three shapes as StepPlans (KV for cached positions is whatever the cache holds: the
    cost of the step is what is measured). Blocks: each request its own run of block ids."""
    from chunkwise.plan import GREEDY, NewRequestData, ScheduledChunk, StepPlan

    per = -(-(CONTEXT + 1) // BLOCK)
    decodes = [NewRequestData(f"d{i}", _tokens(CONTEXT + 1, i), list(range(i * per, (i + 1) * per)), GREEDY)
               for i in range(BATCH)]
    base = BATCH * per
    chunk_req = NewRequestData("m", _tokens(PREFIX + CHUNK, 99), list(range(base, base + -(-(PREFIX + CHUNK) // BLOCK))),
                               GREEDY)
    base += len(chunk_req.block_ids)
    prefill_req = NewRequestData("p", _tokens(PREFILL, 98), list(range(base, base + -(-PREFILL // BLOCK))), GREEDY)
    num_blocks = base + len(prefill_req.block_ids) + 4
    decode_chunks = [ScheduledChunk(f"d{i}", CONTEXT, 1, CONTEXT, True) for i in range(BATCH)]

    def make(name: str, step: int):
        if name == "decode":
            return StepPlan(step, chunks=list(decode_chunks))
        if name == "mixed":
            return StepPlan(step, finished_req_ids=["m"], new_requests=[chunk_req],
                            chunks=[*decode_chunks[: BATCH - 1], ScheduledChunk("m", PREFIX, CHUNK, PREFIX, True)])
        return StepPlan(step, finished_req_ids=["p"], new_requests=[prefill_req],
                        chunks=[ScheduledChunk("p", 0, PREFILL, 0, True)])

    setup = StepPlan(step0, new_requests=decodes, chunks=list(decode_chunks))
    return setup, make, num_blocks


def measure(runner, repeats: int, step: int, sync) -> tuple[dict, int]:
    _, make, _ = step_plans(step)
    out = {}
    for name in ("decode", "mixed", "prefill"):
        times = []
        for _ in range(repeats):
            plan = make(name, step)
            sync()
            t0 = time.perf_counter()
            runner.execute(plan)
            sync()
            times.append(time.perf_counter() - t0)
            step += 1
        out[name] = {"min_ms": 1e3 * min(times), "median_ms": 1e3 * statistics.median(times)}
    return out, step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--backends", nargs="+", default=["torch", "flashinfer", "flex"],
                   choices=("torch", "flashinfer", "flex"))
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)

    import torch

    from executor_svc.attention import select_backend
    from executor_svc.config import ExecutorConfig
    from executor_svc.engine import ModelRunner
    from model_fixtures import make_tiny_checkpoint

    device = torch.device(ns.device)
    dtype = torch.bfloat16
    shape = dict(SHAPE, num_hidden_layers=ns.layers)
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    backends, skipped = [], {}
    for name in ns.backends:
        try:
            select_backend(name, device, dtype, head_dim, BLOCK)
            backends.append(name)
        except ValueError as e:
            skipped[name] = str(e)
            print(f"skipping {name}: {e}", flush=True)
    if "torch" not in backends:
        backends.insert(0, "torch")  # the baseline every ratio is paired against
    t0 = time.perf_counter()
    path = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="cuda-step-")), "llama", **shape)
    print(f"random checkpoint ({shape}) written in {time.perf_counter() - t0:.0f} s", flush=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    setup, _, num_blocks = step_plans(1)
    runners, step = {}, 1
    for name in backends:
        runner = ModelRunner(ExecutorConfig(model=str(path), device=ns.device, dtype="bfloat16",
                                            num_kv_blocks=num_blocks, attention_backend=name))
        runner.initialize(BLOCK)
        assert runner.info.attention_backend == name, runner.info
        t0 = time.perf_counter()
        runner.execute(setup)  # the 32 decoding requests (their contexts' KV taken on trust)
        _, step = measure(runner, 2, step + 1, sync)  # warm-up: compiles, JIT, autotuning
        print(f"{name}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
        runners[name] = runner
    rows = []
    for rnd in range(ns.rounds):
        order = backends[rnd % len(backends):] + backends[: rnd % len(backends)]
        for name in order:
            res, step = measure(runners[name], ns.repeats, step, sync)
            rows.append({"round": rnd, "backend": name, **{f"{k}_{f}": v for k, d in res.items() for f, v in d.items()}})
            print(f"round {rnd} {name}: " + ", ".join(f"{k} {d['min_ms']:.2f} ms" for k, d in res.items()), flush=True)
    summary: dict = {}
    for name in backends:
        mine = [r for r in rows if r["backend"] == name]
        summary[name] = {k: min(r[k] for r in mine) for k in mine[0] if k.endswith("_min_ms")}
        summary[name]["decode_tok_per_s"] = BATCH / (summary[name]["decode_min_ms"] / 1e3)
        for shape_name in ("decode", "mixed", "prefill"):
            ratios = sorted(r[f"{shape_name}_min_ms"] / t[f"{shape_name}_min_ms"]
                            for r in mine for t in rows if t["backend"] == "torch" and t["round"] == r["round"])
            summary[name][f"{shape_name}_over_torch"] = {"median": statistics.median(ratios),
                                                          "range": [ratios[0], ratios[-1]]}
    print("\n| backend | decode ms | mixed ms | prefill ms | decode tok/s | decode / torch | mixed / torch |")
    print("|---|---|---|---|---|---|---|")
    for name in backends:
        s = summary[name]
        print(f"| {name} | {s['decode_min_ms']:.2f} | {s['mixed_min_ms']:.2f} | {s['prefill_min_ms']:.2f} | "
              f"{s['decode_tok_per_s']:.0f} | {s['decode_over_torch']['median']:.2f} | "
              f"{s['mixed_over_torch']['median']:.2f} |")
    write_json(ns.json, {"schema": "chunkwise.bench.cuda_step/1", "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                         "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
                         "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                         "torch": torch.__version__, "model_shape": shape, "block_size": BLOCK,
                         "skipped": skipped, "summary": summary, "runs": rows,
                         "loadavg_1m": os.getloadavg()[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
