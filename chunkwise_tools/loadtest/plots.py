"""Latency CDFs and throughput bars from a result JSON (matplotlib, where installed)."""

from __future__ import annotations

import sys
from pathlib import Path

from chunkwise_tools.loadtest.compare import COMPARE_SCHEMA

def write_plots(result: dict, out_dir: str | Path) -> list[Path]:
    """Latency CDFs per run and, for a comparison, throughput per config. Needs matplotlib;
    returns [] (and says so) without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed here (bench/plot.py draws them from the "
              "JSON with bench/.venv-peers/bin/python)", file=sys.stderr)
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = result["runs"] if result.get("schema") == COMPARE_SCHEMA else [result]
    written = []
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, (key, title) in zip(axes, (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "end-to-end"))):
        for run in runs:
            reqs = [r for r in run["requests"] if r["ok"]]
            if key == "itl":
                vals = sorted(1000 * x for r in reqs for x in r.get("itl", []))
            else:
                vals = sorted(1000 * r[key] for r in reqs if r[key] is not None)
            if vals:
                ys = [(i + 1) / len(vals) for i in range(len(vals))]
                ax.step(vals, ys, where="post", label=f"{run['label'] or run['backend']} r{run.get('round', 0)}")
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = out_dir / "latency_cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    if result.get("schema") == COMPARE_SCHEMA:
        names = [c["name"] for c in result["configs"]]
        s = result["summary"]
        fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 4))
        med = [s[n]["total_token_throughput"]["median"] or 0 for n in names]
        lo = [m - (s[n]["total_token_throughput"]["min"] or m) for n, m in zip(names, med)]
        hi = [(s[n]["total_token_throughput"]["max"] or m) - m for n, m in zip(names, med)]
        ax.bar(names, med, yerr=[lo, hi], capsize=4)
        ax.set_ylabel("total tok/s (median, min-max over repeats)")
        ax.set_title("throughput by config")
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        path = out_dir / "throughput.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written

