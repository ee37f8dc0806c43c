"""glibc keeps what a CPU step frees (executor_svc/cpu_malloc.py): measured in page faults."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

import executor_svc.cpu_malloc as cpu_malloc

from .helpers import make_runner

# A step-like pattern in a fresh interpreter: 25 activations of 8 MiB each, written, then all freed,
# and the page faults of the second such step. Under glibc's defaults (thresholds of at most 32 and
# 64 MiB) the first step's 200 MiB went back to the kernel at its end, and the second step faults
# them in again (~51k faults). (Later steps may not: a small block left at the heap's top pins it,
# which is what makes a serving run's count vary, cpu_malloc.py.) Kept, the second step reuses
# the first step's pages.
STEPS = """
import resource, sys
import torch
if sys.argv[1] == "keep":
    from executor_svc.cpu_malloc import keep_freed_memory
    print(keep_freed_memory(), file=sys.stderr)
def step():
    xs = [torch.ones(2 << 20) for _ in range(25)]
    del xs
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_of_the_second_step(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_a_step_reuses_what_the_last_step_freed_instead_of_faulting_it_in_again():
    default, kept = faults_of_the_second_step("default"), faults_of_the_second_step("keep")
    assert default > 40000, default  # the pattern does fault under glibc's defaults (200 MiB)
    assert kept < 30000, kept  # measured 2k-16k: small blocks left between the big ones still move a few


def test_the_runner_keeps_freed_memory_on_cpu_unless_told_not_to(tiny_llama_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_malloc, "keep_freed_memory", lambda: calls.append(1) or "kept")
    make_runner(tiny_llama_path)
    assert calls == [1]
    make_runner(tiny_llama_path, cpu_keep_freed_memory=False)
    assert calls == [1]


def test_off_glibc_nothing_is_changed(monkeypatch):
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert cpu_malloc.keep_freed_memory().startswith("unchanged (the C library is unknown")
