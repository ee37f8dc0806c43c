"""Kernels compiled ahead of time by AOTInductor and kept as packages in the chunkwise cache.

A `torch.compile` kernel costs every executor start ~4 s even with a warm inductor cache
(importing dynamo and inductor, tracing, guards); a package loads in milliseconds through
torch's C++ loader, without importing either (bench/RESULTS.md). So each compiled kernel
(attention/paged_decode.py, attention/prefill_softmax.py, models/layer_ops.py) is exported once with dynamic sizes, compiled into a package
named by a hash of everything its code depends on, built once per machine (one process at a time,
under a lock) and loaded by every later start. A build deletes packages of the same kind that no
start has loaded for PACKAGE_MAX_IDLE_DAYS.

What each kernel module supplies: its package's name prefix and key, a `build(path)` that exports
and compiles, and a warm-up check of the loaded runner against its eager reference.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("chunkwise.executor.kernels")

# Packages nobody has loaded for this long are deleted when a new one of their kind is built:
# every change of torch, of a kernel's source or of the CPU leaves one behind (~1.5 MB each). Age
# rather than "every other name", so two chunkwise versions sharing a cache do not delete each other's.
PACKAGE_MAX_IDLE_DAYS = 30


def use_chunkwise_inductor_cache() -> None:
    """Point inductor's on-disk cache under the chunkwise cache root (not /tmp) unless
    $TORCHINDUCTOR_CACHE_DIR is set, so that a rebuild and other compiled code reuse it.

    Call it before anything imports torch._inductor: that import sets the variable to inductor's
    default (/tmp/torchinductor_<user>) when it is unset, and from then on this cannot tell
    torch's value from the user's, so it leaves the variable alone."""
    from chunkwise.model_source import cache_root

    if "torch._inductor" not in sys.modules:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))


def compiler_unavailable_reason(device: torch.device) -> str | None:
    """None if inductor can build CPU kernels here, else why not."""
    if device.type != "cpu":
        return f"the compiled kernels are built for CPU only (device {device})"
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None and shutil.which("c++") is None and shutil.which("clang++") is None:
        return f"no C++ compiler found ({cxx}, c++ or clang++ on PATH), which inductor needs"
    return None


def not_compiled_reason(device: torch.device, enforce_eager: bool) -> str | None:
    """Why a compiled kernel is not used here (--enforce-eager, no compiler), or None."""
    return "--enforce-eager" if enforce_eager else compiler_unavailable_reason(device)


def start_kernels(what: str, fallback: str, device: torch.device, enforce_eager: bool,
                  load: Callable[[], str]) -> tuple[bool, str]:
    """The start-up every compiled-kernel class shares: unless compiling is off here, run `load`
    (load or build the class's packages and check them; it returns how they came, as
    `load_or_build` says it). Returns (True, "<how> in <seconds> s") or (False, why not, ending
    with `fallback`, the path the caller takes instead). A failure is logged as a warning."""
    why = not_compiled_reason(device, enforce_eager)
    if why is not None:
        return False, f"{why}: {fallback}"
    t0 = time.perf_counter()
    try:
        how = load()
    except Exception as e:  # a broken toolchain shows up here as any kind of error
        reason = f"{what} could not be built ({type(e).__name__}: {str(e)[:200]}): {fallback}"
        logger.warning("%s", reason)
        return False, reason
    return True, f"{how} in {time.perf_counter() - t0:.1f} s"


def package_path(prefix: str, key: dict[str, Any], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the package `prefix`_<hash>.pt2 lives. The hash covers `key` (the kernel's source,
    options, geometry), torch, and the CPU: inductor compiles with -march=native, so a cache
    shared with another kind of CPU must not hand it instructions it lacks."""
    from chunkwise.model_source import cache_root

    full = dict(key, torch=torch.__version__, isa=torch.backends.cpu.get_cpu_capability(), cpu=_cpu_signature())
    digest = hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root(cache_dir) / "kernels" / f"{prefix}_{digest}.pt2"


def _cpu_signature() -> str:
    """The CPU's model and instruction-set flags (Linux), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.split(":")[0].strip() in ("model name", "flags", "Features")]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def compile_to_package(program: Any, path: Path, options: dict[str, Any]) -> None:
    """AOTInductor-compile an exported program and write the package to `path` (atomically: a
    reader never sees half a file)."""
    import torch._inductor

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")
    try:
        # A copy of the options: inductor adds its own settings to the dict.
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp), inductor_configs=dict(options))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@functools.cache
def scalar_tensor(value: float) -> torch.Tensor:
    """`value` as a 0-d float32 tensor, made once per value: the packages take scalars that differ
    between models (the attention scale, RMSNorm's epsilon) as inputs, so that one package serves
    every model with the same shapes."""
    return torch.tensor(value, dtype=torch.float32)


def load(path: Path) -> Any:
    """The runner of the package at `path`: `.run([tensors]) -> [tensors]`."""
    # torch's own loader for AOTInductor packages: what torch._inductor.aoti_load_package
    # wraps, minus the pytree handling of inputs and outputs (plain lists here) and minus the
    # import of inductor and dynamo it drags in (1.7 s). Arguments: model name in the package,
    # not single-threaded, one runner, device index -1 (CPU).
    #
    # The loader unpacks the package into $TMPDIR/aotinductor_XXXXXX and deletes that only in
    # its destructor, which an executor that is killed, or exits without collecting it, never
    # runs: 1.6 MB left in /tmp per executor start (247 of them on the test machine). Once
    # loaded, the shared library is mapped and the files are not read again, so the package is
    # unpacked into a directory of ours, deleted right after. TMPDIR is process-wide: this runs
    # at start-up, before the server takes calls, and Python's tempfile has read it already.
    with tempfile.TemporaryDirectory(prefix="chunkwise-kernel-") as unpack_dir:
        before = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = unpack_dir
        try:
            return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        finally:
            if before is None:
                del os.environ["TMPDIR"]
            else:
                os.environ["TMPDIR"] = before


def _load_existing(path: Path) -> Any | None:
    """The package at `path` loaded, or None if there is none or it does not load (damaged, or
    written by an incompatible torch: the caller builds it again, and the rename replaces it)."""
    if not path.exists():
        return None
    try:
        return load(path)
    except Exception as e:
        logger.warning("kernel package %s does not load (%s); building it again", path, e)
        return None


def load_or_build(path: Path, build: Callable[[Path], None], what: str, prefix: str) -> tuple[Any, str]:
    """The loaded package at `path` and "loaded" or "built", running `build(path)` first if there
    is none (or it will not load). One process builds at a time; the others wait on the lock,
    then load what it wrote. A build deletes idle packages named `prefix`_*.pt2."""
    from chunkwise.model_source import exclusive_lock

    runner = _load_existing(path)
    if runner is not None:
        _mark_used(path)
        return runner, "loaded"
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(path.with_suffix(".lock"), f"building the {what}"):
        runner = _load_existing(path)  # another process may have built it while this one waited
        if runner is not None:
            return runner, "loaded"
        logger.info("building the %s for %s (once per machine and model geometry)", what, path.name)
        use_chunkwise_inductor_cache()  # before `build` imports torch._inductor
        build(path)
        prune_idle_packages(path.parent, keep=path, prefix=prefix)
        return load(path), "built"


def _mark_used(path: Path) -> None:
    """A package's modification time says when it was last loaded (what pruning goes by)."""
    try:
        os.utime(path)
    except OSError:  # a read-only cache still serves
        pass


def prune_idle_packages(directory: Path, keep: Path, prefix: str,
                        max_idle_days: float = PACKAGE_MAX_IDLE_DAYS) -> list[Path]:
    """Delete the packages `prefix`_*.pt2 in `directory`, other than `keep`, not loaded for
    `max_idle_days`; returns what was deleted. Their lock files (empty) stay: a process may hold one."""
    cutoff = time.time() - max_idle_days * 86400
    pruned = []
    for old in directory.glob(f"{prefix}_*.pt2"):
        try:
            if old != keep and old.stat().st_mtime < cutoff:
                old.unlink()
                pruned.append(old)
        except OSError:  # gone already, or not ours to delete
            continue
    if pruned:
        logger.info("deleted %d kernel package(s) unused for %g days: %s", len(pruned), max_idle_days,
                    ", ".join(p.name for p in pruned))
    return pruned
