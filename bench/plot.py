"""PNG plots from the JSON the load test and the benchmarks write.

    bench/.venv-peers/bin/python bench/plot.py RESULT.json OUT_DIR

matplotlib is not a chunkwise dependency; the peers venv (bench/peers/setup_peers.sh) has it.
- a `python -m chunkwise_tools.loadtest` result or `--compare` result: latency CDFs (TTFT, TPOT, ITL,
  e2e) and, for a comparison, throughput per config;
- a bench/seed_table.py result: throughput per config (median, min-max over rounds) and the
  paired throughput ratio to the baseline.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Runs in bench/.venv-peers (matplotlib lives there), where chunkwise is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chunkwise_tools import loadtest as lt  # noqa: E402


def seed_table_plots(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the uncontended runs' summary where there is one (see seed_table.py --min-cpu-share)
    s = result.get("summary_clean") or result["summary"]
    which = "uncontended runs" if "summary_clean" in result else "all runs"
    names = [n for n in result["summary"] if n in s]
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    med = [s[n]["total_token_throughput"]["median"] for n in names]
    lo = [m - s[n]["total_token_throughput"]["min"] for n, m in zip(names, med)]
    hi = [s[n]["total_token_throughput"]["max"] - m for n, m in zip(names, med)]
    colors = ["tab:blue" if n in result["configs"] else "tab:gray" for n in names]
    axes[0].bar(names, med, yerr=[lo, hi], capsize=4, color=colors)
    axes[0].set_ylabel("total tokens/s (median; bars: min-max)")
    axes[0].set_title(f"throughput, {result['scaling']['here']['num_requests']} requests of "
                      f"{result['scaling']['here']['prompt_len']} tokens ({result['dtype']}, {which})")
    ratios = [s[n]["throughput_ratio_to_baseline"] for n in names]
    ratios = [r if r["median"] is not None else {"median": 0, "min": 0, "max": 0} for r in ratios]
    rm = [r["median"] or 0 for r in ratios]
    axes[1].bar(names, rm, yerr=[[m - (r["min"] or m) for m, r in zip(rm, ratios)],
                                 [(r["max"] or m) - m for m, r in zip(rm, ratios)]], capsize=4, color=colors)
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set_ylabel(f"throughput / {result['baseline']} (same round)")
    axes[1].set_title("paired ratio (median; bars: min-max over rounds)")
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    path = out_dir / "seed_table_throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    servers = [r for r in result.get("raw", []) if r.get("requests")]
    if servers:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
        for ax, (key, title) in zip(axes, (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "end-to-end latency"))):
            for name in names:
                vals = sorted(1000 * q[key] for r in servers if r["label"] == name
                              for q in r["requests"] if q["ok"] and q[key] is not None)
                if vals:
                    ax.step(vals, [(i + 1) / len(vals) for i in range(len(vals))], where="post", label=name)
            ax.set_title(f"{title} CDF (all rounds pooled)")
            ax.set_xlabel("ms")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("fraction of requests")
        axes[-1].legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        path = out_dir / "seed_table_latency_cdf.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    result = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if result.get("schema", "").startswith("chunkwise.bench.seed_table"):
        paths = seed_table_plots(result, out)
    else:
        paths = lt.write_plots(result, out)
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
