"""A step's batch layout in FlashInfer's paged-KV terms, and a pure-torch reading of them.

FlashInfer's batch wrappers (BatchPrefillWithPagedKVCacheWrapper / BatchDecodeWithPagedKVCacheWrapper,
"NHD" layout, the same [num_blocks, block_size, kv_heads, head_dim] pages chunkwise's KV cache
already has) are planned once per step from four int32 tensors, as FlashInfer's documentation
defines them:

- qo_indptr [R + 1]: request r's query rows are [qo_indptr[r], qo_indptr[r + 1]);
- paged_kv_indptr [R + 1] and paged_kv_indices: request r's pages, in order, are
  paged_kv_indices[paged_kv_indptr[r] : paged_kv_indptr[r + 1]];
- paged_kv_last_page_len [R]: how many slots of r's last page hold keys, in [1, page_size].

With causal=True the mask is aligned to the bottom-right corner: the last of r's q_len queries
sees all its keys, which is chunkwise's "query at position p sees keys 0..p" for a chunk at the
end of its context. `paged_attention_over_indices` computes attention from these tensors alone
(no block table, no BatchLayout), so a test can check on CPU that they describe exactly what the
torch backend reads, before any CUDA kernel is asked to read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BatchLayout


@dataclass(frozen=True)
class PagedKVIndices:
    qo_indptr: torch.Tensor  # [R + 1] int32
    paged_kv_indptr: torch.Tensor  # [R + 1] int32
    paged_kv_indices: torch.Tensor  # [sum of pages] int32
    paged_kv_last_page_len: torch.Tensor  # [R] int32
    page_size: int
    decode_only: bool  # every request has one query row: the decode wrapper applies


def paged_kv_indices(layout: BatchLayout) -> PagedKVIndices:
    """The FlashInfer plan tensors for one step, on the layout's device. Only the blocks covering
    each request's context are listed: padding in the block table is never named."""
    bs = layout.block_size
    device = layout.block_table.device
    pages = [layout.block_table[r, :nb] for r, nb in enumerate(layout.num_blocks)]
    kv_indptr = [0]
    for nb in layout.num_blocks:
        kv_indptr.append(kv_indptr[-1] + nb)
    for r, (nb, ctx) in enumerate(zip(layout.num_blocks, layout.context_lens)):
        if nb != -(-ctx // bs) or ctx < 1:
            raise ValueError(f"request {r}: {nb} blocks do not cover a context of {ctx} at block size {bs}")
    return PagedKVIndices(
        qo_indptr=torch.tensor(layout.query_start, dtype=torch.int32, device=device),
        paged_kv_indptr=torch.tensor(kv_indptr, dtype=torch.int32, device=device),
        paged_kv_indices=torch.cat(pages).to(torch.int32) if pages else torch.zeros(0, dtype=torch.int32, device=device),
        paged_kv_last_page_len=torch.tensor([(c - 1) % bs + 1 for c in layout.context_lens],
                                            dtype=torch.int32, device=device),
        page_size=bs,
        decode_only=all(n == 1 for n in layout.query_lens),
    )


def paged_attention_over_indices(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 idx: PagedKVIndices, scale: float) -> torch.Tensor:
    """Causal (bottom-right aligned) attention of q [T, H, D] over the pages the indices name;
    k_cache/v_cache [num_blocks, page_size, KVH, D]. The slow, obvious reading, for tests."""
    qo, kv_ptr = idx.qo_indptr.tolist(), idx.paged_kv_indptr.tolist()
    last = idx.paged_kv_last_page_len.tolist()
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    for r in range(len(last)):
        pages = idx.paged_kv_indices[kv_ptr[r] : kv_ptr[r + 1]].long()
        n_keys = (len(pages) - 1) * idx.page_size + last[r]
        k = k_cache[pages].flatten(0, 1)[:n_keys].repeat_interleave(group, dim=1).float()
        v = v_cache[pages].flatten(0, 1)[:n_keys].repeat_interleave(group, dim=1).float()
        q_r = q[qo[r] : qo[r + 1]].float()
        n_q = q_r.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q_r, k) * scale
        q_pos = torch.arange(n_keys - n_q, n_keys)[:, None]  # bottom-right: the last query sees every key
        scores = scores.masked_fill(torch.arange(n_keys)[None, :] > q_pos, float("-inf"))
        out[qo[r] : qo[r + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out
