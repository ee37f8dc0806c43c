"""Scheduler + gRPC overhead per step: the share of a saturated run in which the executor is idle,
with async scheduling on and off, side by side.

    .venv/bin/python bench/overhead.py [--repeats 3] [--json bench/results/overhead.json]

Each model gets two stacks, `--async-scheduling` and `--no-async-scheduling`, started once; each
round runs every workload on both, in alternating order (one stack runs at a time, the other is
idle), and the paired ratio async/sync of each round's throughput is reported with its spread.

What is measured, from the scheduler's Prometheus endpoint (no instrumentation of our own):
- executor compute: the sum of the executor's reported `execute_seconds`
  (chunkwise:executor_step_duration_seconds_sum);
- a step's round trip on the StepStream call as the scheduler sees it
  (chunkwise:step_duration_seconds_sum): compute plus plan/result (de)serialisation on both sides
  and the loopback transport;
- the scheduler process's CPU time (user + system, from /proc) per step: what the scheduler's
  side of a step costs, whatever else shares the cores; likewise the executor's, and this
  process's own (the load generator: the client side of every stream), and from the three the
  cores they kept busy on average ("cores busy": near the number of cores means the host was
  saturated, and the executor's idle time is then a share of CPU it lost, not a wait on the
  scheduler alone). OMP_NUM_THREADS in the environment reaches the executor (recorded in the JSON);
- the run's wall time, first send to last completion, with every request submitted at once so the
  scheduler always has work (closed loop, all in flight).
idle = wall - compute: scheduling, the RPC's own cost, detokenising and streaming to clients,
and the event loop's turns. idle / wall is the fraction asked for; idle / steps is the cost of a
step. The first and last few steps of a run have less than the full batch, which is real
overhead too. With async scheduling most of that work overlaps the next step, so idle is what is
left of it: the executor waits only when the plan for its next step is not there yet.
Also reported: the cost of encoding and decoding one plan and one result (codec + protobuf, both
sides), measured in-process for the shapes of the workloads.

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
import resource
import shlex
import sys
import tempfile
import time
from pathlib import Path

from benchutil import host_speed_ms, write_json

ROOT = Path(__file__).resolve().parents[1]
# The tiny random checkpoint is made by the tests' own fixture code.
sys.path.insert(0, str(ROOT / "tests"))

from chunkwise_tools import loadtest as lt  # noqa: E402


MODES = {"async": ["--async-scheduling"], "sync": ["--no-async-scheduling"]}
WORKLOADS = {
    "prefill-heavy": dict(num=32, input_len=637, prefix_len=180, groups=8, output_len=64),
    "decode-heavy": dict(num=32, input_len=64, prefix_len=0, groups=1, output_len=128),
}


async def run(ns) -> dict:
    from chunkwise.model_source import resolve_model

    scheduler = ["--max-model-len", "1024", "--max-num-batched-tokens", "1024", "--stream-interval", str(ns.stream_interval)]
    targets = [] if ns.tiny_only else [("SmolLM2-135M", str(resolve_model(ns.model)), ["--dtype", ns.dtype], list(WORKLOADS))]
    if not ns.no_tiny:
        from model_fixtures import make_tiny_checkpoint

        tiny = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="overhead-tiny-")), "llama",
                                    max_position_embeddings=2048)
        targets.append(("tiny-random", str(tiny), ["--dtype", "float32"], ["decode-heavy"]))
    rows = []
    cpus = sorted(os.sched_getaffinity(0))
    if ns.split_cores and len(cpus) < 2:
        raise SystemExit("--split-cores needs at least two CPUs")
    for model_name, model_dir, executor_args, workloads in targets:
        vocab = lt.model_vocab_size(model_dir)
        stacks = {}
        try:
            for mode, flags in MODES.items():
                stacks[mode] = await asyncio.to_thread(
                    lt.ManagedStack, model_dir, lt.ServerConfig(f"CP+PC {mode}", [*scheduler, *flags]), executor_args)
                if ns.split_cores:
                    split_cores(stacks[mode], cpus)
            for rnd in range(ns.repeats):
                for w in workloads:
                    spec = WORKLOADS[w]
                    reqs = lt.random_dataset(spec["num"], input_len=spec["input_len"], output_len=spec["output_len"],
                                             prefix_len=spec["prefix_len"], num_prefix_groups=spec["groups"],
                                             vocab_size=vocab, seed=rnd)
                    order = list(MODES) if rnd % 2 == 0 else list(reversed(MODES))
                    for mode in order:
                        ms = stacks[mode]
                        own0 = resource.getrusage(resource.RUSAGE_SELF)
                        res = await lt.run_load(lt.ChunkwiseBackend(ms.address), reqs, cache_salt=f"ov-{rnd}-{w}",
                                                label=w, warmup=lt.warmup_requests(2, vocab, rnd), probe=ms.step_times,
                                                keep_itl=False, max_duration=600, request_timeout=600)
                        own1 = resource.getrusage(resource.RUSAGE_SELF)
                        ov = res["step_overhead"] or {}
                        row = {"model": model_name, "workload": w, "mode": mode, "round": rnd,
                               "duration_s": res["duration_s"], "failed": res["failed"],
                               "output_throughput": res["output_throughput"],
                               "loadavg_1m": os.getloadavg()[0], "host_speed_ms_after": host_speed_ms(), **ov}
                        if ov.get("steps"):
                            row["rpc_ms_per_step"] = 1000.0 * (ov["step_rpc_seconds"] - ov["executor_seconds"]) / ov["steps"]
                            # CPU time per step of each process on the host: with all three on two
                            # cores their sum says how close to saturated the host is.
                            for who in ("scheduler", "executor"):
                                if ov.get(f"{who}_cpu_seconds") is not None:
                                    row[f"{who}_cpu_ms_per_step"] = 1000.0 * ov[f"{who}_cpu_seconds"] / ov["steps"]
                            # This process is the load generator (the clients of all 32 streams).
                            client_s = (own1.ru_utime + own1.ru_stime) - (own0.ru_utime + own0.ru_stime)
                            row["client_cpu_ms_per_step"] = 1000.0 * client_s / ov["steps"]
                            if ov.get("scheduler_cpu_seconds") is not None and ov.get("executor_cpu_seconds") is not None:
                                row["cores_busy"] = (ov["scheduler_cpu_seconds"] + ov["executor_cpu_seconds"]
                                                     + client_s) / res["duration_s"]
                        rows.append(row)
                        print(f"{model_name:13s} {w:14s} {mode:5s} r{rnd}: {res['duration_s']:6.1f} s, "
                              f"{ov.get('steps', 0):5.0f} steps, executor {ov.get('executor_ms_per_step', 0):7.2f} ms/step, "
                              f"idle {ov.get('idle_ms_per_step', 0):6.2f} ms/step = {ov.get('executor_idle_fraction', 0):6.1%}, "
                              f"exec CPU {ov.get('executor_cpu_utilization', 0):4.0%}", flush=True)
        finally:
            for ms in stacks.values():
                ms.stop()
    summary: dict = {}
    for r in rows:
        entry = summary.setdefault(f"{r['model']}/{r['workload']}", {}).setdefault(r["mode"], {})
        for f in ("executor_idle_fraction", "rpc_fraction", "idle_ms_per_step", "executor_ms_per_step",
                  "rpc_ms_per_step", "scheduler_cpu_ms_per_step", "executor_cpu_ms_per_step", "client_cpu_ms_per_step",
                  "cores_busy", "executor_cpu_utilization", "output_throughput",
                  "duration_s"):
            entry.setdefault(f, []).append(r.get(f))
    summary = {k: {m: {f: lt.spread(v) for f, v in d.items()} for m, d in modes.items()} for k, modes in summary.items()}
    for key in summary:
        model, workload = key.split("/", 1)
        by_round = {(r["round"], r["mode"]): r for r in rows if r["model"] == model and r["workload"] == workload}
        ratios = [by_round[(rnd, "async")]["output_throughput"] / by_round[(rnd, "sync")]["output_throughput"]
                  for rnd in range(ns.repeats) if (rnd, "async") in by_round and (rnd, "sync") in by_round]
        summary[key]["throughput_ratio_async_over_sync"] = lt.spread(ratios)
    return {"schema": "chunkwise.bench.overhead/2", "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "scheduler_args": scheduler,
            "split_cores": ns.split_cores, "dtype": ns.dtype, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "workloads": WORKLOADS, "codec": codec_cost(), "summary": summary, "runs": rows}


def split_cores(ms, cpus: list[int]) -> None:
    """Pin the executor (started with one OpenMP thread) to the first CPU, and the scheduler and
    this load generator to the rest: a GPU executor's compute does not take the host CPU that
    the scheduler and the clients need, which two shared cores cannot otherwise show."""
    for pid, mask in ((ms.stack.executor.popen.pid, {cpus[0]}), (ms.stack.scheduler.popen.pid, set(cpus[1:]))):
        for tid in os.listdir(f"/proc/{pid}/task"):  # every thread: an affinity is per thread
            os.sched_setaffinity(int(tid), mask)
    os.sched_setaffinity(0, set(cpus[1:]))


def codec_cost(repeats: int = 200) -> dict:
    """Microseconds to encode + decode one plan and one result (both sides' codec work and the
    protobuf bytes), for a 32-decode step and for a seed-shaped prefill step."""
    from chunkwise import codec
    from chunkwise.plan import RunningRequestDelta, SampledToken, ScheduledChunk, StepPlan, StepResult
    from chunkwise.v1 import executor_pb2 as pb

    def decode_step(n=32, context=700):
        return StepPlan(7, follows_step_id=6, running=[RunningRequestDelta(f"r{i}", [], [], append_sampled=True)
                                                      for i in range(n)],
                        chunks=[ScheduledChunk(f"r{i}", context, 1, context, True) for i in range(n)])

    def prefill_step():
        plan = decode_step(30)
        plan.running.append(RunningRequestDelta("p", [], list(range(40)), False))
        plan.chunks.append(ScheduledChunk("p", 176, 994, 176, False))
        return plan

    out = {}
    for name, plan in (("decode32", decode_step()), ("mixed", prefill_step())):
        result = StepResult(plan.step_id, [SampledToken(c.req_id, 17, -0.5) for c in plan.chunks if c.sample])
        t0 = time.perf_counter()
        for _ in range(repeats):
            wire = codec.plan_to_proto(plan, "e" * 32).SerializeToString()
            codec.plan_from_proto(pb.StepPlan.FromString(wire))
        t1 = time.perf_counter()
        for _ in range(repeats):
            rwire = codec.result_to_proto(result).SerializeToString()
            codec.result_from_proto(pb.StepResult.FromString(rwire))
        t2 = time.perf_counter()
        out[name] = {"plan_us": 1e6 * (t1 - t0) / repeats, "plan_bytes": len(wire),
                     "result_us": 1e6 * (t2 - t1) / repeats, "result_bytes": len(rwire)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-tiny", action="store_true")
    p.add_argument("--tiny-only", action="store_true", help="only the tiny random model (a quick check)")
    p.add_argument("--stream-interval", type=int, default=1, help="the scheduler's --stream-interval")
    p.add_argument("--split-cores", action="store_true",
                   help="the executor on one CPU with one thread, the scheduler and the load generator on the "
                        "others (a stand-in for a GPU executor, whose compute leaves the host CPUs free)")
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if ns.split_cores:
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by both services; the scheduler runs no torch
    result = asyncio.run(run(ns))
    print()
    print(f"{'model/workload':30s} {'mode':5s} {'idle frac (med, min-max)':>26s} {'idle ms/step':>13s} "
          f"{'rpc ms/step':>12s} {'exec ms/step':>13s} {'sched CPU ms/step':>18s} {'tok/s':>8s}")
    for k, s in result["summary"].items():
        for mode in MODES:
            if mode not in s:
                continue
            m = s[mode]
            f = m["executor_idle_fraction"]
            print(f"{k:30s} {mode:5s} {f['median']:>10.1%} ({f['min']:.1%}-{f['max']:.1%}) "
                  f"{m['idle_ms_per_step']['median']:>13.2f} {m['rpc_ms_per_step']['median']:>12.2f} "
                  f"{m['executor_ms_per_step']['median']:>13.2f} {m['scheduler_cpu_ms_per_step']['median'] or float('nan'):>18.2f} "
                  f"{m['output_throughput']['median']:>8.1f}")
        r = s["throughput_ratio_async_over_sync"]
        print(f"{'':30s} async/sync throughput {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})")
        for mode in (m for m in MODES if m in s):
            cpu = {who: s[mode][f"{who}_cpu_ms_per_step"]["median"] for who in ("executor", "scheduler", "client")}
            if None not in cpu.values():
                print(f"{'':30s} {mode} CPU ms/step: executor {cpu['executor']:.2f}, scheduler {cpu['scheduler']:.2f}, "
                      f"client {cpu['client']:.2f}; cores busy {s[mode]['cores_busy']['median']:.2f} "
                      f"of {len(os.sched_getaffinity(0))}")
    print("codec, us per step (encode + decode):",
          {k: (round(v["plan_us"]), round(v["result_us"])) for k, v in result["codec"].items()})
    write_json(ns.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
