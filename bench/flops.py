"""Model FLOP rate in prefill against a matmul peak measured in the same run.

    .venv/bin/python bench/flops.py [--model DIR] [--dtypes float32 bfloat16] [--lengths 128 512 1024]
                                    [--json bench/results/flops.json]

For each dtype: (1) the peak of a square matmul (torch.mm, 2048 and 4096) and of the model's own
largest GEMM shape; (2) chunkwise's executor (`executor_svc.engine.ModelRunner`, in this process,
torch attention backend) running one prefill step of L tokens; (3) Hugging Face transformers'
forward on the same checkpoint and tokens, as a reference. Model FLOPs count the matmuls of every
layer (2 * params per token), causal attention (QK^T and AV over the L(L+1)/2 visible pairs) and
lm_head for the one sampled row; embeddings, norms, RoPE and softmax are not counted.
The ratio model rate / matmul peak is the model FLOP utilisation (MFU) against what this CPU
delivers for dense GEMMs, not against a datasheet number. Runs are repeated (--repeats) and the
median is reported with the min-max spread.

bf16 matmuls use AVX512-BF16 (VDPBF16PS) through oneDNN where the CPU has it; Intel's AMX is
used only where lscpu lists amx_bf16 (the script records both flags).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from benchutil import spread, write_json


def cpu_flags() -> dict:
    flags = set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "model_name": model or platform.processor(),
        "avx512f": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "amx_tile": "amx_tile" in flags,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
    }


def timed(fn, repeats: int, inner: int = 1) -> list[float]:
    fn()  # warm-up (allocations, oneDNN primitive creation)
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t) / inner)
    return out


def matmul_peak(dtype: torch.dtype, shapes, repeats: int) -> dict:
    out = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        secs = timed(lambda: torch.mm(a, b), repeats, inner=3)
        out[f"{m}x{k}x{n}"] = spread([2 * m * k * n / s / 1e9 for s in secs])
    return out


def model_dims(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads", heads)
    return {
        "hidden": h, "layers": cfg["num_hidden_layers"], "heads": heads, "kv_heads": kv, "head_dim": head_dim,
        "intermediate": cfg["intermediate_size"], "vocab": cfg["vocab_size"],
    }


def prefill_flops(d: dict, length: int) -> dict:
    """FLOPs of one causal prefill of `length` tokens that samples one token."""
    h, hd = d["hidden"], d["head_dim"]
    per_layer = h * d["heads"] * hd * 2 + h * d["kv_heads"] * hd * 2 + 3 * h * d["intermediate"]  # q,o + k,v + mlp
    linear = 2 * length * per_layer * d["layers"]
    pairs = length * (length + 1) // 2
    attention = 2 * 2 * pairs * d["heads"] * hd * d["layers"]  # QK^T and AV
    lm_head = 2 * h * d["vocab"]
    return {"linear": linear, "attention": attention, "lm_head": lm_head, "total": linear + attention + lm_head}


class ChunkwisePrefill:
    """The executor's ModelRunner in this process, fed hand-made one-request prefill plans."""

    def __init__(self, model_dir: Path, dtype: str, block_size: int = 16):
        from executor_svc.config import ExecutorConfig
        from executor_svc.engine import ModelRunner

        self.runner = ModelRunner(ExecutorConfig(model=str(model_dir), dtype=dtype, device="cpu",
                                                 attention_backend="torch", kv_cache_space=1.0))
        self.block_size = block_size
        self.num_blocks = self.runner.initialize(block_size)
        self.step = 0

    def run(self, token_ids: list[int]) -> float:
        from chunkwise.plan import NewRequestData, SamplingParams, ScheduledChunk, StepPlan

        n = len(token_ids)
        blocks = list(range(-(-n // self.block_size)))
        rid = f"flops-{self.step}"
        plan = StepPlan(
            step_id=self.step,
            new_requests=[NewRequestData(rid, list(token_ids), blocks, SamplingParams(temperature=0.0))],
            chunks=[ScheduledChunk(rid, 0, n, 0, True)],
        )
        self.step += 1
        t = time.perf_counter()
        self.runner.execute(plan)
        secs = time.perf_counter() - t
        done = StepPlan(step_id=self.step, finished_req_ids=[rid])  # free the request's state
        self.step += 1
        self.runner.execute(done)
        return secs


class HFPrefill:
    def __init__(self, model_dir: Path, dtype: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()

    def run(self, token_ids: list[int]) -> float:
        ids = torch.tensor([token_ids])
        with torch.inference_mode():
            t = time.perf_counter()
            self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
            return time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--lengths", nargs="+", type=int, default=[128, 512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from chunkwise.model_source import resolve_model

    model_dir = Path(resolve_model(ns.model))
    d = model_dims(model_dir)
    gemm = (2048, d["hidden"], d["intermediate"])  # the MLP up/gate projection of a 2048-token chunk
    shapes = [(2048, 2048, 2048), (4096, 4096, 4096), gemm]
    vocab_lo = min(100, d["vocab"] // 4)
    result = {"schema": "chunkwise.bench.flops/1", "model": str(model_dir), "dims": d, "cpu": cpu_flags(),
              "command": " ".join([sys.executable, *sys.argv]), "dtypes": {}}
    g = torch.Generator().manual_seed(0)
    for dtype in ns.dtypes:
        tdt = getattr(torch, dtype)
        print(f"== {dtype}", flush=True)
        peak = matmul_peak(tdt, shapes, ns.repeats)
        best_peak = max(v["median"] for v in peak.values())
        for k, v in peak.items():
            print(f"  matmul {k:>16}: {v['median']:7.1f} GFLOP/s (min {v['min']:.1f}, max {v['max']:.1f})", flush=True)
        engines = {"chunkwise": ChunkwisePrefill(model_dir, dtype)}
        if not ns.no_hf:
            engines["transformers"] = HFPrefill(model_dir, dtype)
        rows = []
        for L in ns.lengths:
            ids = torch.randint(vocab_lo, d["vocab"], (L,), generator=g).tolist()
            fl = prefill_flops(d, L)
            row = {"length": L, "flops": fl}
            for name, eng in engines.items():
                secs = timed(lambda: eng.run(ids), ns.repeats)
                rates = [fl["total"] / s / 1e9 for s in secs]
                row[name] = {"seconds_median": statistics.median(secs), "gflops": spread(rates),
                             "mfu_vs_measured_peak": statistics.median(rates) / best_peak,
                             "tokens_per_s": L / statistics.median(secs)}
                print(f"  {name:>12} prefill L={L:5d}: {statistics.median(secs) * 1000:8.1f} ms, "
                      f"{statistics.median(rates):6.1f} GFLOP/s ({min(rates):.1f}-{max(rates):.1f}), "
                      f"{row[name]['mfu_vs_measured_peak']:.1%} of the matmul peak, "
                      f"{L / statistics.median(secs):7.0f} tok/s", flush=True)
            rows.append(row)
        result["dtypes"][dtype] = {"matmul_gflops": peak, "matmul_peak_gflops": best_peak, "prefill": rows}
        del engines
    write_json(ns.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
