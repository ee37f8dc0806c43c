"""The seed's table on this CPU: chunked prefill (CP) x prefix caching (PC), with peers, in one run.

    .venv/bin/python bench/seed_table.py --json bench/results/seed_table.json
    .venv/bin/python bench/seed_table.py --peers none --repeats 2          # chunkwise only

The seed (vLLM PR "Enable chunked prefill and prefix caching together") ran 600 requests of 637
prompt tokens on average (a ~180-token shared prefix, ~20% cache hit rate), at most 200 output
tokens, chunk size 2048, Llama-3-8B FP8 on one L4, and reported elapsed time and throughput of
CP-only, PC-only and CP+PC. Here, scaled to minutes on 2 CPU cores with SmolLM2-135M:
--num-prompts 32 (600), --output-len 64 (200), token budget 1024 (2048) for every config; the
prompt shape is the seed's (637 tokens, 180 shared by each of 8 groups: 20.7% of the prompt
tokens can hit). All requests are sent at once (the seed's offline throughput setting); EOS is
ignored so every request makes exactly --output-len tokens.

Configs, each its own chunkwise stack started once and kept up (--restart-servers: restarted
before each of its runs, since a stack's speed can stay off by itself for the life of its
processes): neither, CP-only, PC-only, CP+PC; peers in the same run, on the same token ids:
vLLM's CPU build (its default, CP+PC, as an OpenAI server), transformers `generate` on
left-padded batches, transformers' continuous-batching `generate_batch`. Every round runs every config once, in an order rotated
round by round; each run has its own prefix-cache salt, so the cache never carries over between
runs. Ratios are paired: config / "neither" in the same round, median and range over rounds.

Noise: other processes share this machine. Each run records the CPU seconds its server used
(chunkwise: executor + scheduler; vLLM: every process of its session; transformers: its own
process) and the load average. "CPU share" is that CPU time over wall time x cores: well below
~90% on a saturated run means the server was not getting the cores (other load). "tok/CPU-s",
tokens processed per server CPU-second, is much less sensitive to that contention than tok/s, and
is reported beside it (it counts spinning threads as work, which flatters no one here: every
server's CPU share is measured the same way).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchutil import host_speed_ms, write_json

ROOT = Path(__file__).resolve().parents[1]

from chunkwise_tools import loadtest as lt  # noqa: E402

PEERS_VENV = ROOT / "bench" / ".venv-peers"
TMP = ROOT / "bench" / "results" / "tmp"

CONFIGS = {
    "neither": "--no-enable-chunked-prefill --no-enable-prefix-caching",
    "CP-only": "--enable-chunked-prefill --no-enable-prefix-caching",
    "PC-only": "--no-enable-chunked-prefill --enable-prefix-caching",
    "CP+PC": "--enable-chunked-prefill --enable-prefix-caching",
}
# vllm: vLLM as it configures itself. On x86 it reserves one core for its API/scheduler processes
# (VLLM_CPU_NUM_OF_RESERVED_CPU; its ompmultiprocessing.py), so on this 2-core machine the model
# runs on one core. vllm-allcores: its OpenMP threads bound to every core and none reserved, the
# way chunkwise's executor uses them (its scheduler process shares the same cores). Both run with
# --enforce-eager; vllm-allcores-compiled drops it, so vLLM's CPU default applies (its platform
# code traces the model once and compiles it with inductor), and is not in the default set.
VLLM_PEERS = ("vllm", "vllm-allcores", "vllm-allcores-compiled")
PEERS = (*VLLM_PEERS, "hf-padded", "hf-cb")
DEFAULT_PEERS = ("vllm", "vllm-allcores", "hf-padded", "hf-cb")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class VllmServer:
    """vLLM's OpenAI server from the peers venv, on a loopback port, started once."""

    def __init__(self, model: str, port: int, dtype: str, budget: int, max_model_len: int, kv_gib: float,
                 all_cores: bool = False, eager: bool = True, timeout: float = 600):
        py = PEERS_VENV / "bin" / "python"
        self.cmd = [
            str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "smollm2",
            "--host", "127.0.0.1", "--port", str(port), *(["--enforce-eager"] if eager else []), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--max-num-batched-tokens", str(budget),
            "--enable-prompt-tokens-details",
            # vLLM's CPU attention takes block sizes in multiples of 32 only (16 fails at start-up)
            "--block-size", "32",
        ]
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(max(1, round(kv_gib))), VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1")
        if all_cores:
            cores = sorted(os.sched_getaffinity(0))
            env.update(VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)), VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        self.env = {k: env[k] for k in env if k.startswith("VLLM_")}
        TMP.mkdir(parents=True, exist_ok=True)
        self.log_path = TMP / f"vllm{'_allcores' if all_cores else ''}{'' if eager else '_compiled'}_server.log"
        self.log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        from urllib.request import urlopen

        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vLLM not healthy after {timeout:.0f} s; see {self.log_path}")
            time.sleep(1)
        self.version = subprocess.run([str(py), "-c", "import vllm; print(vllm.__version__)"],
                                      capture_output=True, text=True).stdout.strip()

    def cpu_seconds(self) -> float:
        """CPU time of every process in the server's session (API server, engine core, worker)."""
        total = 0.0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[3]) == self.proc.pid:  # the process group = its session leader's pid
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the API server and engine core
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log_file.close()


def run_hf(mode: str, model: str, dataset_path: Path, dtype: str, batch_size: int, budget: int,
           timeout: float) -> dict:
    out = TMP / f"hf-{mode}.json"
    cmd = [str(PEERS_VENV / "bin" / "python"), str(ROOT / "bench" / "peers" / "hf_peer.py"), "--model", model,
           "--dataset", str(dataset_path), "--mode", mode, "--dtype", dtype, "--batch-size", str(batch_size),
           "--json", str(out)]
    if mode == "cb":
        cmd += ["--max-batch-tokens", str(budget)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if p.returncode != 0:
        raise RuntimeError(f"hf_peer {mode} failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(out.read_text())


def summarize(runs: list[dict], names: list[str], baseline: str) -> dict:
    """Median/min/max over rounds of elapsed and throughput; paired ratios to the baseline."""
    out = {}
    base_by_round = {r["round"]: r for r in runs if r["label"] == baseline}
    for n in names:
        mine = [r for r in runs if r["label"] == n]
        if not mine:
            continue
        row = {
            "elapsed_s": lt.spread([r["elapsed_s"] for r in mine]),
            "total_token_throughput": lt.spread([r["total_token_throughput"] for r in mine]),
            "throughput_ratio_to_baseline": lt.spread([
                r["total_token_throughput"] / base_by_round[r["round"]]["total_token_throughput"]
                for r in mine if r["round"] in base_by_round
            ]),
            "cpu_efficiency_ratio_to_baseline": lt.spread([
                r["tokens_per_cpu_second"] / base_by_round[r["round"]]["tokens_per_cpu_second"]
                for r in mine if r["round"] in base_by_round and r.get("tokens_per_cpu_second")
                and base_by_round[r["round"]].get("tokens_per_cpu_second")
            ]),
        }
        for key in ("tokens_per_cpu_second", "server_cpu_share", "ttft_median_ms", "tpot_median_ms", "itl_p99_ms", "prefix_cache_hit_rate",
                    "executor_idle_fraction", "executor_cpu_utilization", "rpc_fraction"):
            vals = [r.get(key) for r in mine if r.get(key) is not None]
            if vals:
                row[key] = lt.spread(vals)
        out[n] = row
    return out


def table(summary: dict, names: list[str], baseline: str) -> str:
    head = ["config", "elapsed s", "tok/s", "paired vs " + baseline, "paired range", "of medians", "tok/CPU-s", "CPU share",
            "TTFT med ms", "TPOT med ms", "hit rate", "exec idle"]
    rows = [head]
    base_tput = summary.get(baseline, {}).get("total_token_throughput", {}).get("median")
    for n in names:
        if n not in summary:
            continue
        s = summary[n]

        def med(key, fmt):
            v = s.get(key, {}).get("median")
            return "-" if v is None else fmt.format(v)

        ratio = s["throughput_ratio_to_baseline"]
        rows.append([
            n, med("elapsed_s", "{:.1f}"), med("total_token_throughput", "{:.0f}"),
            "-" if ratio["median"] is None else f"{ratio['median']:.3f}",
            "-" if ratio["min"] is None else f"{ratio['min']:.3f}-{ratio['max']:.3f} (n={ratio['n']})",
            f"{s['total_token_throughput']['median'] / base_tput:.3f}" if base_tput else "-",
            med("tokens_per_cpu_second", "{:.0f}"), med("server_cpu_share", "{:.0%}"),
            med("ttft_median_ms", "{:.0f}"), med("tpot_median_ms", "{:.0f}"), med("prefix_cache_hit_rate", "{:.1%}"),
            med("executor_idle_fraction", "{:.1%}"),
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_clean_summary(result: dict, min_cpu_share: float) -> None:
    """Summary over the uncontended runs only: a run whose server got less than `min_cpu_share` of
    the cores is left out (and so is every paired ratio that needs it)."""
    names = list(result["summary"])
    clean = [r for r in result["runs"] if (r.get("server_cpu_share") or 0) >= min_cpu_share]
    result["clean_min_cpu_share"] = min_cpu_share
    result["runs_left_out_as_contended"] = [(r["label"], r["round"], round(r.get("server_cpu_share") or 0, 3))
                                            for r in result["runs"] if r not in clean]
    result["summary_clean"] = summarize(clean, names, result["baseline"])
    result["table_clean"] = table(result["summary_clean"], names, result["baseline"])


def flatten_server_run(result: dict) -> dict:
    ov = result.get("step_overhead") or {}
    st = result.get("server_stats") or {}
    return {
        "label": result["label"], "round": result["round"], "elapsed_s": result["duration_s"],
        "total_token_throughput": result["total_token_throughput"], "output_throughput": result["output_throughput"],
        "completed": result["completed"], "failed": result["failed"],
        "ttft_median_ms": result["ttft_ms"]["median"], "ttft_p99_ms": result["ttft_ms"]["p99"],
        "tpot_median_ms": result["tpot_ms"]["median"], "itl_p99_ms": result["itl_ms"]["p99"],
        "e2el_median_ms": result["e2el_ms"]["median"],
        "prefix_cache_hit_rate": st.get("prefix_cache_hit_rate"),
        "client_cached_token_fraction": result.get("client_cached_token_fraction"),
        "preemptions": st.get("preemptions"),
        "executor_idle_fraction": ov.get("executor_idle_fraction"),
        "rpc_fraction": ov.get("rpc_fraction"),
        "idle_ms_per_step": ov.get("idle_ms_per_step"),
        "executor_ms_per_step": ov.get("executor_ms_per_step"),
        "steps": ov.get("steps"),
        "executor_cpu_utilization": ov.get("executor_cpu_utilization"),
        # Pages the executor's kernel side mapped and zeroed in the run, and its system CPU time.
        "executor_minor_faults": ov.get("executor_minor_faults"),
        "executor_system_seconds": ov.get("executor_system_seconds"),
    }


async def main_async(ns) -> dict:
    from chunkwise.model_source import resolve_model

    model = str(resolve_model(ns.model))
    vocab = lt.model_vocab_size(model)
    requests = lt.random_dataset(ns.num_prompts, input_len=ns.input_len, output_len=ns.output_len,
                                 prefix_len=ns.prefix_len, num_prefix_groups=ns.groups, vocab_size=vocab, seed=ns.seed)
    TMP.mkdir(parents=True, exist_ok=True)
    dataset_path = TMP / "seed_dataset.json"
    dataset_path.write_text(json.dumps([{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}
                                        for r in requests]))
    peers = [] if ns.peers == ["none"] else ns.peers
    if peers and not (PEERS_VENV / "bin" / "python").exists():
        log(f"no peers venv at {PEERS_VENV} (run bench/peers/setup_peers.sh); running without peers")
        peers = []
    executor_args = ["--dtype", ns.dtype, "--kv-cache-space", str(ns.kv_gib)]
    common = ["--max-model-len", str(ns.max_model_len), "--max-num-batched-tokens", str(ns.budget),
              "--block-size", str(ns.block_size)]
    configs = [lt.ServerConfig(n, [*common, *shlex.split(CONFIGS[n])]) for n in ns.configs]
    for spec in ns.variant:  # "NAME=CONFIG|EXECUTOR FLAGS": a config again, with executor flags of its own
        name, _, rest = spec.partition("=")
        base, _, flags = rest.partition("|")
        if not name or base not in CONFIGS:
            raise SystemExit(f"--variant {spec!r}: expected NAME=CONFIG|EXECUTOR FLAGS, CONFIG one of {list(CONFIGS)}")
        configs.append(lt.ServerConfig(name, [*common, *shlex.split(CONFIGS[base])], shlex.split(flags)))
    names = [c.name for c in configs] + list(peers)
    stacks: dict[str, lt.ManagedStack] = {}
    vllms: dict[str, VllmServer] = {}
    runs: list[dict] = []
    raw: list[dict] = []
    started = time.time()
    by_name = {c.name: c for c in configs}
    vllm_ports = {name: ns.vllm_port + i for i, name in enumerate(p for p in VLLM_PEERS if p in peers)}

    async def start(name: str) -> None:
        if name in by_name:
            c = by_name[name]
            log(f"starting chunkwise {c.name}: {' '.join(c.scheduler_args)} {' '.join(c.executor_args)}")
            stacks[name] = await asyncio.to_thread(lt.ManagedStack, model, c, executor_args)
        else:
            log(f"starting {name} (peers venv)")
            vllms[name] = await asyncio.to_thread(VllmServer, model, vllm_ports[name], ns.dtype, ns.budget,
                                                  ns.max_model_len, ns.kv_gib * 2, all_cores=name != "vllm",
                                                  eager=name != "vllm-allcores-compiled")

    try:
        for name in [*by_name, *vllm_ports]:
            await start(name)
        for rnd, order in enumerate(lt.round_orders(names, ns.repeats, True)):
            for name in order:
                if name.startswith("hf-") and rnd >= ns.hf_repeats:
                    continue
                if ns.restart_servers and rnd > 0 and (name in stacks or name in vllms):
                    # Fresh processes for every run: a server's speed can stay off by itself for
                    # the life of its processes (RESULTS.md section 1), which a round cannot pair away.
                    await asyncio.to_thread((stacks.pop(name) if name in stacks else vllms.pop(name)).stop)
                    await start(name)
                load_before = os.getloadavg()
                salt = f"seed-r{rnd}-{name}"
                if name in stacks:
                    ms = stacks[name]
                    res = await lt.run_load(lt.ChunkwiseBackend(ms.address), requests, cache_salt=salt, label=name,
                                            warmup=lt.warmup_requests(2, vocab, rnd), probe=ms.step_times,
                                            max_duration=ns.max_duration, request_timeout=ns.max_duration,
                                            keep_itl=False)
                elif name in vllms:
                    vllm = vllms[name]
                    cpu0 = vllm.cpu_seconds()
                    res = await lt.run_load(lt.OpenAIBackend(vllm.base_url, "smollm2"), requests, cache_salt=salt,
                                            label=name, warmup=lt.warmup_requests(2, vocab, rnd),
                                            max_duration=ns.max_duration, request_timeout=ns.max_duration,
                                            keep_itl=False)
                    res["server_cpu_seconds"] = vllm.cpu_seconds() - cpu0
                else:
                    res = await asyncio.to_thread(run_hf, name[3:], model, dataset_path, ns.dtype, ns.hf_batch_size,
                                                  ns.budget, ns.max_duration)
                    res.update(label=name, duration_s=res["elapsed_s"], completed=res["num_requests"], failed=0)
                ov = res.get("step_overhead") or {}
                if "executor_cpu_seconds" in ov:
                    res["server_cpu_seconds"] = ov["executor_cpu_seconds"] + ov.get("scheduler_cpu_seconds", 0.0)
                res["round"] = rnd
                res["loadavg_before"], res["loadavg_after"] = load_before, os.getloadavg()
                raw.append({k: v for k, v in res.items() if k != "requests"} | (
                    {"requests": res["requests"]} if ns.keep_requests and "requests" in res else {}))
                flat = flatten_server_run(res) if "ttft_ms" in res else {
                    "label": name, "round": rnd, "elapsed_s": res["elapsed_s"],
                    "total_token_throughput": res["total_token_throughput"],
                    "output_throughput": res["output_throughput"], "completed": res["num_requests"], "failed": 0}
                flat["loadavg_1m_after"] = res["loadavg_after"][0]
                flat["host_speed_ms_after"] = host_speed_ms()  # the host's own speed (benchutil)
                cpu = res.get("server_cpu_seconds")
                if cpu:
                    tokens = res["total_input_tokens"] + res["total_output_tokens"]
                    flat["server_cpu_seconds"] = cpu
                    flat["server_cpu_share"] = cpu / (flat["elapsed_s"] * (os.cpu_count() or 1))
                    flat["tokens_per_cpu_second"] = tokens / cpu
                runs.append(flat)
                if flat.get("failed"):
                    log(f"  {flat['failed']} requests failed: {res.get('errors')}")
                log(f"round {rnd} {name:9s}: {flat['elapsed_s']:7.1f} s  {flat['total_token_throughput']:7.1f} tok/s"
                    + (f"  hit {flat['prefix_cache_hit_rate']:.1%}" if flat.get("prefix_cache_hit_rate") is not None else "")
                    + (f"  CPU share {flat['server_cpu_share']:.0%}  {flat['tokens_per_cpu_second']:.0f} tok/CPU-s"
                       if flat.get("server_cpu_share") else "")
                    + f"  load {res['loadavg_after'][0]:.1f}")
    finally:
        for ms in stacks.values():
            ms.stop()
        for v in vllms.values():
            v.stop()
    baseline = "neither" if "neither" in names else names[0]
    summary = summarize(runs, names, baseline)
    return {
        "schema": "chunkwise.bench.seed_table/1",
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "wall_s": time.time() - started,
        "model": model,
        "dtype": ns.dtype,
        "scaling": {
            "seed": {"num_requests": 600, "mean_prompt_len": 637, "shared_prefix": 180, "max_output": 200,
                     "chunk_size": 2048, "model": "Llama-3-8B-Instruct-FP8", "hardware": "1x L4"},
            "here": {"num_requests": ns.num_prompts, "prompt_len": ns.input_len, "shared_prefix": ns.prefix_len,
                     "prefix_groups": ns.groups, "output_len": ns.output_len, "token_budget": ns.budget,
                     "max_model_len": ns.max_model_len, "block_size": ns.block_size,
                     "model": "SmolLM2-135M-Instruct", "hardware": f"{os.cpu_count()} CPU cores"},
        },
        "configs": {c.name: c.scheduler_args for c in configs},
        "executor_args": executor_args,
        "restart_servers": ns.restart_servers,
        "vllm": {name: {"version": v.version, "command": v.cmd, "env": v.env} for name, v in vllms.items()} or None,
        "baseline": baseline,
        "summary": summary,
        "table": table(summary, names, baseline),
        "runs": runs,
        "raw": raw,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=637)
    p.add_argument("--prefix-len", type=int, default=180)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens of every config")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--kv-gib", type=float, default=1.0, help="chunkwise KV cache GiB (vLLM gets twice: its own layout)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--variant", action="append", default=[], metavar="NAME=CONFIG|FLAGS",
                   help="one more chunkwise stack: CONFIG's scheduler flags plus these executor flags, e.g. "
                        "'CP+PC 2-copies=CP+PC|--cpu-plain-weight-min-rows 512' (repeatable)")
    p.add_argument("--peers", nargs="+", default=list(DEFAULT_PEERS), choices=[*PEERS, "none"])
    p.add_argument("--repeats", type=int, default=3, help="rounds (every config once per round)")
    p.add_argument("--hf-repeats", type=int, default=1, help="rounds that include the (slow) transformers peers")
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--vllm-port", type=int, default=8011)
    p.add_argument("--max-duration", type=float, default=900.0, help="per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-requests", action="store_true", help="keep per-request records in the JSON")
    p.add_argument("--restart-servers", action="store_true",
                   help="restart every chunkwise stack and vLLM server before each of its runs after the first "
                        "(fresh processes per run; costs a start-up per run, vLLM's compile included)")
    p.add_argument("--json", default=None)
    p.add_argument("--min-cpu-share", type=float, default=0.75,
                   help="runs whose server got less CPU than this share of the cores count as contended")
    p.add_argument("--resummarize", metavar="JSON", default=None,
                   help="recompute the summaries of an earlier result file (no runs)")
    ns = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # SIGTERM (kill, a timeout) ends the driver as Ctrl-C does, so main_async's finally stops the
    # stacks and the vLLM server it started: they run in sessions of their own and outlive it.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if ns.resummarize:
        result = json.loads(Path(ns.resummarize).read_text())
        result["summary"] = summarize(result["runs"], list(result["summary"]), result["baseline"])
        result["table"] = table(result["summary"], list(result["summary"]), result["baseline"])
        ns.json = ns.json or ns.resummarize
    else:
        result = asyncio.run(main_async(ns))
    add_clean_summary(result, ns.min_cpu_share)
    print()
    print("all runs:")
    print(result["table"])
    print(f"\nuncontended runs only (server CPU share >= {ns.min_cpu_share:.0%}; left out: "
          f"{result['runs_left_out_as_contended'] or 'none'}):")
    print(result["table_clean"])
    write_json(ns.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
