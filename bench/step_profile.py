"""Where the executor's time goes on the seed-shaped workload, in-process (no gRPC, no scheduler
service): the pure Scheduler plans every step, the real ModelRunner executes it.

    .venv/bin/python bench/step_profile.py --json bench/results/step_profile.json
    .venv/bin/python bench/step_profile.py --dtype float32 --profile

Workload: bench/seed_table.py's (32 requests of 637 tokens, 8 groups sharing 180, 64 output
tokens, EOS ignored, all arriving at once; budget 1024, block 16, CP+PC), on the embedded
SmolLM2-135M. Reports the wall time of the whole run and of each kind of step (decode-only,
mixed, prefill-only), the executor's CPU share (process CPU time / wall x threads: below 100%
means a core idled in a serial region), and with --profile a torch.profiler breakdown by
operator family (matmul, attention, elementwise, ...) over the whole run. --compare-packing
runs two runners in interleaved rounds, one with its linear layers on oneDNN's prepacked weights
(the default on CPU) and one on F.linear, and reports the paired ratio; --compare-plain-weights
pits the default (the packed copy alone) against batches of >= 512 rows on a second, plain copy
of the weights (--cpu-plain-weight-min-rows 512); --compare-prefill-pieces likewise pits prefill
attention in pieces of rows (the default on CPU) against one SDPA call per chunk;
--compare-prefill-gemm pits bf16 prefill attention as GEMMs (the default where the CPU
multiplies bf16 natively without AMX) against torch's flash SDPA (the default with AMX);
--compare-prefill-softmax pits that GEMM path's compiled softmax (the default) against the eager
one; --compare-layer-ops pits the compiled element-wise ops between the matmuls (the default:
residual add + RMSNorm, RoPE) against eager ones; --compare-silu-mul pits the bf16 MLPs' silu *
up in the packed matmuls' epilogues (the default) against one gate/up matmul and eager silu * up;
--compare-rows-hint pits the layers packed for packed_linear.layer_rows_hint (the default) against
all packed for 32 rows;
--compare-row-padding pits steps padded to bounded row counts (the default with packed linear
layers) against unpadded ones, whose first round shows oneDNN compiling a kernel per new row
count; --compare-block-order runs the workload under two schedulers that keep their block pools
across rounds (a warm server's state: from the third round on every allocation evicts), one
handing blocks out in ascending order (the default) and one in the order its free lists give
them (bench/block_order.py). Each run reports the page faults and system time it took;
--no-cpu-keep-freed-memory leaves glibc's malloc thresholds at their defaults
(executor_svc/cpu_malloc.py), process-wide, so that A/B alternates processes rather than runners.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import sys
import time
from collections import defaultdict

import torch
from benchutil import name_compiled_kernels_in_profiles, spread, write_json

from chunkwise.model_source import resolve_model
from chunkwise.plan import NewRequestData, RunningRequestDelta, SamplingParams, ScheduledChunk, StepPlan
from chunkwise_tools.loadtest.datasets import random_dataset
from executor_svc.attention.prefill_softmax import PrefillSoftmaxKernel
from executor_svc.attention.torch_backend import PREFILL_GEMM_PIECE_ROWS, PREFILL_PIECE_ROWS
from executor_svc.config import ExecutorConfig, cpu_bf16_flags
from executor_svc.engine import ModelRunner
from executor_svc.models import packed_linear
from executor_svc.models.layer_ops import EAGER
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import Scheduler

# Operator families of the profile, matched on the op name (first match wins).
FAMILIES = (
    # The compiled kernels run from AOTInductor packages, which the profiler does not see:
    # benchutil.name_compiled_kernels_in_profiles() wraps their calls in record_functions.
    ("attention: paged decode kernel", ("paged_decode_kernel",)),
    ("attention: sdpa", ("scaled_dot_product", "_flash_attention")),
    ("attention: prefill GEMMs' softmax", ("prefill_softmax_kernel",)),
    # mkldnn::_linear_pointwise: the linear layers on oneDNN's prepacked weights (packed_linear.py).
    ("matmul", ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::bmm", "mkldnn::_linear")),
    ("kv write / gather", ("index_copy", "index_select", "aten::index")),
    ("norm / rope / silu / elementwise", ("add_rms_norm_kernel", "rotary_kernel",
                                          "aten::mul", "aten::add", "aten::rsqrt", "aten::pow", "aten::mean",
                                          "aten::silu", "aten::neg", "aten::cat", "aten::to", "aten::copy_",
                                          "aten::_to_copy", "aten::sub", "aten::div")),
    ("sampling", ("argmax", "aten::max", "softmax", "log_softmax", "topk", "sort", "multinomial", "gather")),
)


# --compare-NAME: (help, the baseline runner's name, the other one's (the default), the JSON key
# of their paired ratio baseline / other).
COMPARISONS = {
    "packing": ("two runners, linear layers through oneDNN's prepacked weights and through F.linear, in "
                "interleaved rounds, with the paired ratio", "F.linear", "packed", "plain_over_packed"),
    "plain-weights": ("two runners, the default (the packed weights serve every batch) and one with "
                      "--cpu-plain-weight-min-rows 512, in interleaved rounds, with the paired ratio",
                      "packed-only", "plain-for-large", "packed_only_over_plain_for_large"),
    "prefill-pieces": ("two runners, prefill attention in pieces of rows (the default) and one SDPA call per "
                       "chunk, in interleaved rounds, with the paired ratio", "one-call", "pieces",
                       "one_call_over_pieces"),
    "prefill-gemm": ("two runners, bf16 prefill attention as GEMMs in oneDNN's bf16 float32 mode (the default "
                     "on CPUs with AVX512-BF16 and no AMX) and torch's flash SDPA (the default elsewhere), in "
                     "interleaved rounds", "sdpa", "gemm", "sdpa_over_gemm"),
    "prefill-softmax": ("two runners, the bf16 GEMM prefill path with its compiled softmax (the default) and "
                        "with the eager one, in interleaved rounds", "eager", "compiled", "eager_over_compiled"),
    "layer-ops": ("two runners, the element-wise ops between the matmuls compiled (the default, "
                  "models/layer_ops.py) and eager, in interleaved rounds", "eager", "compiled", "eager_over_compiled"),
    "silu-mul": ("two runners, the MLPs' gate/up halves packed apart with silu and the product in the matmuls' "
                 "epilogues (the default with packed linear layers: packed_linear.silu_mul) and one packed gate/up "
                 "matmul with eager silu * up after it, in interleaved rounds", "eager", "fused", "eager_over_fused"),
    "rows-hint": ("two runners, the linear layers packed with packed_linear.layer_rows_hint (the default: 1 row "
                  "for bf16 with AMX, else 32) and all packed for 32 rows, in interleaved rounds",
                  "hint-32", "default-hint", "hint32_over_default"),
    "row-padding": ("two runners, each step padded to a bounded row count (the default on CPU with packed "
                    "linear layers: packed_linear.padded_rows) and not, in interleaved rounds; oneDNN's kernels "
                    "for each row count are per process, so the first round of each shows their compile cost",
                    "unpadded", "padded", "unpadded_over_padded"),
    "block-order": ("one runner, two schedulers each keeping its block pool across rounds (so that from the "
                    "third round on every allocation evicts), one handing blocks out ascending (the default) "
                    "and one in the order its free lists give them, in interleaved rounds", "as-freed",
                    "ascending", "as_freed_over_ascending"),
}


def new_scheduler(runner: ModelRunner, budget: int) -> Scheduler:
    cfg = SchedulerConfig(max_model_len=runner.max_model_len, block_size=16, max_num_batched_tokens=budget,
                          enable_prefix_caching=True, enable_chunked_prefill=True)
    return Scheduler(cfg, runner.num_kv_blocks)


def run(runner: ModelRunner, requests, budget: int, salt: str, profile: bool, sched: Scheduler | None = None) -> dict:
    """One pass of the workload; on a fresh scheduler (an empty block pool) unless one is given."""
    sched = sched if sched is not None else new_scheduler(runner, budget)
    for i, r in enumerate(requests):
        sched.add_request(Request(f"{salt}-r{i}", list(r.prompt_token_ids), SamplingParams(temperature=0.0),
                                  max_tokens=r.max_tokens, ignore_eos=True, cache_salt=salt))
    steps: list[dict] = []
    prof = None
    if profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    t0, u0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    tokens = 0
    while sched.has_work():
        plan = sched.schedule()
        s0 = time.perf_counter()
        result = runner.execute(plan)
        dt = time.perf_counter() - s0
        sched.update(plan, result)
        decodes = sum(1 for c in plan.chunks if c.num_tokens == 1)
        prefill = sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1)
        tokens += sum(c.num_tokens for c in plan.chunks)
        kind = "decode-only" if prefill == 0 else ("prefill-only" if decodes == 0 else "mixed")
        steps.append({"kind": kind, "decodes": decodes, "prefill_tokens": prefill, "ms": 1000 * dt})
    wall, u1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (u1.ru_utime + u1.ru_stime) - (u0.ru_utime + u0.ru_stime)
    out: dict = {"wall_s": wall, "cpu_share": cpu / (wall * torch.get_num_threads()), "steps": len(steps),
                 # Pages the kernel had to map (and zero) during the run, and the kernel's CPU time.
                 "minor_faults": u1.ru_minflt - u0.ru_minflt, "sys_s": round(u1.ru_stime - u0.ru_stime, 2),
                 "tokens": tokens, "tok_per_s": tokens / wall, "hit_rate": sched.stats().prefix_cache_hit_rate}
    by_kind: dict[str, list[float]] = defaultdict(list)
    for s in steps:
        by_kind[s["kind"]].append(s["ms"])
    out["by_kind"] = {k: {"n": len(v), "total_s": sum(v) / 1000, "median_ms": statistics.median(v)}
                      for k, v in by_kind.items()}
    out["step_list"] = steps
    if prof is not None:
        prof.__exit__(None, None, None)
        out.update(summarize(prof))
    return out


def summarize(prof) -> dict:
    """Self CPU time by operator family, and the top operators, of a finished profile."""
    out: dict = {}
    fam: dict[str, float] = defaultdict(float)
    top = []
    for e in prof.key_averages():
        if e.key.startswith("ProfilerStep"):
            continue
        self_ms = e.self_cpu_time_total / 1000
        top.append((self_ms, e.key, e.count))
        for name, keys in FAMILIES:
            if any(k in e.key for k in keys):
                fam[name] += self_ms
                break
        else:
            fam["other"] += self_ms
    total = sum(fam.values())
    out["profile_self_ms"] = {k: round(v, 1) for k, v in sorted(fam.items(), key=lambda kv: -kv[1])}
    out["profile_share"] = {k: round(v / total, 3) for k, v in out["profile_self_ms"].items()}
    out["profile_top"] = [{"op": k, "self_ms": round(ms, 1), "count": n}
                          for ms, k, n in sorted(top, reverse=True)[:25]]
    return out


def decode_steps(runner: ModelRunner, batch: int, ctx: int, steps: int, tag: str, profile: bool = False) -> dict:
    """`batch` requests prefilled to `ctx` tokens, then `steps` decode steps of all of them
    (each request's blocks contiguous; the time is the decode steps' median; the profile, if
    asked for, covers the decode steps only)."""
    per = -(-(ctx + steps + 1) // 16)
    g = torch.Generator().manual_seed(0)
    state: dict[str, list[int]] = {}
    step = 0
    for i in range(batch):
        rid = f"{tag}-{i}"
        ids = torch.randint(10, runner.spec.vocab_size - 1, (ctx,), generator=g).tolist()
        plan = StepPlan(step_id=step, new_requests=[NewRequestData(rid, ids, list(range(i * per, (i + 1) * per)),
                                                                   SamplingParams(temperature=0.0))],
                        chunks=[ScheduledChunk(rid, 0, ctx, 0, True)])
        step += 1
        state[rid] = [ctx, runner.execute(plan).sampled[0].token_id]
    times = []
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    if prof is not None:
        prof.__enter__()
    for _ in range(steps):
        plan = StepPlan(step_id=step, running=[RunningRequestDelta(r, [t], []) for r, (n, t) in state.items()],
                        chunks=[ScheduledChunk(r, n, 1, n, True) for r, (n, t) in state.items()])
        step += 1
        t0 = time.perf_counter()
        for s in runner.execute(plan).sampled:
            state[s.req_id] = [state[s.req_id][0] + 1, s.token_id]
        times.append(time.perf_counter() - t0)
    out = {"wall_s": statistics.median(times), "step_ms": 1000 * statistics.median(times), "batch": batch, "ctx": ctx}
    if prof is not None:
        prof.__exit__(None, None, None)
        out.update(summarize(prof))
    return out


def _wall(runs: list[dict], rnd: int, name: str) -> float:
    return next(r["wall_s"] for r in runs if r["round"] == rnd and r["runner"] == name)


def _kind_s(runs: list[dict], rnd: int, name: str, kind: str) -> float:
    return next(r["by_kind"][kind]["total_s"] for r in runs if r["round"] == rnd and r["runner"] == name)


def paired(result: dict, runs: list[dict], base: str, new: str, key: str, repeats: int, kinds) -> None:
    """base / new wall time per round (above 1: `new` is faster), whole run and by kind of step."""
    ratios = [_wall(runs, i, base) / _wall(runs, i, new) for i in range(repeats)]
    result[f"{key}_wall"] = spread(ratios)
    by_kind = {kind: spread([_kind_s(runs, i, base, kind) / _kind_s(runs, i, new, kind) for i in range(repeats)])
               for kind in kinds}
    result[f"{key}_by_kind"] = by_kind
    print(f"{base} / {new} wall time, paired: median {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f}, n={len(ratios)})"
          + "".join(f"; {k} {v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})" for k, v in by_kind.items()))


def report(label: str, r: dict) -> None:
    print(f"{label}: {r['wall_s']:.2f} s, {r['tok_per_s']:.0f} tok/s (prompt+output computed), "
          f"{r['steps']} steps, cpu share {r['cpu_share']:.0%}, hit rate {r['hit_rate']:.1%}, "
          f"{r['minor_faults']} page faults, {r['sys_s']} s system time", flush=True)
    for k, v in r["by_kind"].items():
        print(f"    {k:13s} {v['n']:3d} steps  {v['total_s']:6.2f} s  median {v['median_ms']:.0f} ms")
    print_profile(r)


def print_profile(r: dict) -> None:
    if "profile_share" in r:
        for k, v in r["profile_self_ms"].items():
            print(f"    {k:40s} {v / 1000:7.2f} s  {r['profile_share'][k]:.1%}")
        for t in r["profile_top"][:12]:
            print(f"        {t['self_ms']:9.1f} ms  x{t['count']:<6d} {t['op']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="rounds")
    p.add_argument("--profile", action="store_true", help="also a torch.profiler breakdown (of the last round)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-cpu-keep-freed-memory", action="store_true",
                   help="glibc's malloc defaults (process-wide, so an A/B alternates processes)")
    for name, (help_text, *_) in COMPARISONS.items():
        p.add_argument(f"--compare-{name}", action="store_true", help=help_text)
    p.add_argument("--decode", nargs=2, type=int, metavar=("BATCH", "CTX"),
                   help="instead of the workload: decode steps of BATCH requests at context CTX (median of 5 a round)")
    p.add_argument("--json")
    ns = p.parse_args(argv)

    model_dir = str(resolve_model(ns.model))
    config = ExecutorConfig(model=model_dir, dtype=ns.dtype, max_model_len=1024, kv_cache_space=1.0,
                            enforce_eager=ns.enforce_eager, cpu_keep_freed_memory=not ns.no_cpu_keep_freed_memory)
    runners = {"default": ModelRunner(config)}
    if ns.compare_packing:  # a second runner whose linear layers stay on F.linear
        runners = {"packed": runners["default"]}
        available, packed_linear.available = packed_linear.available, lambda device: False
        runners["F.linear"] = ModelRunner(config)
        packed_linear.available = available
    if ns.compare_silu_mul:  # a second runner whose MLPs pack gate/up as one weight, silu * up eager
        runners = {"fused": runners["default"]}
        pack_pair, packed_linear.pack_silu_mul = packed_linear.pack_silu_mul, lambda *args, **kwargs: None
        runners["eager"] = ModelRunner(config)
        packed_linear.pack_silu_mul = pack_pair
    if ns.compare_rows_hint:  # a second runner whose layers are all packed for 32 rows
        runners = {"default-hint": runners["default"]}
        layer_hint, packed_linear.layer_rows_hint = packed_linear.layer_rows_hint, lambda *a: packed_linear.ROWS_HINT
        runners["hint-32"] = ModelRunner(config)
        packed_linear.layer_rows_hint = layer_hint
    if ns.compare_prefill_pieces:
        runners = {"pieces": runners["default"], "one-call": ModelRunner(config)}
    if ns.compare_plain_weights:
        runners = {"packed-only": runners["default"],
                   "plain-for-large": ModelRunner(dataclasses.replace(config, cpu_plain_weight_min_rows=512))}
    if ns.compare_prefill_gemm:
        runners = {"gemm": runners["default"], "sdpa": ModelRunner(config)}
    if ns.compare_prefill_softmax:
        runners = {"compiled": runners["default"], "eager": ModelRunner(config)}
    if ns.compare_layer_ops:
        runners = {"compiled": runners["default"], "eager": ModelRunner(config)}
    if ns.compare_row_padding:
        runners = {"padded": runners["default"], "unpadded": ModelRunner(config)}
        if not runners["padded"].pad_rows:
            raise SystemExit("--compare-row-padding: the default runner does not pad (no packed linear layers here)")
        runners["unpadded"].pad_rows = False
    if ns.compare_block_order:  # the same runner under two schedulers; each run has its own cache salt
        runners = {"ascending": runners["default"], "as-freed": runners["default"]}
    for r in {id(r): r for r in runners.values()}.values():
        r.initialize(16)
    if ns.profile:
        name_compiled_kernels_in_profiles()
    if ns.compare_prefill_pieces:
        runners["one-call"].backend.prefill_piece_rows = None
    if ns.compare_prefill_gemm:
        gemm = runners["gemm"]
        if gemm.dtype != torch.bfloat16 or not cpu_bf16_flags():
            raise SystemExit("--compare-prefill-gemm: the GEMM path needs --dtype bfloat16 on a CPU with native bf16")
        if not gemm.backend.prefill_bf16_gemm:  # this CPU's default is flash SDPA (AMX): force the GEMMs
            gemm.backend.prefill_bf16_gemm = True
            gemm.backend.prefill_piece_rows = PREFILL_GEMM_PIECE_ROWS
            gemm.backend.prefill_softmax = PrefillSoftmaxKernel(gemm.device, ns.enforce_eager)
        runners["sdpa"].backend.prefill_bf16_gemm = False
        runners["sdpa"].backend.prefill_piece_rows = PREFILL_PIECE_ROWS
    if ns.compare_prefill_softmax:
        if runners["compiled"].info.prefill_attention != "bf16-gemm":
            raise SystemExit("--compare-prefill-softmax: the default runner's prefill is "
                             f"{runners['compiled'].info.prefill_attention!r}, not 'bf16-gemm' "
                             "(it needs --dtype bfloat16 on a CPU with AVX512-BF16 and no AMX)")
        runners["eager"].backend.prefill_softmax = None
    if ns.compare_layer_ops:
        if runners["compiled"].info.layer_ops != "compiled":
            raise SystemExit("--compare-layer-ops: the default runner's element-wise ops are not compiled here "
                             f"({runners['compiled'].info.layer_ops!r})")
        runners["eager"].model.layer_ops = EAGER
    first = next(iter(runners.values()))
    requests = random_dataset(ns.num_prompts, input_len=637, output_len=ns.output_len, prefix_len=180,
                              num_prefix_groups=8, vocab_size=first.spec.vocab_size, seed=0)
    names = list(runners)
    schedulers: dict[str, Scheduler] = {}
    if ns.compare_block_order:
        schedulers = {name: new_scheduler(first, ns.budget) for name in names}
        schedulers["as-freed"].block_pool.ascending = False
    runs: list[dict] = []
    for i in range(ns.repeats):
        for name in (names if i % 2 == 0 else names[::-1]):  # alternate which goes first
            runner = runners[name]
            runner.reset()  # the previous run's last finished requests (their drop rides on a next plan)
            if ns.decode:
                r = decode_steps(runner, *ns.decode, steps=5, tag=f"r{i}-{name}",
                                 profile=ns.profile and i == ns.repeats - 1)
                print(f"round {i} {name}: decode step {ns.decode[0]} x {ns.decode[1]}: {r['step_ms']:.1f} ms", flush=True)
                print_profile(r)
            else:
                r = run(runner, requests, ns.budget, salt=f"r{i}-{name}", profile=ns.profile and i == ns.repeats - 1,
                        sched=schedulers.get(name))
                report(f"round {i} {name}", r)
            r.update(round=i, runner=name)
            runs.append(r)
    result = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "dtype": str(first.dtype),
              "threads": torch.get_num_threads(), "decode_attention": first.info.decode_attention,
              "prefill_attention": {n: r.backend.prefill_path for n, r in runners.items()},
              "cpu_keep_freed_memory": not ns.no_cpu_keep_freed_memory,
              "plain_weight_layers": {n: [r.model.plain_layers, r.model.plain_bytes >> 20] for n, r in runners.items()},
              "runs": runs}
    for name, (_, base, new, key) in COMPARISONS.items():
        if getattr(ns, f"compare_{name.replace('-', '_')}"):
            paired(result, runs, base, new, key, ns.repeats, kinds=() if ns.decode else ("mixed", "decode-only"))
    write_json(ns.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
