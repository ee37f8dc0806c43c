"""The FlexAttention backend (issue 15's torch fallback for CUDA) on CPU: its block mask lists
exactly the blocks each query tile needs (each once, shared prefix blocks too), and its output
equals the naive reference and the torch backend, with large stale values in every slot no
request owns (finite, as a zero-initialised cache guarantees: FlexAttention multiplies masked
slots by a zero weight, and 0 x NaN is NaN), at block sizes 1, 4 and 16. Eager FlexAttention scores every slot and so checks the mask_mod; the
compiled one reads only the listed blocks and so checks the block mask's sparsity as well."""

from __future__ import annotations

import pytest
import torch

from executor_svc.attention import StepAttention, TorchAttentionBackend
from executor_svc.attention.flex_backend import Q_TILE, FlexAttentionBackend, paged_block_mask
from executor.test_attention import CHUNKS, DIM, HEADS, KV_HEADS, build_case, naive_attention

# More rows than one tile, so requests straddle tiles: a prompt, a chunk after a cached prefix,
# decodes, a fully cached prompt's last query, recomputed positions below kv_write_start.
MANY = CHUNKS + [(0, 150, 0), (40, 1, 40), (64, 30, 64)]


def _blocks(block_size):
    return 480 // block_size  # room for MANY's 388 positions, plus blocks nobody owns


def _stale_foreign_slots(layout, cache):
    """Slots no request owns hold values that would swamp any row whose softmax let them in."""
    bs = layout.block_size
    owned = {int(layout.block_table[r, p // bs]) * bs + p % bs
             for r, ctx in enumerate(layout.context_lens) for p in range(ctx)}
    k_flat, v_flat = cache.flat(0)
    foreign = torch.tensor(sorted(set(range(cache.num_slots)) - owned))
    k_flat[foreign], v_flat[foreign] = 50.0, 1e3


def _share_first_block(layout, r_from, r_to):
    """Request r_to's first block becomes r_from's (a prefix-cache hit in the same step)."""
    layout.block_table[r_to, 0] = layout.block_table[r_from, 0]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_block_mask_lists_each_needed_block_once(block_size):
    layout, cache, *_ = build_case(MANY, block_size, num_blocks=_blocks(block_size))
    _share_first_block(layout, 0, 5)
    step = FlexAttentionBackend(HEADS, KV_HEADS, DIM, compile=False).prepare(layout)
    mask = paged_block_mask(layout, cache.num_blocks, step.row_request, step.row_position)
    kv_num, kv_idx = mask.kv_num_blocks[0, 0], mask.kv_indices[0, 0]
    assert kv_num.shape[0] == -(-layout.num_tokens // Q_TILE) > 1
    for t in range(kv_num.shape[0]):
        listed = kv_idx[t, : kv_num[t]].tolist()
        assert len(listed) == len(set(listed))  # a block listed twice would be attended twice
        lo, hi = t * Q_TILE, min((t + 1) * Q_TILE, layout.num_tokens)
        want = set()
        for r in range(layout.num_requests):
            if layout.query_start[r] < hi and layout.query_start[r + 1] > lo:
                want |= set(layout.block_table[r, : layout.num_blocks[r]].tolist())
        assert set(listed) == want


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("block_size", [1, 4, 8, 16])
def test_flex_backend_matches_naive_and_torch_backend(block_size, compiled):
    if compiled and block_size == 1:
        pytest.skip("inductor's CPU FlexAttention template needs KV tiles of more than one slot")
    backend = FlexAttentionBackend(HEADS, KV_HEADS, DIM, compile=compiled)
    if compiled:
        torch._dynamo.reset()  # compiled for this shape, not eager past an earlier test's recompile limit
        # Where torch's compiled kernel differs from its own eager reference (block size 8 on an
        # AVX2-only CPU), the runner refuses the backend (test below); with the same mask in both,
        # a mistake of ours would pass this check and fail the comparison with the naive reference.
        why = backend.cpu_self_check(block_size, torch.float32)
        if why is not None:
            pytest.skip(f"refused by the runner on this CPU: {why}")
    layout, cache, q, k, v, fk, fv = build_case(MANY, block_size, num_blocks=_blocks(block_size), seed=7)
    _stale_foreign_slots(layout, cache)
    got = StepAttention(backend, cache, layout)(0, q, k, v)
    torch.testing.assert_close(got, naive_attention(q, fk, fv, layout), atol=1e-5, rtol=1e-5)
    want = StepAttention(TorchAttentionBackend(HEADS, KV_HEADS, DIM), cache, layout)(0, q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [4, 16])
def test_tight_kv_indices_as_on_cuda_match_naive(block_size, monkeypatch):
    """The kv_indices layout CUDA gets (rows only as wide as the widest tile), through the eager
    reference: the only way to run it on this CPU (inductor's CPU template wants full rows)."""
    from executor_svc.attention import flex_backend

    monkeypatch.setattr(flex_backend, "_tight_kv_indices", lambda device: True)
    layout, cache, q, k, v, fk, fv = build_case(MANY, block_size, num_blocks=_blocks(block_size), seed=7)
    _share_first_block(layout, 0, 5)
    _stale_foreign_slots(layout, cache)
    backend = FlexAttentionBackend(HEADS, KV_HEADS, DIM, compile=False)
    step = StepAttention(backend, cache, layout)
    got = step(0, q, k, v)
    width = step.prepared.block_mask.kv_indices.shape[-1]
    assert width < cache.num_blocks and width == int(step.prepared.block_mask.kv_num_blocks.max())
    want = StepAttention(TorchAttentionBackend(HEADS, KV_HEADS, DIM), cache, layout)(0, q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_block_at_two_logical_indices_is_refused():
    layout, cache, *_ = build_case(MANY, 4, num_blocks=_blocks(4))
    layout.block_table[5, 1] = layout.block_table[0, 0]  # req 0's block 0 as req 5's block 1
    step = FlexAttentionBackend(HEADS, KV_HEADS, DIM, compile=False).prepare(layout)
    with pytest.raises(ValueError, match="two different logical indices"):
        paged_block_mask(layout, cache.num_blocks, step.row_request, step.row_position)


def test_runner_through_flex_matches_transformers(tiny_llama_path):
    """The real model, compiled FlexAttention in every layer: a prompt in chunks, a prefix-cache
    hit whose chunks follow the cached blocks, and a decode riding along, logits against
    transformers at every position."""
    from model_fixtures import load_reference

    from .helpers import hf_logits, make_runner, run_chunked_cached_mixed
    from .test_chunked_prefill import ATOL

    torch._dynamo.reset()
    # Block size 4: one the compiled CPU kernel gets right on every CPU seen (8 is wrong on Zen 3).
    runner = make_runner(tiny_llama_path, block_size=4, num_kv_blocks=96, attention_backend="flex")
    assert runner.info.attention_backend == runner.info.decode_attention == "flex"
    d, checked = run_chunked_cached_mixed(runner)
    ref = load_reference(tiny_llama_path)
    for rid, start in checked:
        r = d.reqs[rid]
        end = max(r.logits) + 1
        torch.testing.assert_close(d.logits_matrix(rid, start, end), hf_logits(ref, r.tokens[:end])[start:end],
                                   atol=ATOL, rtol=0)
    assert len(d.reqs["dec"].outputs) == 5


def test_runner_refuses_flex_where_the_compiled_kernel_is_wrong(tiny_llama_path, monkeypatch):
    """The self-check is what stands between a wrong CPU kernel and wrong tokens: a compiled
    kernel that is off (here: its output scaled) makes initialize refuse, naming the flag and
    the block size."""
    from executor_svc.attention import flex_backend

    from .helpers import make_runner

    def off_by_a_little(*args, **kwargs):
        return flex_backend.flex_attention(*args, **kwargs) * 1.01

    monkeypatch.setattr(FlexAttentionBackend, "_compiled", lambda self, device: off_by_a_little)
    with pytest.raises(ValueError, match=r"--attention-backend flex cannot be used: inductor's CPU "
                                         r"FlexAttention kernel disagrees .* block size 4 .*35 probe rows"):
        make_runner(tiny_llama_path, block_size=4, num_kv_blocks=64, attention_backend="flex")
    runner = make_runner(tiny_llama_path, block_size=4, num_kv_blocks=64)  # torch, the default, is unaffected
    assert runner.info.attention_backend == "torch"


def test_auto_never_picks_flex_on_cpu_and_explicit_flex_is_checked(monkeypatch):
    import executor_svc.attention as attention
    from executor_svc.attention import select_backend

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    cls, reason = select_backend("auto", cpu, torch.float32, 64, 16)
    assert cls is TorchAttentionBackend and "paged decode kernel beats flex" in reason
    assert select_backend("flex", cpu, torch.float32, 64, 16)[0] is FlexAttentionBackend
    with pytest.raises(ValueError, match="flex cannot be used: on CPU it needs --block-size of at least 2"):
        select_backend("flex", cpu, torch.float32, 64, 1)
    # A CUDA host without FlashInfer or a flash-attn-compatible block size: flex if triton is there.
    monkeypatch.setattr(attention, "flashinfer_unavailable_reason", lambda *a: "flashinfer is not importable")
    monkeypatch.setattr(attention, "flash_attn_unavailable_reason", lambda *a: "block size 16 is not a multiple")
    monkeypatch.setattr(attention, "flex_attention_unavailable_reason", lambda *a: None)
    cls, reason = select_backend("auto", cuda, torch.bfloat16, 64, 16)
    assert cls is FlexAttentionBackend and "flashinfer is not importable" in reason and "block size 16" in reason
    monkeypatch.setattr(attention, "flex_attention_unavailable_reason", lambda *a: "triton is not importable")
    cls, reason = select_backend("auto", cuda, torch.bfloat16, 64, 16)
    assert cls is TorchAttentionBackend and "not using flex because triton is not importable" in reason


@pytest.mark.cuda
def test_flex_backend_on_cuda_matches_torch_backend():
    """Issue 15's fallback where it is meant to run: compiled to Triton, bf16, block size 16."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    layout, cache, q, k, v, fk, fv = build_case(MANY, 16, num_blocks=_blocks(16), device="cuda",
                                                dtype=torch.bfloat16, seed=7)
    got = StepAttention(FlexAttentionBackend(HEADS, KV_HEADS, DIM), cache, layout)(0, q, k, v)
    torch.testing.assert_close(got.float().cpu(), naive_attention(q, fk, fv, layout), atol=2e-2, rtol=2e-2)
