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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
                    reason="needs a CUDA device and the flashinfer package (has not run on a GPU yet)")
@pytest.mark.parametrize("block_size", [1, 16])
def test_flashinfer_wrappers_over_the_indices_match_the_reference(block_size):
    import flashinfer

    layout, cache, q, k, v, fk, fv = build_case(CHUNKS, block_size, num_blocks=128, device="cuda",
                                                dtype=torch.bfloat16)
    StepAttention(TorchAttentionBackend(HEADS, KV_HEADS, DIM), cache, layout)(0, q, k, v)  # writes K/V
    idx = paged_kv_indices(layout)
    k_cache, v_cache = cache.layers[0][0], cache.layers[0][1]
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD")
    wrapper.plan(idx.qo_indptr, idx.paged_kv_indptr, idx.paged_kv_indices, idx.paged_kv_last_page_len,
                 HEADS, KV_HEADS, DIM, block_size, causal=True, q_data_type=torch.bfloat16)
    got = wrapper.run(q, (k_cache, v_cache))
    want = paged_attention_over_indices(q, k_cache, v_cache, idx, DIM**-0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
