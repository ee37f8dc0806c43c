"""Start-up to ready of two checkouts side by side: the executor, then a scheduler on it.

    git worktree add /tmp/chunkwise-base BASE_COMMIT
    .venv/bin/python bench/startup_ab.py /tmp/chunkwise-base . [--rounds 10] [--json out.json]

Each round starts both services of one checkout, then of the other (the order alternates between
rounds), with this venv's Python run in each checkout's directory (so `python -m executor_svc`
imports that checkout's code), on the embedded model and with the warm caches the machine has
(the kernel packages are already built). Times run from the command to the line a service prints
when it serves; the ratio base / head is paired within a round. For cold starts (the kernels
compiled) see bench/startup.py.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchutil import spread, write_json

from chunkwise.limits import READY_EXECUTOR, READY_SCHEDULER
from chunkwise.model_source import resolve_model

SERVICES = ("executor", "scheduler")


def wait_for(proc: subprocess.Popen, ready: str) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(ready):
            return line.split()[-1]  # the address
    raise RuntimeError(f"{proc.args[2]} exited ({proc.wait()}) before it was ready")


def start_stack(tree: Path, model: str) -> dict[str, float]:
    """Seconds to ready of each service started from `tree`; both stopped again."""
    env = dict(os.environ, CHUNKWISE_EXECUTOR_TOKEN=secrets.token_hex(12))
    common = dict(cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs = []
    try:
        t0 = time.perf_counter()
        procs.append(subprocess.Popen([sys.executable, "-m", "executor_svc", "--model", model, "--host", "127.0.0.1",
                                       "--port", "0"], **common))
        address = wait_for(procs[-1], READY_EXECUTOR)
        t1 = time.perf_counter()
        procs.append(subprocess.Popen([sys.executable, "-m", "scheduler_svc", "--executor", address,
                                       "--host", "127.0.0.1", "--port", "0"], **common))
        wait_for(procs[-1], READY_SCHEDULER)
        return {"executor": t1 - t0, "scheduler": time.perf_counter() - t1}
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            p.wait(30)


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
