"""glibc malloc settings that keep a CPU step's freed activations in the process for the next step.

torch has no caching allocator on CPU: every activation tensor is a malloc and a free. glibc serves
a block above its mmap threshold (128 KiB at first, raised dynamically up to 32 MiB as such blocks
are freed) with a fresh mmap, unmapped again at free, and returns the heap's free top to the kernel
once it exceeds the trim threshold (twice the mmap threshold). A step's activations (MiBs each at
prefill-sized batches) then often go back to the kernel at the end of one step, and the next step
faults them in again page by page, each page zeroed by the kernel. How often depends on which small
blocks happen to sit at the heap's top, so it varies from run to run: on the seed-shaped run in
float32 (bench/step_profile.py's workload, Zen 3) 13 of 15 runs took 0.3-3.2 million minor faults
(1.2-13 GB mapped and zeroed) and 1-11 s of system time each, in 49-67 s runs.

`keep_freed_memory` fixes both thresholds, which also stops glibc's dynamic adjustment: blocks
below MMAP_THRESHOLD come from the heap, and its free top is kept up to TRIM_THRESHOLD, so a step
reuses the pages the last one freed: at most 43 thousand faults a run, 0.1-1.0 s of system time
(bench/RESULTS.md, where the wall time is too: on a noisy day it did not separate from the noise).
It is called once the weights are loaded and packed, after `malloc_trim(0)` has returned what
loading freed, so the memory kept is the steps' working set, not the loader's.

Blocks above 32 MiB (glibc refuses a larger fixed threshold) are still mapped per use: activations
of models much larger than the default model's at 1024-row batches. vLLM's CPU documentation
recommends preloading tcmalloc (for faster allocation and better cache locality, in its words);
that needs a system library and an LD_PRELOAD set before the process starts, where these are
glibc's own documented `mallopt` parameters, set from inside the process. Off glibc (musl,
macOS) nothing is changed, and the reason is logged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# mallopt parameter numbers from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# The largest fixed mmap threshold glibc accepts on 64-bit (HEAP_MAX_SIZE / 2).
MMAP_THRESHOLD = 32 << 20
# Free memory at the heap's top kept for reuse before any is returned to the kernel.
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> str:
    """Return what loading freed to the kernel, then fix glibc's thresholds as above; a sentence
    saying what was done, or why nothing was (for the log)."""
    libc_name, _ = platform.libc_ver()
    if libc_name != "glibc":
        return f"unchanged (the C library is {libc_name or 'unknown'}, not glibc)"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
        ok = libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1
        ok = libc.mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1 and ok
    except (OSError, AttributeError) as e:
        return f"unchanged (glibc's mallopt could not be called: {e})"
    if not ok:
        return "glibc's defaults, or some of them (mallopt refused a threshold)"
    return (f"blocks under {mmap_threshold >> 20} MiB from the heap, and up to {trim_threshold >> 20} MiB "
            "of its freed top kept for the next step")
