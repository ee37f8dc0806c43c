"""Start-up to ready of two checkouts side by side: the executor, then a scheduler on it.

    git worktree add /tmp/chunkwise-base BASE_COMMIT
    .venv/bin/python bench/startup_ab.py /tmp/chunkwise-base . [--rounds 10] [--json out.json]

Each round starts both services of one checkout, then of the other (the order alternates between
rounds), with this venv's Python run in each checkout's directory (so `python -m executor_svc`
imports that checkout's code; chunkwise_tools/serve.py's launchers), on the embedded model and
with the warm caches the machine has (the kernel packages are already built). Times run from the
command to a health-checked ready server; the ratio base / head is paired within a round. For cold starts (the kernels
compiled) see bench/startup.py.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
from pathlib import Path

from benchutil import spread, write_json

from chunkwise.model_source import resolve_model
from chunkwise_tools.serve import start_executor, start_scheduler

SERVICES = ("executor", "scheduler")


def start_stack(tree: Path, model: str) -> dict[str, float]:
    """Seconds to ready (health-checked) of each service started from `tree`; both stopped again."""
    token, procs = secrets.token_hex(12), []
    try:
        t0 = time.perf_counter()
        procs.append(start_executor(model, token, cwd=tree))
        t1 = time.perf_counter()
        procs.append(start_scheduler(procs[0].address, token, cwd=tree))
        return {"executor": t1 - t0, "scheduler": time.perf_counter() - t1}
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            p.wait_or_kill(30)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", type=Path)
    p.add_argument("head", type=Path)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json")
    ns = p.parse_args(argv)
    model = str(resolve_model(None))
    trees = {"base": ns.base.resolve(), "head": ns.head.resolve()}
    runs = []
    for rnd in range(ns.rounds):
        for name in (trees if rnd % 2 == 0 else list(reversed(trees))):
            seconds = start_stack(trees[name], model)
            runs.append({"round": rnd, "tree": name, **seconds})
            print(f"r{rnd} {name}: executor {seconds['executor']:.2f} s, scheduler {seconds['scheduler']:.2f} s",
                  flush=True)

    def seconds(tree: str, service: str, rnd: int) -> float:
        return next(r[service] for r in runs if r["tree"] == tree and r["round"] == rnd)

    summary = {}
    for service in SERVICES:
        ratios = [seconds("base", service, i) / seconds("head", service, i) for i in range(ns.rounds)]
        summary[service] = {name: spread([r[service] for r in runs if r["tree"] == name]) for name in trees}
        summary[service]["base_over_head"] = spread(ratios)
        print(f"{service}: base median {summary[service]['base']['median']:.2f} s, head "
              f"{summary[service]['head']['median']:.2f} s; base / head paired {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}, n={len(ratios)})")
    write_json(ns.json, {"schema": "chunkwise.bench.startup_ab/1", "trees": {k: str(v) for k, v in trees.items()},
                         "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "summary": summary, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
