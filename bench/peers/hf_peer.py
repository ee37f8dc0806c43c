"""Hugging Face transformers as a peer: offline generation of a dataset, timed.

Runs in the peers venv (bench/peers/setup_peers.sh), not chunkwise's:

    bench/.venv-peers/bin/python bench/peers/hf_peer.py --model DIR --dataset prompts.json \\
        --mode padded|cb [--dtype bfloat16] [--batch-size 8] [--json out.json]

The dataset is a JSON list of {"prompt_token_ids": [...], "max_tokens": N} (what
bench/seed_table.py writes). Every request generates exactly max_tokens tokens, greedy, EOS
ignored, like the load test's requests.

- padded: `model.generate` on batches of --batch-size prompts, left-padded, one batch after
  another (static batching: a batch ends when its longest request does).
- cb: `model.generate_batch`, transformers' continuous batching with a paged KV cache.

Prints one JSON object (and writes it to --json): elapsed seconds of generation alone (model
load and warm-up excluded), token counts and throughputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def load(model_dir: str, dtype: str, attn: str | None):
    from transformers import AutoModelForCausalLM

    kw = {"dtype": getattr(torch, dtype)}
    if attn:
        kw["attn_implementation"] = attn
    return AutoModelForCausalLM.from_pretrained(model_dir, **kw).eval()


def run_padded(model, reqs, batch_size: int) -> tuple[float, int]:
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    produced = 0
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        longest = max(len(r["prompt_token_ids"]) for r in batch)
        ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for j, r in enumerate(batch):
            p = r["prompt_token_ids"]
            ids[j, longest - len(p) :] = torch.tensor(p)
            mask[j, longest - len(p) :] = 1
        new = max(r["max_tokens"] for r in batch)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad)
        # every row ran `new` steps; count what each request asked for
        produced += sum(min(r["max_tokens"], out.shape[1] - longest) for r in batch)
    return time.perf_counter() - t0, produced


def run_cb(model, reqs, max_batch_tokens: int | None) -> tuple[float, int]:
    from transformers import GenerationConfig

    new = max(r["max_tokens"] for r in reqs)
    gc = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id or 0)
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # Size the paged cache for the whole dataset: left to itself it sizes from free memory, which on a
    # CPU host shared with other servers can take more than there is.
    page = 256
    num_blocks = sum(-(-(len(r["prompt_token_ids"]) + r["max_tokens"]) // page) for r in reqs) + 8
    cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
    inputs = [r["prompt_token_ids"] for r in reqs]
    t0 = time.perf_counter()
    with torch.inference_mode():
        outs = model.generate_batch(inputs=inputs, generation_config=gc, continuous_batching_config=cb_config,
                                    warmup=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.generated_tokens) for o in outs.values())
    errors = [o.error for o in outs.values() if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    return elapsed, produced


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--mode", choices=("padded", "cb"), required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-size", type=int, default=8, help="padded: prompts per generate() call")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="cb: token budget per step")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    reqs = json.load(open(ns.dataset))
    attn = "paged|sdpa" if ns.mode == "cb" else "sdpa"
    model = load(ns.model, ns.dtype, attn)
    # warm-up on two short prompts, not timed
    warm = [{"prompt_token_ids": reqs[0]["prompt_token_ids"][:32], "max_tokens": 2}] * 2
    (run_cb(model, warm, ns.max_batch_tokens) if ns.mode == "cb" else run_padded(model, warm, 2))
    cpu0 = time.process_time()  # every thread of this process
    elapsed, produced = (run_cb(model, reqs, ns.max_batch_tokens) if ns.mode == "cb"
                         else run_padded(model, reqs, ns.batch_size))
    cpu_seconds = time.process_time() - cpu0
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
    out = {
        "peer": f"transformers-{ns.mode}",
        "transformers_version": __import__("transformers").__version__,
        "torch_version": torch.__version__,
        "dtype": ns.dtype,
        "batch_size": ns.batch_size if ns.mode == "padded" else None,
        "num_requests": len(reqs),
        "elapsed_s": elapsed,
        "server_cpu_seconds": cpu_seconds,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": produced,
        "total_token_throughput": (prompt_tokens + produced) / elapsed,
        "output_throughput": produced / elapsed,
        "request_throughput": len(reqs) / elapsed,
    }
    print(json.dumps(out))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
