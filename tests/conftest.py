"""Shared pytest setup for chunkwise's tests.

Fixtures:
- `tiny_checkpoint(arch="llama", **config_overrides) -> Path` (session-scoped factory): a tiny
  random HF checkpoint, written once per distinct argument set and reused by every test.
- `tiny_llama_path`, `tiny_qwen2_path`: the default tiny Llama (GQA, untied) and Qwen2 (q/k/v
  biases, tied embeddings) checkpoints.

Tests marked `cuda` are skipped with a reason where torch sees no CUDA device. Tests under
tests/e2e and tests/reliability get the `e2e` marker (`make test-quick` leaves them out).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

# `make test` runs the suite in pytest-xdist workers. Each worker, and every executor its tests
# start, would otherwise run one OpenMP thread per core: with two workers that is twice as many
# spinning threads as cores, and a step stalls whenever a thread waits on one that is descheduled
# (measured: some e2e tests 5-10x slower, the suite barely faster). So the cores are shared out:
# set before torch is imported here, inherited by the processes the tests start.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS)))


def pytest_configure(config: pytest.Config) -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # transformers missing: the tests that need it fail on their own
        pass


_E2E_DIRS = ("e2e", "reliability")  # tests that start service processes (others elsewhere carry the marker themselves)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        parts = Path(item.path).resolve().relative_to(here).parts
        if parts and parts[0] in _E2E_DIRS:
            item.add_marker(pytest.mark.e2e)
    if not any(item.get_closest_marker("cuda") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: tiny_checkpoint(arch="llama", **config_overrides) -> checkpoint directory."""
    from model_fixtures import make_tiny_checkpoint

    made: dict[str, Path] = {}

    def make(arch: str = "llama", **overrides: Any) -> Path:
        key = json.dumps([arch, overrides], sort_keys=True, default=str)
        if key not in made:
            made[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_path(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_path(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("qwen2", tie_word_embeddings=True)
