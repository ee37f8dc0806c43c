"""What SMG in front of chunkwise costs: the same replica, the same prompts, directly over gRPC
(the SDK) and through the gateway's OpenAI-compatible HTTP, in interleaved rounds.

    .venv/bin/python bench/gateway_overhead.py --rounds 2 --json bench/results/gateway_overhead.json

Two measurements:
- the seed-shaped offline batch (32 prompts of ~637 tokens, 180 shared within 8 groups, 64 output
  tokens, all sent at once): throughput and TTFT/TPOT, paired within a round;
- sequential single requests (a ~64-token prompt, 1 output token, one at a time, alternating
  direct and gateway): the per-request latency the gateway adds, without queueing.

SMG's /v1/completions takes text prompts only, so both paths get the same text and tokenise it
themselves (chunkwise with transformers' tokenizer, SMG with its own, from the same
tokenizer.json; the prompt token counts are reported to show they agree). The vLLM engine
protocol has no cache salt, so the prefix cache is flushed before every run instead.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import grpc
from benchutil import write_json
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from chunkwise.model_source import load_tokenizer, resolve_model
from chunkwise_tools import loadtest as lt
from chunkwise_tools.gateway import start_gateway
from chunkwise_tools.serve import start_stack


def flush(address: str) -> None:
    with grpc.insecure_channel(address) as ch:
        assert vpb_grpc.VllmEngineStub(ch).FlushCache(cpb.FlushCacheRequest(), timeout=30).success


async def sequential_ttft(backend, prompts: list[str]) -> list[float]:
    await backend.open()
    try:
        out = []
        for p in prompts:
            rec = lt.RequestRecord(0)
            await backend.send(lt.BenchRequest(1, prompt=p), rec, cache_salt="", timeout=60)
            assert rec.ok, rec.error
            out.append(rec.ttft * 1000)
        return out
    finally:
        await backend.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--single", type=int, default=20, help="sequential single requests per path per round")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    model = resolve_model(None)
    tok = load_tokenizer(model)
    vocab = lt.model_vocab_size(None)
    ids = lt.random_dataset(32, input_len=637, prefix_len=180, num_prefix_groups=8, output_len=64, vocab_size=vocab)
    batch = [lt.BenchRequest(r.max_tokens, prompt=tok.decode(r.prompt_token_ids), group=r.group) for r in ids]
    singles = [tok.decode(r.prompt_token_ids[:64]) for r in
               lt.random_dataset(ns.single, input_len=64, prefix_len=0, num_prefix_groups=1, output_len=1,
                                 vocab_size=vocab, seed=7)]
    stack = start_stack(None, scheduler_args=["--stats-interval", "0", "--max-model-len", "1024",
                                              "--max-num-batched-tokens", "1024"])
    gateway = start_gateway([stack.address], model, port=0, policy="round_robin")
    paths = {"direct": lambda: lt.ChunkwiseBackend(stack.address),
             "gateway": lambda: lt.OpenAIBackend(gateway.url, gateway.model)}
    runs, single = [], {"direct": [], "gateway": []}
    started = time.time()
    try:
        asyncio.run(sequential_ttft(paths["direct"](), singles[:2]))  # first-call costs, unmeasured
        for rnd in range(ns.rounds):
            order = ["direct", "gateway"] if rnd % 2 == 0 else ["gateway", "direct"]
            for name in order:
                flush(stack.address)
                res = asyncio.run(lt.run_load(paths[name](), batch, cache_salt="", label=name, progress=False))
                res["round"] = rnd
                res.pop("requests", None)
                runs.append(res)
                print(f"round {rnd} {name:8s}: {res['total_token_throughput']:.0f} tok/s, TTFT median "
                      f"{res['ttft_ms']['median']:.0f} ms, TPOT median {res['tpot_ms']['median']:.1f} ms, "
                      f"{res['total_input_tokens']} prompt tokens, {res['failed']} failed", flush=True)
            for name in order:
                single[name] += asyncio.run(sequential_ttft(paths[name](), singles))
    finally:
        gateway.stop()
        stack.stop()

    def paired(key):
        d = {r["round"]: r for r in runs if r["label"] == "direct"}
        return [r[key] / d[r["round"]][key] for r in runs if r["label"] == "gateway"]

    summary = {
        "batch_throughput_gateway_over_direct": paired("total_token_throughput"),
        "batch_ttft_median_ms": {n: [r["ttft_ms"]["median"] for r in runs if r["label"] == n] for n in paths},
        "batch_tpot_median_ms": {n: [r["tpot_ms"]["median"] for r in runs if r["label"] == n] for n in paths},
        "single_ttft_median_ms": {n: statistics.median(v) for n, v in single.items()},
        "single_ttft_p90_ms": {n: sorted(v)[int(0.9 * (len(v) - 1))] for n, v in single.items()},
    }
    print(summary)
    if ns.json:
        write_json(ns.json, {"schema": "chunkwise.bench.gateway_overhead/1", "started": started, "rounds": ns.rounds,
                             "summary": summary, "single_ttft_ms": single, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
