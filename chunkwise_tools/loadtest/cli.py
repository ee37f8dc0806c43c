"""The command line: `python -m chunkwise_tools.loadtest` (also `chunkwise bench`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
from pathlib import Path

from chunkwise_tools.loadtest import __doc__ as PACKAGE_DOC
from chunkwise_tools.loadtest.backends import ChunkwiseBackend, OpenAIBackend, check_loopback
from chunkwise_tools.loadtest.compare import parse_config, run_compare
from chunkwise_tools.loadtest.datasets import (
    BenchRequest,
    dataset_summary,
    jsonl_dataset,
    multi_turn_dataset,
    random_dataset,
)
from chunkwise_tools.loadtest.plots import write_plots
from chunkwise_tools.loadtest.run import MAX_PROMPTS, run_load, warmup_requests

def build_dataset(ns, vocab_size: int) -> list[BenchRequest]:
    if ns.dataset == "random":
        return random_dataset(
            ns.num_prompts, input_len=ns.input_len, output_len=ns.output_len, prefix_len=ns.prefix_len,
            num_prefix_groups=ns.num_prefix_groups, range_ratio=ns.range_ratio,
            output_range_ratio=ns.output_range_ratio, vocab_size=vocab_size, seed=ns.seed,
        )
    if ns.dataset == "multi-turn":
        convs = max(1, ns.num_prompts // ns.turns)
        return multi_turn_dataset(
            convs, turns=ns.turns, system_len=ns.prefix_len, user_len=ns.user_len, answer_len=ns.user_len,
            output_len=ns.output_len, vocab_size=vocab_size, seed=ns.seed,
        )
    if not ns.dataset_path:
        raise ValueError("--dataset jsonl needs --dataset-path")
    return jsonl_dataset(ns.dataset_path, default_output_len=ns.output_len, limit=ns.num_prompts)


def model_vocab_size(model: str | None) -> int:
    from chunkwise.model_source import resolve_model

    with open(Path(resolve_model(model)) / "config.json") as f:
        return int(json.load(f)["vocab_size"])


def build_parser(prog: str = "python -m chunkwise_tools.loadtest") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=PACKAGE_DOC.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("target")
    t.add_argument("--address", default="127.0.0.1:50051", help="chunkwise scheduler HOST:PORT")
    t.add_argument("--api-key", default=None)
    t.add_argument("--backend", choices=("chunkwise", "openai"), default="chunkwise",
                   help="openai: an OpenAI-compatible completions server at --base-url (e.g. vLLM)")
    t.add_argument("--base-url", default="http://127.0.0.1:8000")
    t.add_argument("--served-model-name", default=None, help="the openai backend's model name")
    t.add_argument("--model", default=None,
                   help="checkpoint for --compare's stacks and for the vocabulary size (default: the embedded model)")
    t.add_argument("--vocab-size", type=int, default=None, help="random token ids below this (default: the model's)")
    t.add_argument("--allow-remote", action="store_true", help="allow a non-loopback target")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=("random", "multi-turn", "jsonl"), default="random")
    d.add_argument("--dataset-path", default=None, help="the JSONL file for --dataset jsonl")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--input-len", type=int, default=637, help="random: mean prompt tokens")
    d.add_argument("--prefix-len", type=int, default=180, help="random: shared prefix; multi-turn: system prompt")
    d.add_argument("--num-prefix-groups", type=int, default=8, help="random: distinct shared prefixes")
    d.add_argument("--range-ratio", type=float, default=0.0, help="random: prompt length spread (0: fixed)")
    d.add_argument("--output-len", type=int, default=200, help="max_tokens per request (EOS ignored)")
    d.add_argument("--output-range-ratio", type=float, default=0.0)
    d.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    d.add_argument("--user-len", type=int, default=60, help="multi-turn: tokens per user/assistant message")
    d.add_argument("--seed", type=int, default=0)
    a = p.add_argument_group("arrivals and bounds")
    a.add_argument("--request-rate", type=float, default=math.inf, help="Poisson rate in requests/s (inf: all at once)")
    a.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (closed loop)")
    a.add_argument("--num-warmup", type=int, default=2, help="short unique requests sent first, not measured")
    a.add_argument("--max-duration", type=float, default=600.0, help="send nothing after this many seconds")
    a.add_argument("--request-timeout", type=float, default=600.0)
    a.add_argument("--cache-salt", default="", help="prefix-cache salt for the measured requests")
    c = p.add_argument_group("compare")
    c.add_argument("--compare", nargs="+", metavar="NAME=FLAGS", default=None,
                   help="start each config's stack ('NAME=scheduler flags [|| executor flags]') and run the same dataset")
    c.add_argument("--executor-arg", action="append", default=[], help="executor flag for every --compare stack")
    c.add_argument("--repeats", type=int, default=1)
    c.add_argument("--no-interleave", dest="interleave", action="store_false",
                   help="run each config's repeats back to back instead of round-robin")
    c.add_argument("--baseline", default=None, help="config the ratios divide by (default: the first)")
    o = p.add_argument_group("output")
    o.add_argument("--result-json", default=None)
    o.add_argument("--plot-dir", default=None)
    o.add_argument("--no-itl", action="store_true", help="leave per-token gaps out of the JSON")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    return p


def format_result(r: dict) -> str:
    lines = [
        f"{'backend':<28}{r['backend']} {r['label']}",
        f"{'requests ok / failed':<28}{r['completed']} / {r['failed']}",
        f"{'duration (s)':<28}{r['duration_s']:.2f}",
        f"{'request throughput (req/s)':<28}{r['request_throughput']:.3f}",
        f"{'input tok/s':<28}{r['input_throughput']:.1f}",
        f"{'output tok/s':<28}{r['output_throughput']:.1f}",
        f"{'total tok/s':<28}{r['total_token_throughput']:.1f}",
    ]
    st = r.get("server_stats") or {}
    if "prefix_cache_hit_rate" in st:
        lines.append(f"{'prefix cache hit rate':<28}{st['prefix_cache_hit_rate']:.1%} (server), "
                     f"{r['client_cached_token_fraction']:.1%} of prompt tokens cached (usage)")
    lines.append(f"{'':<14}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for key, title in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("itl_ms", "ITL ms"), ("e2el_ms", "E2E ms")):
        s = r[key]
        cells = "".join("{:>10}".format("-" if s[k] is None else f"{s[k]:.1f}") for k in ("mean", "median", "p90", "p99"))
        lines.append(f"{title:<14}{cells}")
    if r["errors"]:
        lines.append("errors: " + "; ".join(r["errors"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m chunkwise_tools.loadtest") -> int:
    ns = build_parser(prog).parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if not 1 <= ns.num_prompts <= MAX_PROMPTS:
            raise ValueError(f"--num-prompts must be in [1, {MAX_PROMPTS}]")
        if ns.max_duration <= 0 or ns.request_timeout <= 0:
            raise ValueError("--max-duration and --request-timeout must be > 0")
        if not ns.allow_remote:
            if ns.backend == "openai":
                from urllib.parse import urlsplit

                check_loopback(urlsplit(ns.base_url).hostname or "")
            else:
                check_loopback(ns.address.rpartition(":")[0])
        vocab = ns.vocab_size or model_vocab_size(ns.model)
        requests = build_dataset(ns, vocab)
    except (ValueError, OSError) as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 2
    run_kwargs = dict(request_rate=ns.request_rate, max_concurrency=ns.max_concurrency, seed=ns.seed,
                      max_duration=ns.max_duration, request_timeout=ns.request_timeout,
                      progress=ns.progress, keep_itl=not ns.no_itl)
    print(f"dataset {ns.dataset}: {json.dumps(dataset_summary(requests))}", flush=True)
    if ns.compare:
        configs = [parse_config(s) for s in ns.compare]
        result = asyncio.run(run_compare(
            configs, requests, model=ns.model, executor_args=ns.executor_arg, repeats=ns.repeats,
            interleave=ns.interleave, baseline=ns.baseline, vocab_size=vocab, num_warmup=ns.num_warmup,
            run_kwargs=run_kwargs,
        ))
        result["dataset"] = {"name": ns.dataset, **dataset_summary(requests)}
        result["command"] = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        print(result["table"])
    else:
        if ns.backend == "openai":
            backend = OpenAIBackend(ns.base_url, ns.served_model_name or str(ns.model or "model"))
        else:
            backend = ChunkwiseBackend(ns.address, ns.api_key)
        result = asyncio.run(run_load(backend, requests, cache_salt=ns.cache_salt,
                                      warmup=warmup_requests(ns.num_warmup, vocab, ns.seed), **run_kwargs))
        result["dataset"] = {"name": ns.dataset, **dataset_summary(requests)}
        print(format_result(result))
    if ns.result_json:
        Path(ns.result_json).parent.mkdir(parents=True, exist_ok=True)
        with open(ns.result_json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {ns.result_json}")
    if ns.plot_dir:
        for path in write_plots(result, ns.plot_dir):
            print(f"wrote {path}")
    failed = result["failed"] if "failed" in result else sum(r["failed"] for r in result["runs"])
    return 1 if failed else 0

