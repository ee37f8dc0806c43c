"""Why the seed table comes out flat on this CPU: the cost of attention as the torch backend calls it.

    .venv/bin/python bench/attention_probe.py [--json bench/results/attention_probe.json]

Times torch's scaled_dot_product_attention in the shapes executor_svc/attention/torch_backend.py
gives it for SmolLM2-135M (9 query heads, 3 KV heads, head dim 64), for 30 layers, in float32 and
bfloat16, next to a plain alternative computing the same thing:
- decode: a group of 32 single-query rows over 700 keys each (the seed table's decode steps),
  SDPA with enable_gqa vs a grouped matmul (queries of one KV head batched; softmax in fp32);
- prefill: a 637-token prompt with is_causal vs the same prompt after a 176-token prefix-cache
  hit (461 queries over 637 keys with a boolean mask), i.e. what prefix caching leaves to
  compute, to show whether the masked path keeps the saving.
Also one whole decode step of the executor (ModelRunner, 32 requests x 700 context) with a
torch.profiler breakdown of where it goes. Medians of --repeats runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchutil import write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

H, KVH, D, LAYERS = 9, 3, 64, 30


def median_ms(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return 1000 * statistics.median(out)


def decode_shapes(dtype, groups=32, ctx=700, repeats=5) -> dict:
    q = torch.randn(groups, H, 1, D, dtype=dtype)
    k = torch.randn(groups, KVH, ctx, D, dtype=dtype)
    v = torch.randn(groups, KVH, ctx, D, dtype=dtype)

    def sdpa():
        for _ in range(LAYERS):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def grouped():
        for _ in range(LAYERS):
            qq = q.view(groups, KVH, H // KVH, D)
            s = torch.matmul(qq, k.transpose(-1, -2)).float() * D**-0.5
            torch.matmul(torch.softmax(s, -1).to(dtype), v)

    return {"sdpa_enable_gqa_ms": median_ms(sdpa, repeats), "grouped_matmul_ms": median_ms(grouped, repeats)}


def prefill_shapes(dtype, length=637, cached=176, repeats=5) -> dict:
    q = torch.randn(1, H, length, D, dtype=dtype)
    k = torch.randn(1, KVH, length, D, dtype=dtype)
    v = torch.randn(1, KVH, length, D, dtype=dtype)
    qs = q[:, :, cached:].contiguous()
    mask = torch.arange(length)[None, :] <= torch.arange(cached, length)[:, None]

    def whole():
        for _ in range(LAYERS):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def after_hit():
        for _ in range(LAYERS):
            F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)

    return {"whole_prompt_is_causal_ms": median_ms(whole, repeats),
            "after_prefix_hit_bool_mask_ms": median_ms(after_hit, repeats),
            "queries": [length, length - cached]}


def executor_decode_step(dtype: str, batch=32, ctx=700, repeats=3) -> dict:
    from chunkwise.model_source import resolve_model
    from chunkwise.plan import NewRequestData, RunningRequestDelta, SamplingParams, ScheduledChunk, StepPlan
    from executor_svc.config import ExecutorConfig
    from executor_svc.engine import ModelRunner

    runner = ModelRunner(ExecutorConfig(model=str(resolve_model(None)), dtype=dtype, device="cpu",
                                        attention_backend="torch", kv_cache_space=2.0))
    bs = 16
    runner.initialize(bs)
    per = -(-(ctx + 16) // bs)
    state, step = {}, 0
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        rid = f"r{i}"
        ids = torch.randint(100, 49000, (ctx,), generator=g).tolist()
        res = runner.execute(StepPlan(step_id=step, new_requests=[NewRequestData(rid, ids, list(range(i * per, (i + 1) * per)),
                                                                              SamplingParams(temperature=0.0))],
                                      chunks=[ScheduledChunk(rid, 0, ctx, 0, True)]))
        step += 1
        state[rid] = [ctx, res.sampled[0].token_id]

    def one_step(profile=False):
        nonlocal step
        plan = StepPlan(step_id=step, running=[RunningRequestDelta(r, [t], []) for r, (n, t) in state.items()],
                        chunks=[ScheduledChunk(r, n, 1, n, True) for r, (n, t) in state.items()])
        step += 1
        res = runner.execute(plan)
        for s in res.sampled:
            state[s.req_id][0] += 1
            state[s.req_id][1] = s.token_id

    secs = []
    for _ in range(repeats):
        t = time.perf_counter()
        one_step()
        secs.append(time.perf_counter() - t)
    with torch.profiler.profile() as prof:
        one_step()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) or 1
    return {"step_ms": 1000 * statistics.median(secs),
            "top_ops": [{"op": e.key, "self_ms": e.self_cpu_time_total / 1000, "share": e.self_cpu_time_total / total}
                        for e in ops[:6]]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-executor", action="store_true")
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    out = {"schema": "chunkwise.bench.attention_probe/1", "command": " ".join([sys.executable, *sys.argv]),
           "torch": torch.__version__, "threads": torch.get_num_threads(), "dtypes": {}}
    for name in ("float32", "bfloat16"):
        dt = getattr(torch, name)
        d = {"decode_32x700": decode_shapes(dt, repeats=ns.repeats), "prefill_637": prefill_shapes(dt, repeats=ns.repeats)}
        if not ns.no_executor:
            d["executor_decode_step_32x700"] = executor_decode_step(name)
        out["dtypes"][name] = d
        dec, pre = d["decode_32x700"], d["prefill_637"]
        print(f"{name}: decode attention, 30 layers: SDPA {dec['sdpa_enable_gqa_ms']:.1f} ms vs grouped matmul "
              f"{dec['grouped_matmul_ms']:.1f} ms; prefill attention: whole 637 causal {pre['whole_prompt_is_causal_ms']:.1f} ms"
              f" vs 461 after a 176-token hit {pre['after_prefix_hit_bool_mask_ms']:.1f} ms", flush=True)
        if "executor_decode_step_32x700" in d:
            e = d["executor_decode_step_32x700"]
            tops = ", ".join(f"{o['op']} {o['share']:.0%}" for o in e["top_ops"][:3])
            print(f"  executor decode step (32 x 700): {e['step_ms']:.0f} ms; {tops}", flush=True)
    write_json(ns.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
