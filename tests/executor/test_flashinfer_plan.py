"""The FlashInfer plan tensors (issue 15, the part a CPU can check): built from a step's
BatchLayout, read back by a pure-torch attention that sees only those tensors, equal to the
torch backend's own reading of the block tables, for prompts, chunks after a cached prefix,
decodes, a fully cached prompt and recomputed positions, at block sizes 1, 4 and 16. A CUDA
test runs FlashInfer's own wrappers over the same tensors when a GPU and flashinfer are present."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from executor_svc.attention import StepAttention, TorchAttentionBackend
from executor_svc.attention.flashinfer_plan import paged_attention_over_indices, paged_kv_indices
from executor.test_attention import CHUNKS, DIM, HEADS, KV_HEADS, build_case, naive_attention


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_indices_describe_what_the_torch_backend_reads(block_size):
    layout, cache, q, k, v, fk, fv = build_case(CHUNKS, block_size, num_blocks=128)
    want = StepAttention(TorchAttentionBackend(HEADS, KV_HEADS, DIM), cache, layout)(0, q, k, v)
    idx = paged_kv_indices(layout)  # after the step's K/V were written, as a backend would plan
    k_cache, v_cache = cache.layers[0][0], cache.layers[0][1]
    got = paged_attention_over_indices(q, k_cache, v_cache, idx, DIM**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, naive_attention(q, fk, fv, layout), atol=1e-5, rtol=1e-5)


def test_index_tensors_by_hand():
    # Block size 4: contexts 13 (4 pages, 1 slot in the last), 23, 21, 32 (a full last page), 14.
    layout, *_ = build_case(CHUNKS, 4, num_blocks=128)
    idx = paged_kv_indices(layout)
    assert idx.qo_indptr.tolist() == [0, 13, 20, 21, 22, 31]
    assert idx.paged_kv_indptr.tolist() == [0, 4, 10, 16, 24, 28]
    assert idx.paged_kv_last_page_len.tolist() == [1, 3, 1, 4, 2]
    for r, nb in enumerate(layout.num_blocks):  # each request's own blocks, never the table's padding
        a, b = idx.paged_kv_indptr[r], idx.paged_kv_indptr[r + 1]
        assert idx.paged_kv_indices[a:b].tolist() == layout.block_table[r, :nb].tolist()
    assert all(t.dtype == torch.int32 for t in (idx.qo_indptr, idx.paged_kv_indptr, idx.paged_kv_indices))
    assert not idx.decode_only
    decode, *_ = build_case([(20, 1, 20), (3, 1, 3)], 4, num_blocks=16)
    assert paged_kv_indices(decode).decode_only


def test_a_layout_whose_blocks_do_not_cover_its_context_is_refused():
    layout, *_ = build_case(CHUNKS, 4, num_blocks=128)
    layout.num_blocks[0] -= 1
    with pytest.raises(ValueError, match="request 0: 3 blocks do not cover a context of 13"):
        paged_kv_indices(layout)


needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason="needs a CUDA device and the flashinfer package (has not run on a GPU yet)")
GPU_DIM = 64  # a head size FlashInfer's prebuilt kernels cover


@pytest.mark.cuda
@needs_flashinfer
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("decode_only", [False, True])
def test_flashinfer_backend_matches_the_torch_backend(block_size, decode_only):
    from executor_svc.attention import FlashInferBackend
    from executor_svc.kv_cache import KVCache

    chunks = [(20, 1, 20), (31, 1, 32), (3, 1, 3)] if decode_only else CHUNKS
    layout, cache, q, k, v, fk, fv = build_case(chunks, block_size, num_blocks=128, device="cuda",
                                                dtype=torch.bfloat16, dim=GPU_DIM)
    cache_t = KVCache(cache.shape, cache.num_blocks, cache.block_size, "cuda")
    for a, b in zip(cache_t.layers, cache.layers):
        a.copy_(b)
    got = StepAttention(FlashInferBackend(HEADS, KV_HEADS, GPU_DIM), cache, layout)(0, q, k, v)
    want = StepAttention(TorchAttentionBackend(HEADS, KV_HEADS, GPU_DIM), cache_t, layout)(0, q, k, v)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(cache.layers[0], cache_t.layers[0])  # the same writes, none into cached slots


def test_auto_prefers_flashinfer_then_flash_attn_then_torch_and_says_why(monkeypatch):
    import executor_svc.attention as attention
    from executor_svc.attention import FlashAttnBackend, FlashInferBackend, select_backend

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    # On this CPU: torch, naming why each CUDA backend was passed over.
    cls, reason = select_backend("auto", torch.device("cpu"), torch.float32, 64, 16)
    assert cls is TorchAttentionBackend
    assert "not using FlashInfer because device is cpu" in reason and "not using flash-attn" in reason
    with pytest.raises(ValueError, match="flashinfer cannot be used: device is cpu"):
        select_backend("flashinfer", torch.device("cpu"), bf16, 64, 16)
    # As a CUDA host would see it, with each package present or not.
    monkeypatch.setattr(attention, "flashinfer_unavailable_reason", lambda *a: None)
    monkeypatch.setattr(attention, "flash_attn_unavailable_reason", lambda *a: None)
    assert select_backend("auto", cuda, bf16, 64, 16)[0] is FlashInferBackend
    assert select_backend("flash-attn", cuda, bf16, 64, 256)[0] is FlashAttnBackend
    monkeypatch.setattr(attention, "flashinfer_unavailable_reason", lambda *a: "flashinfer is not importable")
    cls, reason = select_backend("auto", cuda, bf16, 64, 256)
    assert cls is FlashAttnBackend and "not using FlashInfer because flashinfer is not importable" in reason
    monkeypatch.setattr(attention, "flash_attn_unavailable_reason", lambda *a: "block size 16 is not a multiple")
    monkeypatch.setattr(attention, "flex_attention_unavailable_reason", lambda *a: "triton is not importable")
    cls, reason = select_backend("auto", cuda, bf16, 64, 16)
    assert cls is TorchAttentionBackend and "block size 16" in reason


def test_flashinfer_refuses_what_it_cannot_run():
    from executor_svc.attention import flashinfer_unavailable_reason

    assert "needs CUDA" in flashinfer_unavailable_reason(torch.device("cpu"), torch.bfloat16, 64)
    assert "float16 or bfloat16" in flashinfer_unavailable_reason(torch.device("cuda"), torch.float32, 64)
    assert "head_dim 80" in flashinfer_unavailable_reason(torch.device("cuda"), torch.bfloat16, 80)
