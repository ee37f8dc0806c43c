"""Two builds of the paged decode kernel side by side: the same inputs, interleaved rounds, the
paired ratio of their times, and whether their outputs are equal.

    .venv/bin/python bench/paged_kernel_ab.py OLD.pt2 NEW.pt2 [--rounds 12] [--json out.json]

OLD and NEW are package files from the chunkwise cache (`~/.cache/chunkwise/kernels/`, one per
kernel source, torch, CPU and head geometry; `paged_decode_reference` hashes into the name, so
the build before a change to it is still there after it). They must share a dtype and head
geometry. SmolLM2-135M shapes by default, as bench/attention_probe.py: 30 layers each with its
own cache of 2,000 blocks of 16 tokens, block tables scattered over the pool (`--consecutive`:
each row's blocks consecutive and ascending, what a server mostly hands out); cases decode 32 x
700 and 32 rows of 600..800 keys (one call each). Each round times one pass over the 30 layers
of each build, in alternating order; the ratio old / new is paired within a round.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time
from pathlib import Path

import torch
from benchutil import spread, write_json

from chunkwise.plan import cdiv
from executor_svc.aot_package import load
from executor_svc.attention.paged_decode import decode_slots

NUM_BLOCKS, BLOCK_SIZE, LAYERS, ROWS = 2000, 16, 30, 32


def geometry(path: Path) -> tuple[torch.dtype, int, int, int]:
    """(dtype, heads, KV heads, head dim) from a package's name."""
    m = re.match(r"paged_decode_(\w+?)_(\d+)x(\d+)x(\d+)_", path.name)
    if m is None:
        raise SystemExit(f"{path}: not a paged decode package name")
    return getattr(torch, m[1]), int(m[2]), int(m[3]), int(m[4])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--consecutive", action="store_true",
                   help="each row's blocks consecutive and ascending (what a server hands out), not scattered")
    p.add_argument("--json")
    ns = p.parse_args(argv)
    dtype, heads, kv_heads, dim = geometry(ns.old)
    if geometry(ns.new) != (dtype, heads, kv_heads, dim):
        raise SystemExit("the two packages differ in dtype or head geometry")
    builds = {"old": load(ns.old), "new": load(ns.new)}
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(NUM_BLOCKS * BLOCK_SIZE, kv_heads, dim, generator=gen).to(dtype),
               torch.randn(NUM_BLOCKS * BLOCK_SIZE, kv_heads, dim, generator=gen).to(dtype)) for _ in range(LAYERS)]
    rng = random.Random(0)
    scale = torch.tensor(dim**-0.5)
    cases = {"decode_32x700": [700] * ROWS, "decode_ragged_600_800": [rng.randint(600, 800) for _ in range(ROWS)]}
    result: dict = {"command": " ".join(["bench/paged_kernel_ab.py", str(ns.old), str(ns.new), "--rounds",
                                         str(ns.rounds)] + (["--consecutive"] if ns.consecutive else [])),
                    "old": ns.old.name, "new": ns.new.name, "dtype": str(dtype), "threads": torch.get_num_threads(),
                    "cases": {}}
    for case, lens in cases.items():
        pool = list(range(NUM_BLOCKS))
        if not ns.consecutive:
            rng.shuffle(pool)
        rows = [[pool.pop() for _ in range(cdiv(max(lens), BLOCK_SIZE))] for _ in lens]
        # pop() takes from the end: reversed, a consecutive row's blocks ascend.
        table = torch.tensor([row[::-1] for row in rows] if ns.consecutive else rows)
        slots, lens_t = decode_slots(table, lens, BLOCK_SIZE)
        q = torch.randn(ROWS, heads, dim, generator=gen)  # the kernel takes the query in float32

        def run(name: str) -> list[torch.Tensor]:
            return [builds[name].run([q, k, v, slots, lens_t, scale])[0] for k, v in caches]

        with torch.inference_mode():
            equal = all(torch.equal(a, b) for a, b in zip(run("old"), run("new")))
            ms: dict[str, list[float]] = {"old": [], "new": []}
            for r in range(ns.rounds):
                for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                    t0 = time.perf_counter()
                    run(name)
                    ms[name].append(1000 * (time.perf_counter() - t0))
        ratios = [o / n for o, n in zip(ms["old"], ms["new"])]
        entry: dict = {
            "outputs_equal": equal, "ms": ms,
            "min_ms": {k: min(v) for k, v in ms.items()}, "median_ms": {k: statistics.median(v) for k, v in ms.items()},
            "old_over_new_paired": spread(ratios),
        }
        result["cases"][case] = entry
        paired = entry["old_over_new_paired"]
        print(f"{case}: old {entry['median_ms']['old']:.1f} ms, new {entry['median_ms']['new']:.1f} ms (medians; "
              f"min {entry['min_ms']['old']:.1f} / {entry['min_ms']['new']:.1f}); old / new paired "
              f"{paired['median']:.2f} ({paired['min']:.2f}-{paired['max']:.2f}); outputs equal: {equal}", flush=True)
    write_json(ns.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
