"""Does the order of a request's blocks in its block table matter to decode attention? The block
tables a warm server really hands out, with the pool's blocks in ascending order (the default)
and in the order its free lists give them (the baseline), through the real decode kernel.

    .venv/bin/python bench/block_order.py --json bench/results/block_order.json

Tables: bench/seed_table.py's workload (32 requests of 637 tokens, 8 groups sharing 180, 64
output tokens, budget 1024, block 16, CP+PC) run RUNS times back to back through the pure
Scheduler on one pool of --num-blocks (2,912: what `--kv-gib 1` gives SmolLM2 in bf16, and
`--kv-gib 2` in fp32), each run with its own cache salt, with a stand-in executor that samples
token 5 (no model: the tables do not depend on the tokens). From the second or third run on the
pool is full of cached blocks and every allocation evicts. Taken at each run's first decode step
with all 32 requests: the tables and context lengths, and how many consecutive table entries are
the next block (ascending), the previous block (descending) or elsewhere (a jump).

Timing: the paged decode kernel (SmolLM2-135M's geometry, --dtype) over 30 layers, each with its
own K/V cache of the pool's size, on each run's tables in both orders; interleaved rounds, the
ratio baseline / ascending paired within a round. The kernel is 61-78% of a decode step of 32 x
700 on the Zen 5 (bench/RESULTS.md section 2).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from benchutil import spread, write_json

from chunkwise.plan import SampledToken, SamplingParams, StepResult
from chunkwise_tools.loadtest.datasets import random_dataset
from executor_svc.attention.paged_decode import PagedDecodeKernel, decode_slots
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import Scheduler

BLOCK_SIZE, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 16, 30, 9, 3, 64, 49152


def order_stats(tables: list[list[int]]) -> dict[str, float]:
    """Fractions of consecutive table entries that are the next block, the previous one, or elsewhere."""
    asc = desc = jump = 0
    for t in tables:
        for a, b in zip(t, t[1:]):
            if b == a + 1:
                asc += 1
            elif b == a - 1:
                desc += 1
            else:
                jump += 1
    n = max(1, asc + desc + jump)
    return {"ascending": asc / n, "descending": desc / n, "jump": jump / n}


def decode_tables(num_blocks: int, runs: int, ascending: bool) -> list[tuple[list[list[int]], list[int]]]:
    """(block tables, context lengths) at the first full decode step of each run."""
    cfg = SchedulerConfig(max_model_len=1024, block_size=BLOCK_SIZE, max_num_batched_tokens=1024,
                          enable_prefix_caching=True, enable_chunked_prefill=True)
    sched = Scheduler(cfg, num_blocks)
    sched.block_pool.ascending = ascending
    prompts = random_dataset(32, input_len=637, output_len=64, prefix_len=180, num_prefix_groups=8,
                             vocab_size=VOCAB, seed=0)
    out = []
    for run in range(runs):
        ids = [f"r{run}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            sched.add_request(Request(rid, list(p.prompt_token_ids), SamplingParams(temperature=0.0),
                                      max_tokens=p.max_tokens, ignore_eos=True, cache_salt=f"r{run}"))
        taken = None
        while sched.has_work():
            plan = sched.schedule()
            if taken is None and len(plan.chunks) == len(ids) and all(c.num_tokens == 1 for c in plan.chunks):
                reqs = [sched.get_request(c.req_id) for c in plan.chunks]
                taken = ([list(r.block_ids) for r in reqs], [c.num_computed_tokens + 1 for c in plan.chunks])
            sched.update(plan, StepResult(plan.step_id, [SampledToken(c.req_id, 5) for c in plan.chunks if c.sample]))
        assert taken is not None, "no decode step with every request"
        out.append(taken)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-blocks", type=int, default=2912)
    p.add_argument("--runs", type=int, default=6, help="seed-shaped runs back to back on one pool")
    p.add_argument("--rounds", type=int, default=8, help="timing rounds per run's tables")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--json")
    ns = p.parse_args(argv)
    dtype = getattr(torch, ns.dtype)
    orders = {"ascending": decode_tables(ns.num_blocks, ns.runs, True),
              "as-freed": decode_tables(ns.num_blocks, ns.runs, False)}
    kernel = PagedDecodeKernel(HEADS, KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"), enforce_eager=False)
    if not kernel.ready:
        raise SystemExit(kernel.reason)
    gen = torch.Generator().manual_seed(0)
    slots_n = ns.num_blocks * BLOCK_SIZE
    caches = [(torch.randn(slots_n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
               torch.randn(slots_n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)) for _ in range(LAYERS)]
    q = torch.randn(32, HEADS, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM**-0.5
    result: dict = {"command": "bench/block_order.py " + " ".join(sys.argv[1:] if argv is None else argv),
                    "num_blocks": ns.num_blocks, "dtype": ns.dtype, "threads": torch.get_num_threads(), "runs": []}
    with torch.inference_mode():
        for run in range(ns.runs):
            inputs = {}
            for name, tables in orders.items():
                block_tables, lens = tables[run]
                width = max(len(t) for t in block_tables)
                table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables])
                inputs[name] = decode_slots(table, lens, BLOCK_SIZE)
            ms: dict[str, list[float]] = {name: [] for name in orders}
            for r in range(ns.rounds + 1):
                for name in (list(orders) if r % 2 == 0 else list(orders)[::-1]):
                    slots, lens_t = inputs[name]
                    t0 = time.perf_counter()
                    for k, v in caches:
                        kernel(q, k, v, slots, lens_t, scale)
                    if r:  # round 0 warms up
                        ms[name].append(1000 * (time.perf_counter() - t0))
            ratios = [b / a for a, b in zip(ms["ascending"], ms["as-freed"])]
            entry = {"run": run, "order": {name: order_stats(orders[name][run][0]) for name in orders},
                     "median_ms": {k: statistics.median(v) for k, v in ms.items()}, "ms": ms,
                     "as_freed_over_ascending": spread(ratios)}
            result["runs"].append(entry)
            o, pr = entry["order"], entry["as_freed_over_ascending"]
            print(f"run {run}: ascending tables {o['ascending']['ascending']:.0%} next-block / "
                  f"{o['ascending']['descending']:.0%} previous / {o['ascending']['jump']:.0%} jumps, "
                  f"as-freed {o['as-freed']['ascending']:.0%} / {o['as-freed']['descending']:.0%} / "
                  f"{o['as-freed']['jump']:.0%}; kernel (30 layers) {entry['median_ms']['ascending']:.1f} vs "
                  f"{entry['median_ms']['as-freed']:.1f} ms, as-freed / ascending paired {pr['median']:.2f} "
                  f"({pr['min']:.2f}-{pr['max']:.2f})", flush=True)
    write_json(ns.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
