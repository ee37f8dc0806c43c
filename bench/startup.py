"""Executor start-up time to ready, cold and warm compile cache.

    .venv/bin/python bench/startup.py --rounds 3 --json bench/results/startup.json

Starts `python -m executor_svc` on the embedded model (already converted to a checkpoint) and
times it from the command to a health-checked ready server. "cold": CHUNKWISE_CACHE_DIR (where
the paged decode kernel's package is kept) and TORCHINDUCTOR_CACHE_DIR are a new empty directory,
so the kernel is compiled; "warm": the same directory again, so it is loaded. `--enforce-eager`
(no kernel at all) is timed beside them. Each round runs the three in turn; the table gives the
median and range over rounds.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import tempfile
import time

from benchutil import write_json

from chunkwise.model_source import resolve_model
from chunkwise_tools.serve import start_executor


def time_to_ready(model: str, args: list[str], cache_dir: str) -> float:
    env = dict(os.environ, CHUNKWISE_CACHE_DIR=cache_dir, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    t0 = time.perf_counter()
    proc = start_executor(model, secrets.token_hex(8), args, env=env, timeout=600)
    seconds = time.perf_counter() - t0
    proc.terminate()
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json")
    ns = p.parse_args(argv)
    model = str(resolve_model(None))
    args = ["--dtype", ns.dtype, "--num-kv-blocks", "2048"]
    runs: dict[str, list[float]] = {"cold": [], "warm": [], "enforce-eager": []}
    for r in range(ns.rounds):
        with tempfile.TemporaryDirectory(prefix="chunkwise-cold-") as cache:
            runs["cold"].append(time_to_ready(model, args, cache))
            runs["warm"].append(time_to_ready(model, args, cache))
            runs["enforce-eager"].append(time_to_ready(model, [*args, "--enforce-eager"], cache))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in runs.items()), flush=True)
    summary = {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "n": len(v)}
               for k, v in runs.items()}
    for k, s in summary.items():
        print(f"{k:14s} {s['median_s']:5.1f} s to ready ({s['min_s']:.1f}-{s['max_s']:.1f})")
    write_json(ns.json, {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "runs": runs,
                         "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
