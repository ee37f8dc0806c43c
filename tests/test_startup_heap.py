"""The start-up heap: collection paused while a service starts, then start-up's garbage collected
and the survivors frozen (chunkwise/startup_heap.py)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from chunkwise import startup_heap


class _Node:
    pass


@pytest.fixture
def restore_gc():
    yield
    gc.unfreeze()  # this test process keeps collecting its objects as before
    gc.enable()


def test_start_up_garbage_is_collected_and_the_survivors_frozen(restore_gc):
    before = gc.get_freeze_count()
    startup_heap.pause_collection()
    assert not gc.isenabled()
    garbage = _Node()
    garbage.self = garbage  # a cycle: only the cyclic collector frees it
    garbage_ref = weakref.ref(garbage)
    survivor = _Node()
    survivor.self = survivor
    del garbage
    frozen = startup_heap.freeze_startup_heap("test")
    assert gc.isenabled()
    assert garbage_ref() is None  # start-up's garbage was freed, not frozen for good
    # Frozen objects only leave the permanent generation (when freed, here or on another of this
    # process's threads), so the count can have dropped a little since, never grown.
    assert before < frozen and frozen - 1000 < gc.get_freeze_count() <= frozen
    assert gc.is_tracked(survivor) and survivor.self is survivor


def test_a_service_imports_neither_torch_nor_grpc_before_main_pauses_collection():
    """The services import their heavy modules inside main (after pause_collection): importing
    either __main__ module must load neither torch nor gRPC, or start-up pays for collections
    over torch's objects again."""
    import subprocess
    import sys

    code = ("import sys, executor_svc.__main__, scheduler_svc.__main__; "
            "print(sorted(m for m in ('torch', 'grpc', 'transformers') if m in sys.modules))")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
    assert out.strip() == "[]", out
