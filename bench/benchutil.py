"""Small helpers shared by the bench scripts (run as `python bench/NAME.py`, so this directory is
on sys.path)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path


def machine() -> dict:
    """What ran it: CPU model and family (this workplace's machines change between sessions: a
    Zen 4 has half a Zen 5's bf16 matmul rate), the flags that pick kernels, cores, load, and the
    host's speed when the result was written (`host_speed_ms`)."""
    info: dict = {"machine": platform.machine(), "cores": os.cpu_count(), "loadavg": os.getloadavg(),
                  "host_speed_ms": host_speed_ms()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    fields = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    info.update(model_name=fields.get("model name"), cpu_family=fields.get("cpu family"), model=fields.get("model"),
                flags=sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"}))
    return info


def host_speed_ms(repeats: int = 15) -> float:
    """The fastest of `repeats` timings of one fixed single-threaded Python loop, in ms: a yardstick
    for the host itself. This workplace's VMs report no steal time, yet the same code has run 2x
    slower on the same CPU model a few hours apart; a run's absolute numbers compare with another
    run's only where this matches (paired ratios within a run do not need it)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        total = 0
        for i in range(300_000):
            total += i * i % 7
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 2)


def spread(values: list[float]) -> dict:
    """Median, min, max and count of a set of values (times, rates, paired ratios)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def write_json(path: str | None, result: dict) -> None:
    """Write a benchmark's result file (if a path was given, with `machine()` added) and say where."""
    if not path:
        return
    result.setdefault("machine", machine())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


def name_compiled_kernels_in_profiles() -> None:
    """Wrap the calls of chunkwise's AOTInductor packages in record_functions named after them
    ("paged_decode_kernel", "prefill_softmax_kernel", "add_rms_norm_kernel", "rotary_kernel"): a
    package's calls are invisible to torch.profiler, so a profile would leave their time out of
    every operator (on an AMX Xeon ~200 ms of a 575 ms mixed step). Once per process; costs a
    few us a call."""
    import torch

    from executor_svc.attention.paged_decode import PagedDecodeKernel
    from executor_svc.attention.prefill_softmax import PrefillSoftmaxKernel
    from executor_svc.models.layer_ops import CompiledLayerOps

    for cls, method, label in ((PagedDecodeKernel, "__call__", "paged_decode_kernel"),
                               (PrefillSoftmaxKernel, "__call__", "prefill_softmax_kernel"),
                               (CompiledLayerOps, "add_rms_norm", "add_rms_norm_kernel"),
                               (CompiledLayerOps, "rotary", "rotary_kernel")):
        call = getattr(cls, method)
        if getattr(call, "_named_in_profiles", False):
            continue

        def recorded(self, *args, _call=call, _label=label, **kwargs):
            with torch.profiler.record_function(_label):
                return _call(self, *args, **kwargs)

        recorded._named_in_profiles = True  # type: ignore[attr-defined]
        setattr(cls, method, recorded)
