"""KV writes: every slot of a request's computed positions written exactly once, cached blocks
never touched, nothing else written; cache sizing and reallocation."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import executor_svc.attention.torch_backend as torch_backend
from chunkwise.plan import GREEDY, NewRequestData, ScheduledChunk, StepPlan
from executor_svc.config import ExecutorConfig
from executor_svc.engine import ModelRunner
from executor_svc.kv_cache import GIB, KVCacheShape

from .helpers import Driver, make_runner, random_tokens


@pytest.fixture
def recorded_writes(monkeypatch):
    """(layer tensor data_ptr, slot) for every KV write the torch backend makes."""
    writes: list[tuple[int, int]] = []
    real = torch_backend.write_kv

    def recording(layer_cache, k, v, slot_mapping, rows):
        writes.extend((layer_cache.data_ptr(), s) for s in slot_mapping.tolist())
        real(layer_cache, k, v, slot_mapping, rows)

    monkeypatch.setattr(torch_backend, "write_kv", recording)
    return writes


def slot(blocks: list[int], pos: int, bs: int) -> int:
    return blocks[pos // bs] * bs + pos % bs


def test_every_slot_written_exactly_once_and_cached_blocks_untouched(tiny_llama_path, recorded_writes):
    bs = 8
    runner = make_runner(tiny_llama_path, block_size=bs, num_kv_blocks=64)
    d = Driver(runner, seed=9)
    shared = random_tokens(32, seed=80)
    warm = d.add("warm", shared + random_tokens(6, seed=81))
    d.step({"warm": 13})
    d.step({"warm": None})
    cached_blocks = warm.blocks[:4]
    recorded_writes.clear()

    # Poison every slot except the cached blocks with NaN: a slot that should have been written
    # but was not stays NaN, and reading a never-written slot would make the logits NaN.
    snapshot = [layer[:, cached_blocks].clone() for layer in runner.kv_cache.layers]
    for layer in runner.kv_cache.layers:
        keep = layer[:, cached_blocks].clone()
        layer.fill_(float("nan"))
        layer[:, cached_blocks] = keep

    a = d.add("a", shared + random_tokens(27, seed=82), cached_blocks=cached_blocks)
    b = d.add("b", random_tokens(11, seed=83))
    d.step({"a": 9, "b": 4})
    d.step({"a": 8, "b": None})
    d.step({"a": None, "b": 1})
    for _ in range(3):
        d.step({"a": 1, "b": 1})

    # Expected: a writes positions [32, computed), b writes [0, computed).
    expected = {slot(a.blocks, p, bs) for p in range(32, a.computed)} | \
               {slot(b.blocks, p, bs) for p in range(0, b.computed)}
    ptrs = {layer.data_ptr() for layer in runner.kv_cache.layers}
    per_layer = Counter(ptr for ptr, _ in recorded_writes)
    assert set(per_layer) == ptrs
    for ptr in ptrs:
        slots = [s for p, s in recorded_writes if p == ptr]
        assert len(slots) == len(set(slots)), "a slot was written twice"
        assert set(slots) == expected

    # Memory agrees: exactly the expected slots hold finite values outside the cached blocks,
    # and the cached blocks are byte-identical to before.
    for layer, snap in zip(runner.kv_cache.layers, snapshot):
        assert torch.equal(layer[:, cached_blocks].view(torch.int32), snap.view(torch.int32))
        flat = layer.view(2, -1, *layer.shape[3:])
        finite = torch.isfinite(flat).all(dim=-1).all(dim=-1).all(dim=0)
        written = set(finite.nonzero().squeeze(1).tolist())
        cached_slots = {blk * bs + o for blk in cached_blocks for o in range(bs)}
        assert written - cached_slots == expected

    # And the outputs were not poisoned (no unwritten slot was ever read).
    assert all(torch.isfinite(row).all() for r in (a, b) for row in r.logits.values())


def test_block_shared_by_two_requests_in_one_step_is_written_once(tiny_llama_path, recorded_writes):
    # A scheduler may hand a block being computed by one request as a cache hit to another in
    # the same step; the executor writes the whole batch's KV before attending, so it works.
    bs = 8
    runner = make_runner(tiny_llama_path, block_size=bs, num_kv_blocks=16)
    prefix = random_tokens(16, seed=90)
    a_tokens = prefix + random_tokens(3, seed=91)
    b_tokens = prefix + random_tokens(5, seed=92)
    plan = StepPlan(1, new_requests=[NewRequestData("a", a_tokens, [5, 6, 7], GREEDY),
                                     NewRequestData("b", b_tokens, [5, 6, 9], GREEDY)],
                    chunks=[ScheduledChunk("a", 0, 19, 0, True), ScheduledChunk("b", 16, 5, 16, True)])
    _, logits = runner.execute_with_logits(plan)
    slots = [s for p, s in recorded_writes if p == runner.kv_cache.layers[0].data_ptr()]
    assert len(slots) == 19 + 5 == len(set(slots))

    solo = make_runner(tiny_llama_path, block_size=bs, num_kv_blocks=16)
    _, ref = solo.execute_with_logits(StepPlan(1, new_requests=[NewRequestData("b", b_tokens, [0, 1, 2], GREEDY)],
                                               chunks=[ScheduledChunk("b", 0, 21, 0, True)]))
    torch.testing.assert_close(logits["b"], ref["b"][16:], atol=1e-5, rtol=0)


def test_kv_cache_layout_and_single_allocation(tiny_llama_path):
    runner = make_runner(tiny_llama_path, block_size=8, num_kv_blocks=10)
    layers = runner.kv_cache.layers
    assert len(layers) == 2
    assert layers[0].shape == (2, 10, 8, 2, 16)  # [K/V, blocks, block_size, kv_heads, head_dim]
    ptrs = [t.data_ptr() for t in layers]
    d = Driver(runner)
    d.add("x", random_tokens(30, seed=1))
    d.step({"x": None})
    d.step({"x": 1})
    assert [t.data_ptr() for t in runner.kv_cache.layers] == ptrs  # no per-step reallocation


def test_kv_cache_sized_from_cpu_memory(tiny_llama_path):
    shape = KVCacheShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    per_block = shape.bytes_per_block(16)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4
    space = 0.001
    runner = ModelRunner(ExecutorConfig(model=str(tiny_llama_path), kv_cache_space=space, dtype="float32"))
    assert runner.initialize(16) == int(space * GIB) // per_block
    assert runner.kv_cache.nbytes <= space * GIB


def test_reinitialize_reallocates_and_drops_requests(tiny_llama_path):
    runner = make_runner(tiny_llama_path, block_size=8, num_kv_blocks=12)
    d = Driver(runner)
    d.add("x", random_tokens(10, seed=2))
    d.step({"x": None})
    assert runner.has_request("x")
    assert runner.initialize(4) == 12
    assert runner.block_size == 4 and runner.kv_cache.layers[0].shape[2] == 4
    assert runner.num_requests == 0
    runner.execute(StepPlan(2, new_requests=[NewRequestData("y", [5, 6], [0], GREEDY)],
                            chunks=[ScheduledChunk("y", 0, 2, 0, True)]))
    runner.reset()
    assert runner.num_requests == 0


def test_execute_before_initialize_is_an_error(tiny_llama_path):
    runner = ModelRunner(ExecutorConfig(model=str(tiny_llama_path), num_kv_blocks=4, dtype="float32"))
    with pytest.raises(RuntimeError, match="initialize"):
        runner.execute(StepPlan(1))
