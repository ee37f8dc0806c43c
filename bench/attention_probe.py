"""Attention over the paged KV cache, as the executor runs it, next to vLLM's own CPU kernel.

    .venv/bin/python bench/attention_probe.py --json bench/results/attention_probe.json
    .venv/bin/python bench/attention_probe.py --no-vllm --no-executor --rounds 2     # quick

SmolLM2-135M shapes (9 query heads, 3 KV heads, head dim 64), 30 layers each with its own cache
of 2,000 blocks of 16 tokens (vLLM's: the same slots in blocks of 32, as it serves, VLLM_BS),
block tables scattered over the pool. Cases:
- decode 32 x 700: 32 single-query rows over 700 keys each (the seed table's decode steps);
- decode ragged: 32 rows over 600..800 keys;
- mixed: one 461-query prefill chunk after a 176-token prefix hit (637 keys) plus 31 decodes
  at 700 (a CP+PC step).
Paths timed: chunkwise's TorchAttentionBackend with the compiled paged decode kernel (the
default; for bf16 on a CPU with native bf16 also its prefill as GEMMs, as the executor builds it)
and with the --enforce-eager fallback (gather blocks + folded-query SDPA), and vLLM's
C++ CPU kernel (torch.ops._C.cpu_attention_with_kv_cache, one call per layer, see
bench/vllm_kernel.py), run in bench/.venv-peers as a measuring stick when that venv exists. The
same random K/V, queries and block tables (seeded) go to both. Rounds interleave chunkwise and
vLLM; each number is the minimum over rounds of the median of --repeats timed passes over all
30 layers, with the spread (max/min over rounds) beside it.

Also (unless --no-executor) one whole decode step of the executor on the real model (32 requests
x 700 context, scattered blocks), with a torch.profiler breakdown of where it goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

import torch  # noqa: E402

H, KVH, D, LAYERS, BS, POOL_BLOCKS = 9, 3, 64, 30, 16, 2000
# vLLM's kernel is timed at the block size bench/seed_table.py serves vLLM with: its CPU attention
# takes multiples of 32 only, and picks its ISA by it (vllm_kernel._choose_isa): "amx" for bf16 on
# a CPU with AMX tiles, "vec" otherwise. At block 16 it would run its "vec16" kernel, which vLLM
# does not serve with here: on an AMX Xeon in bf16 chunkwise's decode took 1.31x the time of
# "vec16" and 2.33x that of "amx" (bench/RESULTS.md section 2).
VLLM_BS = 32
PEERS_PYTHON = HERE / ".venv-peers" / "bin" / "python"


def cases() -> dict[str, tuple[list[int], list[int]]]:
    """name -> (query_lens, context_lens)."""
    return {
        "decode_32x700": ([1] * 32, [700] * 32),
        "decode_ragged_600_800": ([1] * 32, [600 + (200 * i) // 31 for i in range(32)]),
        "mixed_461_after_176_plus_31x700": ([461] + [1] * 31, [637] + [700] * 31),
    }


def make_inputs(query_lens: list[int], context_lens: list[int], dtype: torch.dtype, seed: int = 0,
                block_size: int = BS):
    """Per-layer K/V pools [POOL_BLOCKS * BS, KVH, D], queries [T, H, D], block tables scattered
    over the pool's blocks of `block_size` (the same pools and queries for any block size)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(POOL_BLOCKS * BS // block_size, generator=g).tolist()
    tables, i = [], 0
    for ctx in context_lens:
        nb = -(-ctx // block_size)
        tables.append(perm[i : i + nb])
        i += nb
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    k_pools = [torch.randn(POOL_BLOCKS * BS, KVH, D, generator=g).to(dtype) for _ in range(LAYERS)]
    v_pools = [torch.randn(POOL_BLOCKS * BS, KVH, D, generator=g).to(dtype) for _ in range(LAYERS)]
    q = torch.randn(sum(query_lens), H, D, generator=g).to(dtype)
    return k_pools, v_pools, q, block_table


def time_passes(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return 1000 * statistics.median(out)


# ------------------------------------------------------------------------------ chunkwise


def chunkwise_round(dtype_name: str, repeats: int, kernels: dict) -> dict[str, dict[str, float]]:
    from executor_svc.attention import BatchLayout, StepAttention, TorchAttentionBackend
    from executor_svc.attention.paged_decode import PagedDecodeKernel
    from executor_svc.attention.prefill_softmax import PrefillSoftmaxKernel
    from executor_svc.attention.torch_backend import prefill_gemm_pays
    from executor_svc.config import cpu_bf16_flags
    from executor_svc.kv_cache import KVCache, KVCacheShape

    dtype = getattr(torch, dtype_name)
    if dtype not in kernels:
        kernels[dtype] = PagedDecodeKernel(H, KVH, D, dtype, torch.device("cpu"), enforce_eager=False)
        assert kernels[dtype].ready, kernels[dtype].reason
    # The default column as the executor builds it (executor_svc/engine.py): bf16 prefill as
    # GEMMs where the CPU has AVX512-BF16 and no AMX, with the compiled softmax between them;
    # the eager column keeps SDPA.
    bf16_gemm = dtype == torch.bfloat16 and prefill_gemm_pays(cpu_bf16_flags())
    softmax = None
    if bf16_gemm:
        if "prefill_softmax" not in kernels:
            kernels["prefill_softmax"] = PrefillSoftmaxKernel(torch.device("cpu"), enforce_eager=False)
            assert kernels["prefill_softmax"].ready, kernels["prefill_softmax"].reason
        softmax = kernels["prefill_softmax"]
    backends = {"paged-inductor": TorchAttentionBackend(H, KVH, D, decode_kernel=kernels[dtype],
                                                        prefill_bf16_gemm=bf16_gemm, prefill_softmax=softmax),
                "sdpa-folded": TorchAttentionBackend(H, KVH, D)}
    out: dict[str, dict[str, float]] = {}
    for name, (qlens, ctxs) in cases().items():
        k_pools, v_pools, q, table = make_inputs(qlens, ctxs, dtype)
        cache = KVCache(KVCacheShape(LAYERS, KVH, D, dtype), POOL_BLOCKS, BS, torch.device("cpu"))
        for layer in range(LAYERS):
            k_flat, v_flat = cache.flat(layer)
            k_flat.copy_(k_pools[layer])
            v_flat.copy_(v_pools[layer])
        del k_pools, v_pools
        starts = [0]
        for n in qlens:
            starts.append(starts[-1] + n)
        layout = BatchLayout(
            num_tokens=starts[-1], block_size=BS, query_start=starts,
            num_computed=[c - n for c, n in zip(ctxs, qlens)], context_lens=ctxs,
            num_blocks=[-(-c // BS) for c in ctxs], block_table=table,
            slot_mapping=torch.empty(0, dtype=torch.int64), write_rows=torch.empty(0, dtype=torch.int64))
        empty = q.new_empty(0, KVH, D)  # K/V were written above: time the attention alone
        out[name] = {}
        with torch.inference_mode():
            for path, backend in backends.items():
                def run(backend=backend):
                    step = StepAttention(backend, cache, layout)  # prepare: once per step, as in the executor
                    for layer in range(LAYERS):
                        step(layer, q, empty, empty)
                out[name][path] = time_passes(run, repeats)
    return out


# ------------------------------------------------------------------------------ vLLM (peers venv)


def vllm_worker(dtype_name: str, repeats: int) -> int:
    """Run in bench/.venv-peers: time vLLM's kernel on the same inputs; print one JSON line."""
    sys.path.insert(0, str(HERE))
    import vllm_kernel

    why = vllm_kernel.available()
    if why is not None:
        print(json.dumps({"error": why}))
        return 0
    dtype = getattr(torch, dtype_name)
    result = {}
    for name, (qlens, ctxs) in cases().items():
        k_pools, v_pools, q, table = make_inputs(qlens, ctxs, dtype, block_size=VLLM_BS)
        atts = []
        slots = torch.arange(POOL_BLOCKS * BS)
        for layer in range(LAYERS):
            att = vllm_kernel.VllmPagedAttention(H, KVH, D, VLLM_BS, POOL_BLOCKS * BS // VLLM_BS, dtype)
            att.write(k_pools[layer], v_pools[layer], slots)
            atts.append(att)
        del k_pools, v_pools
        buf = torch.empty_like(q)

        for att in atts[1:]:
            att.prepare(qlens, ctxs, table)

        def run():
            atts[0].prepare(qlens, ctxs, table)  # vLLM builds its metadata once per step, then
            for att in atts:  # one kernel call per layer
                att.forward(q, out=buf)
        result[name] = time_passes(run, repeats)
    result["isa"] = vllm_kernel._choose_isa(dtype, VLLM_BS, D)
    result["block_size"] = VLLM_BS
    print(json.dumps(result))
    return 0


def vllm_round(dtype_name: str, repeats: int) -> dict | None:
    if not PEERS_PYTHON.exists():
        return None
    proc = subprocess.run([str(PEERS_PYTHON), __file__, "--vllm-worker", dtype_name, "--repeats", str(repeats)],
                          capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"worker exit {proc.returncode}: {proc.stderr[-400:]}"}
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------ executor step


def executor_decode_step(dtype: str, batch=32, ctx=700, repeats=5) -> dict:
    from chunkwise.model_source import resolve_model
    from chunkwise.plan import NewRequestData, RunningRequestDelta, SamplingParams, ScheduledChunk, StepPlan
    from executor_svc.config import ExecutorConfig
    from executor_svc.engine import ModelRunner

    runner = ModelRunner(ExecutorConfig(model=str(resolve_model(None)), dtype=dtype, device="cpu",
                                        attention_backend="torch", kv_cache_space=2.0))
    bs = 16
    runner.initialize(bs)
    per = -(-(ctx + 64) // bs)
    perm = torch.randperm(runner.num_kv_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    state, step = {}, 0
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        rid = f"r{i}"
        ids = torch.randint(100, 49000, (ctx,), generator=g).tolist()
        plan = StepPlan(step_id=step, new_requests=[NewRequestData(rid, ids, perm[i * per : (i + 1) * per],
                                                                   SamplingParams(temperature=0.0))],
                        chunks=[ScheduledChunk(rid, 0, ctx, 0, True)])
        step += 1
        state[rid] = [ctx, runner.execute(plan).sampled[0].token_id]

    def one_step():
        nonlocal step
        plan = StepPlan(step_id=step, running=[RunningRequestDelta(r, [t], []) for r, (n, t) in state.items()],
                        chunks=[ScheduledChunk(r, n, 1, n, True) for r, (n, t) in state.items()])
        step += 1
        for s in runner.execute(plan).sampled:
            state[s.req_id][0] += 1
            state[s.req_id][1] = s.token_id

    step_ms = time_passes(one_step, repeats)
    from benchutil import name_compiled_kernels_in_profiles

    name_compiled_kernels_in_profiles()  # else the kernel's time is missing from the profile
    with torch.profiler.profile() as prof:
        one_step()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) or 1
    return {"step_ms": step_ms, "decode_attention": runner.info.decode_attention,
            "top_ops": [{"op": e.key[:60], "self_ms": e.self_cpu_time_total / 1000,
                         "share": e.self_cpu_time_total / total} for e in ops[:8]]}


# ------------------------------------------------------------------------------ main


def summarize(rounds: list[dict]) -> dict:
    """rounds: [{case: {path: ms}}] -> {case: {path: {"min_ms", "spread"}}} (spread = max/min)."""
    out: dict = {}
    for case in rounds[0]:
        out[case] = {}
        for path in rounds[0][case]:
            values = [r[case][path] for r in rounds if path in r.get(case, {})]
            out[case][path] = {"min_ms": min(values), "spread": max(values) / min(values), "rounds": values}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--no-executor", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--vllm-worker", metavar="DTYPE", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.vllm_worker:
        return vllm_worker(ns.vllm_worker, ns.repeats)

    from benchutil import write_json

    out = {"schema": "chunkwise.bench.attention_probe/2", "command": " ".join([sys.executable, *sys.argv]),
           "torch": torch.__version__, "threads": torch.get_num_threads(), "dtypes": {}}
    kernels: dict = {}
    for name in ns.dtypes:
        rounds = []
        for _ in range(ns.rounds):
            r = chunkwise_round(name, ns.repeats, kernels)
            if not ns.no_vllm:
                v = vllm_round(name, ns.repeats)
                if v and "error" not in v:
                    for case in r:
                        r[case]["vllm-cpu-kernel"] = v[case]
                    out.setdefault("vllm_isa", v["isa"])
                    out.setdefault("vllm_block_size", v["block_size"])
                elif v:
                    out["vllm_error"] = v["error"]
            rounds.append(r)
        table = summarize(rounds)
        d = {"cases": table}
        print(f"{name}: attention over the paged cache, {LAYERS} layers, ms (min over {ns.rounds} rounds; spread)")
        for case, paths in table.items():
            ref = paths.get("vllm-cpu-kernel", {}).get("min_ms")
            cells = []
            for path, s in paths.items():
                ratio = f", {s['min_ms'] / ref:.2f}x vLLM" if ref and path != "vllm-cpu-kernel" else ""
                cells.append(f"{path} {s['min_ms']:.1f} (x{s['spread']:.2f}{ratio})")
            print(f"  {case}: " + "; ".join(cells), flush=True)
        if not ns.no_executor:
            d["executor_decode_step_32x700"] = e = executor_decode_step(name)
            tops = ", ".join(f"{o['op']} {o['share']:.0%}" for o in e["top_ops"][:4])
            print(f"  executor decode step (32 x 700, {e['decode_attention']}): {e['step_ms']:.0f} ms; {tops}",
                  flush=True)
        out["dtypes"][name] = d
    write_json(ns.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
