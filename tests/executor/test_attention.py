"""Attention backends: the torch backend against a naive reference, backend selection, and the
flash-attn backend against the torch backend (CUDA + flash-attn only)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.attention import (
    BatchLayout,
    FlashAttnBackend,
    StepAttention,
    TorchAttentionBackend,
    select_backend,
)
from executor_svc.attention.paged_decode import (
    COMPILE_OPTIONS,
    VECTOR_BYTES,
    PagedDecodeKernel,
    decode_slots,
    group_by_length,
    package_path,
    paged_decode_reference,
    value_piece,
)
from executor_svc.attention.prefill_softmax import PrefillSoftmaxKernel, prefill_softmax_reference
from executor_svc.kv_cache import KVCache, KVCacheShape

# DIM spans several of the decode kernel's float32 value pieces on AVX2 (8) and AVX-512 (16) alike;
# 3 query heads a KV head, so that the kernel's fused loops over the query heads (3 sums) and over
# the value pieces (2 or 4) can be told apart in its C++.
HEADS, KV_HEADS, DIM = 6, 2, 32


def build_case(chunks, block_size, num_blocks, device="cpu", dtype=torch.float32, seed=0, dim=DIM):
    """chunks: [(num_computed, num_tokens, kv_write_start)]. Returns the layout, a cache holding
    random 'cached' KV for positions below kv_write_start, q/k/v for the batch, and the full
    per-request K/V sequences (cached part + this step's part) for the reference."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    cache = KVCache(KVCacheShape(1, KV_HEADS, dim, dtype), num_blocks, block_size, device)
    starts, tables, nbs, full_k, full_v, qs, ks, vs = [0], [], [], [], [], [], [], []
    write_rows, slots = [], []
    for computed, n, ws in chunks:
        end = computed + n
        nb = -(-end // block_size)
        blocks, perm = perm[:nb], perm[nb:]
        tables.append(torch.tensor(blocks))
        nbs.append(nb)
        kf = torch.randn(end, KV_HEADS, dim, generator=g)
        vf = torch.randn(end, KV_HEADS, dim, generator=g)
        k_flat, v_flat = cache.flat(0)
        for p in range(ws):  # the cached part already lives in the cache
            s = blocks[p // block_size] * block_size + p % block_size
            k_flat[s], v_flat[s] = kf[p].to(dtype), vf[p].to(dtype)
        for i, p in enumerate(range(computed, end)):
            if p >= ws:
                write_rows.append(starts[-1] + i)
                slots.append(blocks[p // block_size] * block_size + p % block_size)
        full_k.append(kf)
        full_v.append(vf)
        qs.append(torch.randn(n, HEADS, dim, generator=g))
        ks.append(kf[computed:end])
        vs.append(vf[computed:end])
        starts.append(starts[-1] + n)
    layout = BatchLayout(
        num_tokens=starts[-1], block_size=block_size, query_start=starts,
        num_computed=[c for c, _, _ in chunks], context_lens=[c + n for c, n, _ in chunks], num_blocks=nbs,
        block_table=torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        write_rows=torch.tensor(write_rows, dtype=torch.int64, device=device),
    )
    cat = lambda xs: torch.cat(xs).to(device=device, dtype=dtype)  # noqa: E731
    return layout, cache, cat(qs), cat(ks), cat(vs), full_k, full_v


def naive_attention(q, full_k, full_v, layout):
    out = []
    for r, (kf, vf) in enumerate(zip(full_k, full_v)):
        q_r = q[layout.query_start[r] : layout.query_start[r + 1]].float().cpu()
        k = kf.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = vf.repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_r, k) / DIM**0.5
        q_pos = torch.arange(layout.num_computed[r], layout.context_lens[r])[:, None]
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(out)


CHUNKS = [
    (0, 13, 0),  # a whole prompt
    (16, 7, 16),  # a chunk after a cached prefix
    (20, 1, 20),  # a decode
    (31, 1, 32),  # a fully cached prompt: one query, nothing written
    (5, 9, 8),  # recomputed positions 5..7 below kv_write_start
]


_KERNELS: dict[torch.dtype, PagedDecodeKernel] = {}


def paged_kernel(dtype=torch.float32) -> PagedDecodeKernel:
    """One compiled kernel per dtype for the whole test session (it serves every shape)."""
    if dtype not in _KERNELS:
        _KERNELS[dtype] = PagedDecodeKernel(HEADS, KV_HEADS, DIM, dtype, torch.device("cpu"), enforce_eager=False)
    kernel = _KERNELS[dtype]
    assert kernel.ready, kernel.reason
    return kernel


_SOFTMAX: list[PrefillSoftmaxKernel] = []


def softmax_kernel() -> PrefillSoftmaxKernel:
    """The compiled prefill softmax, one for the whole test session."""
    if not _SOFTMAX:
        _SOFTMAX.append(PrefillSoftmaxKernel(torch.device("cpu"), enforce_eager=False))
    assert _SOFTMAX[0].ready, _SOFTMAX[0].reason
    return _SOFTMAX[0]


def torch_backend(decode_path: str, dtype=torch.float32) -> TorchAttentionBackend:
    kernel = paged_kernel(dtype) if decode_path == "paged-inductor" else None
    backend = TorchAttentionBackend(HEADS, KV_HEADS, DIM, decode_kernel=kernel)
    assert backend.decode_path == decode_path
    return backend


DECODE_PATHS = ["sdpa-folded", "paged-inductor"]


@pytest.mark.parametrize("decode_path", DECODE_PATHS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_torch_backend_matches_naive_attention(block_size, decode_path):
    layout, cache, q, k, v, fk, fv = build_case(CHUNKS, block_size, num_blocks=128)
    out = StepAttention(torch_backend(decode_path), cache, layout)(0, q, k, v)
    torch.testing.assert_close(out, naive_attention(q, fk, fv, layout), atol=1e-5, rtol=1e-5)


LONG_CHUNKS = [
    (0, 23, 0),  # a whole prompt: its first piece is plain causal, the rest masked
    (16, 19, 16),  # a chunk after a cached prefix
    (5, 17, 8),  # recomputed positions 5..7 below kv_write_start
    (20, 1, 20),  # a decode
]


@pytest.mark.parametrize("piece_rows", [None, 3, 5, 8])
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_in_pieces_matches_naive_attention(block_size, piece_rows):
    # Every split of a chunk's query rows into pieces, each against keys up to its own last
    # position, gives the same attention as the reference.
    layout, cache, q, k, v, fk, fv = build_case(LONG_CHUNKS, block_size, num_blocks=128, seed=5)
    backend = TorchAttentionBackend(HEADS, KV_HEADS, DIM, prefill_piece_rows=piece_rows)
    step = StepAttention(backend, cache, layout)
    pieces = [[(p.q1 - p.q0, p.num_keys) for p in s.pieces] for s in step.prepared.prefills]
    if piece_rows is None:
        assert pieces == [[(23, 23)], [(19, 35)], [(17, 22)]]
    else:  # really in pieces: near-equal, none over piece_rows, each ending at its last position
        assert all(len(ps) == -(-n // piece_rows) for ps, n in zip(pieces, (23, 19, 17)))
        assert all(rows <= piece_rows for ps in pieces for rows, _ in ps)
        assert [ps[-1][1] for ps in pieces] == [23, 35, 22]
        rows, keys = pieces[0][0]
        assert rows == keys  # the whole prompt's first piece: positions 0..rows-1
    torch.testing.assert_close(step(0, q, k, v), naive_attention(q, fk, fv, layout), atol=1e-5, rtol=1e-5)


def test_prefill_pieces_at_the_default_size():
    # Chunks longer than PREFILL_PIECE_ROWS, as the seed's prompts are (637 tokens, 176 of them
    # a cached prefix), are split by default on CPU and stay exact.
    import executor_svc.attention.torch_backend as tb

    chunks = [(0, 2 * tb.PREFILL_PIECE_ROWS + 5, 0), (176, tb.PREFILL_PIECE_ROWS + 1, 176)]
    layout, cache, q, k, v, fk, fv = build_case(chunks, 16, num_blocks=128, seed=9)
    step = StepAttention(TorchAttentionBackend(HEADS, KV_HEADS, DIM), cache, layout)
    assert [len(s.pieces) for s in step.prepared.prefills] == [3, 2]
    torch.testing.assert_close(step(0, q, k, v), naive_attention(q, fk, fv, layout), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunks", [[(0, 1, 0)], [(4, 1, 4)], [(0, 1, 0), (0, 1, 0)], [(40, 1, 40)] * 3])
def test_paged_decode_handles_the_smallest_batches(chunks):
    # One row, one key, ... : the sizes a compiler specialises; padding must keep them exact.
    layout, cache, q, k, v, fk, fv = build_case(chunks, 16, num_blocks=32, seed=5)
    out = StepAttention(torch_backend("paged-inductor"), cache, layout)(0, q, k, v)
    torch.testing.assert_close(out, naive_attention(q, fk, fv, layout), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_paged_decode_serves_every_shape(threads):
    # Both thread counts, whatever this package's fixture or the suite's workers set: a served
    # executor runs the kernel's parallel loops on every core, and a race there shows only with two.
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_every_shape()
    finally:
        torch.set_num_threads(old_threads)


def _check_every_shape():
    kernel = paged_kernel()
    g = torch.Generator().manual_seed(1)
    # As in the executor: the cache is an ordinary tensor, the rest is made in inference mode.
    k_flat, v_flat = torch.randn(512, KV_HEADS, DIM, generator=g), torch.randn(512, KV_HEADS, DIM, generator=g)
    with torch.inference_mode():
        for lens in ([1], [3, 9], [100, 7, 64, 2, 31], list(range(1, 40))):
            table = torch.randint(0, 32, (len(lens), 8), generator=g)
            slots, lens_t = decode_slots(table, lens, 16)
            q = torch.randn(slots.shape[0], HEADS, DIM, generator=g)
            got = kernel(q, k_flat, v_flat, slots, lens_t, DIM**-0.5)
            torch.testing.assert_close(got, paged_decode_reference(q, k_flat, v_flat, slots, lens_t, DIM**-0.5),
                                       atol=1e-5, rtol=1e-5)
        # another cache size, and a model whose attention scale is not head_dim ** -0.5
        k_big, v_big = torch.randn(1000, KV_HEADS, DIM, generator=g), torch.randn(1000, KV_HEADS, DIM, generator=g)
        slots, lens_t = decode_slots(torch.randint(0, 62, (3, 4), generator=g), [50, 64, 9], 16)
        q = torch.randn(3, HEADS, DIM, generator=g)
        torch.testing.assert_close(kernel(q, k_big, v_big, slots, lens_t, 0.3),
                                   paged_decode_reference(q, k_big, v_big, slots, lens_t, 0.3), atol=1e-5, rtol=1e-5)


def _jit_compiled_cpp(options: dict) -> str:
    """The C++ inductor writes for the paged decode kernel when its sizes hints are 2 rows x 5 keys."""
    from torch._inductor.utils import fresh_cache, run_and_get_cpp_code

    fn = torch.compile(paged_decode_reference, dynamic=False, fullgraph=True, options=options)
    g = torch.Generator().manual_seed(2)
    k_flat, v_flat = torch.randn(64, KV_HEADS, DIM, generator=g), torch.randn(64, KV_HEADS, DIM, generator=g)
    q, slots, lens = torch.randn(2, HEADS, DIM, generator=g), torch.randint(0, 64, (2, 5), generator=g), \
        torch.tensor([5, 4])
    for t, dims in ((q, (0,)), (k_flat, (0,)), (v_flat, (0,)), (slots, (0, 1)), (lens, (0,))):
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(t, dim)
    with fresh_cache(), torch.inference_mode():
        _, code = run_and_get_cpp_code(fn, q, k_flat, v_flat, slots, lens, DIM**-0.5)
    torch._dynamo.reset()
    return code


def test_paged_decode_sums_the_values_of_all_pieces_in_one_pass():
    # The values' weighted sum comes in pieces one SIMD register wide (value_piece), so that the
    # compiler makes one loop over the keys with an accumulator per piece, not a loop each.
    code = paged_kernel().generated_cpp()
    pieces = -(-DIM // value_piece(torch.float32))
    assert pieces >= 2, "the test's head dim must span several pieces"
    assert re.search(_fused_sums(pieces), code), code


def test_paged_decode_loads_bf16_keys_and_values_a_full_register_at_a_time():
    # A value piece of a register's worth of floats would load half a register of bf16 values
    # per load, each a masked partial load (the kernel 1.2-1.6x slower, bench/RESULTS.md).
    code = paged_kernel(torch.bfloat16).generated_cpp()
    counts = re.findall(r"Vectorized<at::BFloat16>::loadu\([^;]*?static_cast<int64_t>\((\d+)L?\)\);", code)
    assert len(counts) >= 2, code  # the keys' loads and the values'
    assert set(counts) == {str(VECTOR_BYTES // 2)}, counts


def _fused_sums(n: int) -> str:
    """C++ of one loop with n sibling sums: exactly n accumulators declared together, then the loop."""
    vec = r"at::vec::Vectorized(?:N)?<float(?:,\d+)?>"  # one vector, or several (bf16 loads are wider)
    return r"\s*".join(rf"float tmp_acc{i} = 0;\s*{vec} tmp_acc{i}_vec = {vec}\(0\);" for i in range(n)) + r"\s*for\("


def test_paged_decode_scores_all_query_heads_of_a_kv_head_in_one_pass():
    # Each query head's scores are a sibling sum over the same keys, so that the compiler makes
    # one loop over a key's head dimension with an accumulator per query head, each key loaded
    # (and in bf16 converted) once for all of them, not once per query head.
    group = HEADS // KV_HEADS
    assert group != -(-DIM // value_piece(torch.float32)), "the two fused loops must differ in their sums"
    for dtype in (torch.float32, torch.bfloat16):
        assert re.search(_fused_sums(group), paged_kernel(dtype).generated_cpp())


def test_paged_decode_runs_every_loop_nest_in_parallel():
    # The compiler plans parallel loops from the example's sizes and keeps the plan for every
    # later size. The package's kernel runs every loop nest in parallel ...
    code = paged_kernel().generated_cpp()
    assert code.count("omp for") >= 4, code
    assert "omp single" not in code, code
    # ... and so does a kernel planned from a small batch, with the options the package is built
    # with; without them, the same small hints plan serial loops (what the options are for).
    small = _jit_compiled_cpp(COMPILE_OPTIONS)
    assert small.count("omp for") >= 4 and "omp single" not in small, small
    plain = _jit_compiled_cpp({})
    assert "omp single" in plain or "omp for" not in plain
    # Slot ids are bounds-checked once per step (check_slots), not at every load in the loops,
    # and never wrapped as if negative (the gathers are embedding lookups, see the reference).
    assert "index out of bounds" in plain and "index out of bounds" not in code
    assert " < 0;" not in code, code


def test_the_kernel_package_is_built_once_and_then_loaded():
    first = paged_kernel()
    again = PagedDecodeKernel(HEADS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), enforce_eager=False)
    assert again.ready and "loaded in" in again.reason and again.package == first.package
    # The package's name carries the geometry and dtype; another geometry is another package.
    assert package_path(HEADS, KV_HEADS, DIM, torch.bfloat16) != first.package
    assert package_path(HEADS, KV_HEADS, DIM + 8, torch.float32) != first.package
    assert first.package is not None and f"float32_{HEADS}x{KV_HEADS}x{DIM}_" in first.package.name


def test_loading_the_package_leaves_nothing_in_the_temp_dir(tmp_path, monkeypatch):
    # torch unpacks a package under $TMPDIR and deletes that only when the loader is destroyed,
    # which a killed executor never does: the unpacked files must be gone as soon as it loaded.
    first = paged_kernel()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    again = PagedDecodeKernel(HEADS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), enforce_eager=False)
    assert again.ready and "loaded in" in again.reason and again.package == first.package
    assert list(tmp_path.iterdir()) == []
    assert os.environ["TMPDIR"] == str(tmp_path)  # put back as it was
    # Still runs, and as the first load does.
    q, k, v = torch.randn(3, HEADS, DIM), torch.randn(64, KV_HEADS, DIM), torch.randn(64, KV_HEADS, DIM)
    slots, lens = torch.randint(0, 64, (3, 40)), torch.tensor([40, 17, 33])
    torch.testing.assert_close(again(q, k, v, slots, lens, DIM**-0.5), first(q, k, v, slots, lens, DIM**-0.5),
                               atol=0, rtol=0)


def test_a_damaged_package_is_rebuilt(tmp_path, monkeypatch, caplog):
    # Stand-in for the compiler: copies the real package into place. What is under test is what
    # happens around it: the damaged file is noticed, rebuilt under the lock, then loaded.
    import executor_svc.attention.paged_decode as pd

    good = paged_kernel().package
    other = paged_kernel(torch.bfloat16).package  # before the stand-in: it would copy fp32 code there
    built = []

    def fake_build(path, *geometry):
        built.append(path)
        shutil.copyfile(good, path)

    monkeypatch.setattr(pd, "_build", fake_build)
    target = package_path(HEADS, KV_HEADS, DIM, torch.float32, tmp_path)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"not a package")
    # Packages an older torch or kernel left behind: a build deletes those unused for a month.
    month_ago, week_ago = time.time() - 31 * 86400, time.time() - 7 * 86400
    stale, recent = target.with_name("paged_decode_float32_old.pt2"), target.with_name("paged_decode_bfloat16_new.pt2")
    for path, when in ((stale, month_ago), (recent, week_ago), (stale.with_suffix(".lock"), month_ago)):
        path.write_bytes(b"")
        os.utime(path, (when, when))
    kernel = PagedDecodeKernel(HEADS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), False, cache_dir=tmp_path)
    assert kernel.ready and "built in" in kernel.reason and built == [target], kernel.reason
    assert "does not load" in caplog.text
    assert not stale.exists() and recent.exists() and stale.with_suffix(".lock").exists()  # a lock may be held
    # Loading marks a package used, so a month without loads is what counts.
    os.utime(target, (month_ago, month_ago))
    kernel = PagedDecodeKernel(HEADS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), False, cache_dir=tmp_path)
    assert kernel.ready and "loaded in" in kernel.reason and len(built) == 1
    assert target.stat().st_mtime > week_ago
    # A package that loads but computes something else (here: bf16 code fed fp32 data, which the
    # package's runner does not notice) is refused by the warm-up check.
    shutil.copyfile(other, target)
    kernel = PagedDecodeKernel(HEADS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), False, cache_dir=tmp_path)
    assert not kernel.ready and "could not be built" in kernel.reason, kernel.reason


def test_slot_ids_outside_the_cache_are_refused_before_the_kernel_runs():
    PagedDecodeKernel.check_slots(torch.tensor([[0, 5], [7, 0]]), num_slots=8)
    for bad in (8, -1):
        with pytest.raises(IndexError, match=r"outside the cache \[0, 8\)"):
            PagedDecodeKernel.check_slots(torch.tensor([[0, bad], [7, 0]]), num_slots=8)


def test_paged_decode_bf16_within_bf16_rounding_of_fp32():
    # bf16 keeps 8 significant bits: each input is off by up to 2^-9 relative. The fp32 softmax
    # and accumulation add nothing comparable, so the output of a convex combination of values
    # in [-4, 4] is within a few bf16 ulps of the fp32 answer: 2^-9 * 4 * 4 bounds it loosely.
    chunks = [(n - 1, 1, n - 1) for n in (5, 17, 64, 200, 333)]
    layout, cache32, q, k, v, fk, fv = build_case(chunks, 16, num_blocks=128, seed=7)
    _, cache16, q16, k16, v16, _, _ = build_case(chunks, 16, num_blocks=128, dtype=torch.bfloat16, seed=7)
    want = naive_attention(q, fk, fv, layout)
    got = StepAttention(torch_backend("paged-inductor", torch.bfloat16), cache16, layout)(0, q16, k16, v16)
    err = (got.float() - want).abs().max().item()
    assert err <= 2**-9 * 16, err
    # and it is really bf16 arithmetic on bf16 data, not an fp32 result by accident
    assert got.dtype == torch.bfloat16 and err > 0


def test_enforce_eager_and_no_compiler_fall_back_with_a_reason(monkeypatch):
    eager = PagedDecodeKernel(HEADS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), enforce_eager=True)
    assert not eager.ready and "--enforce-eager" in eager.reason
    assert TorchAttentionBackend(HEADS, KV_HEADS, DIM, decode_kernel=eager).decode_path == "sdpa-folded"
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", "/nonexistent")
    missing = PagedDecodeKernel(HEADS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), enforce_eager=False)
    assert not missing.ready and "no C++ compiler" in missing.reason


@pytest.mark.parametrize("decode_path", DECODE_PATHS)
def test_torch_backend_batched_decodes_ignore_foreign_slots(monkeypatch, decode_path):
    # Many single-query rows of different context lengths, split into several padded groups;
    # every slot no request owns is NaN, so a padded key that leaked would poison the output.
    import executor_svc.attention.torch_backend as tb

    monkeypatch.setattr(tb, "DECODE_GROUP_MAX_KEYS", 64)
    chunks = [(n - 1, 1, n - 1) for n in (3, 17, 9, 30, 30, 2, 25, 8)] + [(0, 6, 0), (12, 1, 13)]
    layout, cache, q, k, v, fk, fv = build_case(chunks, 4, num_blocks=64, seed=3)
    owned = set()
    for r, ctx in enumerate(layout.context_lens):
        for p in range(ctx):
            owned.add(int(layout.block_table[r, p // 4]) * 4 + p % 4)
    k_flat, v_flat = cache.flat(0)
    foreign = torch.tensor(sorted(set(range(cache.num_slots)) - owned))
    k_flat[foreign], v_flat[foreign] = float("nan"), float("nan")
    step = StepAttention(torch_backend(decode_path), cache, layout)
    if decode_path == "sdpa-folded":
        assert len(step.prepared.decode_groups) > 2
    else:
        # rows of contexts 30, 30 | 25 | 17 | 13, 9, 8, 3, 2: a kernel call each, each padded to
        # its own longest context (the last one takes the rest: at most DECODE_GROUPS_MAX calls)
        calls = step.prepared.paged_decodes
        assert [(d.num_rows, d.slots.shape[1]) for d in calls] == [(2, 30), (1, 25), (1, 17), (5, 13)]
    out = step(0, q, k, v)
    torch.testing.assert_close(out, naive_attention(q, fk, fv, layout), atol=1e-5, rtol=1e-5)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 4000), max_size=64), st.sampled_from([0.5, 0.875, 1.0]), st.integers(1, 6))
def test_group_by_length_partitions_rows_into_groups_of_similar_length(lens, fill, max_groups):
    groups = group_by_length(lens, fill, max_groups)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))  # every row exactly once
    assert len(groups) <= max_groups and all(groups)
    flat = [lens[i] for g in groups for i in g]
    assert flat == sorted(flat, reverse=True)  # longest first, groups in order
    for n, g in enumerate(groups):
        longest, shortest = lens[g[0]], lens[g[-1]]
        if n < len(groups) - 1 or len(groups) < max_groups:
            assert shortest >= fill * longest
        if n > 0:  # a group starts only where the previous one could not take its first row
            assert lens[g[0]] < fill * lens[groups[n - 1][0]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 70), min_size=1, max_size=9), st.sampled_from([1, 4, 16]), st.integers(0, 2**16))
def test_decode_slots_name_only_the_rows_own_keys(lens, block_size, seed):
    # The kernel does not mask the values of padded keys (their weight is 0): that is safe only
    # because every slot a row names, padding included, is one of its own keys' slots.
    g = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // block_size)
    table = torch.randperm(len(lens) * width + 5, generator=g)[: len(lens) * width].view(len(lens), width)
    slots, lens_t = decode_slots(table, lens, block_size)
    assert slots.shape == (max(len(lens), 2), max(max(lens), 2)) and lens_t.shape == (slots.shape[0],)
    for b, n in enumerate(lens):
        own = [int(table[b, p // block_size]) * block_size + p % block_size for p in range(n)]
        assert slots[b, :n].tolist() == own and lens_t[b] == n
        assert set(slots[b, n:].tolist()) <= {own[-1]}
    for b in range(len(lens), slots.shape[0]):  # padding rows: one key, slot 0; their output is dropped
        assert lens_t[b] == 1 and slots[b, 0] == 0


def test_select_backend_on_cpu():
    cls, reason = select_backend("auto", torch.device("cpu"), torch.float32, 64, 16)
    assert cls is TorchAttentionBackend and "CUDA" in reason
    assert select_backend("torch", torch.device("cpu"), torch.float32, 64, None)[0] is TorchAttentionBackend
    with pytest.raises(ValueError, match="flash-attn cannot be used: device is cpu"):
        select_backend("flash-attn", torch.device("cpu"), torch.bfloat16, 64, 256)


def test_flash_attn_block_size_constraint_is_explicit():
    with pytest.raises(ValueError, match="multiple of 256"):
        FlashAttnBackend.check_block_size(16)
    FlashAttnBackend.check_block_size(256)
    FlashAttnBackend.check_block_size(512)
    # auto never picks flash-attn for an incompatible block size (checked before CUDA matters)
    from executor_svc.attention import flash_attn_unavailable_reason

    reason = flash_attn_unavailable_reason(torch.device("cuda"), torch.bfloat16, 64, 16)
    assert reason is not None and ("256" in reason or "flash_attn" in reason)


HAVE_FLASH = importlib.util.find_spec("flash_attn") is not None
needs_flash = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAVE_FLASH),
    reason="needs a CUDA device and the flash_attn package",
)


@pytest.mark.cuda
@needs_flash
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decode_only", [False, True])
def test_flash_attn_matches_torch_backend(dtype, decode_only):
    chunks = [(300, 1, 300), (511, 1, 512), (5, 1, 5)] if decode_only else \
        [(0, 300, 0), (256, 70, 256), (600, 1, 600), (511, 1, 512), (100, 200, 256)]
    layout, cache, q, k, v, fk, fv = build_case(chunks, 256, num_blocks=12, device="cuda", dtype=dtype)
    flash = FlashAttnBackend(HEADS, KV_HEADS, DIM)
    cache_t = KVCache(cache.shape, cache.num_blocks, cache.block_size, "cuda")
    for a, b in zip(cache_t.layers, cache.layers):
        a.copy_(b)
    got = StepAttention(flash, cache, layout)(0, q, k, v)
    want = StepAttention(TorchAttentionBackend(HEADS, KV_HEADS, DIM), cache_t, layout)(0, q, k, v)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(cache.layers[0], cache_t.layers[0])  # same writes


@pytest.mark.cuda
@needs_flash
def test_flash_attn_runner_matches_transformers(tiny_checkpoint):
    from chunkwise.plan import GREEDY, NewRequestData, ScheduledChunk, StepPlan
    from model_fixtures import load_reference

    from .helpers import hf_logits, make_runner, random_tokens

    path = tiny_checkpoint("llama")
    runner = make_runner(path, block_size=256, num_kv_blocks=4, device="cuda", dtype="bfloat16",
                         attention_backend="flash-attn")
    assert runner.info.attention_backend == "flash-attn"
    tokens = random_tokens(300, seed=5)
    runner.execute(StepPlan(1, new_requests=[NewRequestData("a", tokens, [2, 0], GREEDY)],
                            chunks=[ScheduledChunk("a", 0, 200, 0, False)]))
    _, logits = runner.execute_with_logits(StepPlan(2, chunks=[ScheduledChunk("a", 200, 100, 200, True)]))
    ref = hf_logits(load_reference(path), tokens)
    assert (logits["a"] - ref[200:]).abs().max() < 0.25


def test_bf16_prefill_takes_the_gemm_path_with_avx512_bf16_and_without_amx():
    from executor_svc.attention.torch_backend import prefill_gemm_pays

    assert prefill_gemm_pays(["avx512_bf16"])
    assert not prefill_gemm_pays(["avx512_bf16", "amx_bf16"])  # torch's flash kernel multiplies on AMX
    assert not prefill_gemm_pays(["amx_bf16"]) and not prefill_gemm_pays([])


@pytest.mark.parametrize("softmax", ["compiled", "eager"])
@pytest.mark.parametrize("piece_rows, max_keys", [(None, None), (5, None), (5, 30)])
def test_bf16_prefill_as_gemms_within_bf16_rounding_and_no_worse_than_sdpa(piece_rows, max_keys, softmax,
                                                                             monkeypatch):
    # The bf16 GEMM path (oneDNN's bf16 float32 mode: bf16 inputs, float32 sums and results)
    # against the float32 reference: as close as SDPA's bf16 kernel is, within a few bf16 ulps.
    # With max_keys 30 the 35-key chunk takes SDPA instead, the others the GEMMs.
    import executor_svc.attention.torch_backend as tb

    if max_keys is not None:
        monkeypatch.setattr(tb, "PREFILL_GEMM_MAX_KEYS", max_keys)
    chunks = LONG_CHUNKS + CHUNKS[:2]
    layout, _, q, k, v, fk, fv = build_case(chunks, 16, num_blocks=128, seed=11)
    _, cache16, q16, k16, v16, _, _ = build_case(chunks, 16, num_blocks=128, dtype=torch.bfloat16, seed=11)
    want = naive_attention(q, fk, fv, layout)
    softmax_calls: list[torch.Size] = []
    kernel = None
    if softmax == "compiled":  # the kernel, counting its calls
        kernel = softmax_kernel()
        monkeypatch.setattr(kernel, "_runner", _CountingRunner(kernel._runner, softmax_calls))
    gemm = TorchAttentionBackend(HEADS, KV_HEADS, DIM, prefill_bf16_gemm=True, prefill_softmax=kernel)
    assert gemm.prefill_path == ("bf16-gemm" if softmax == "compiled" else "bf16-gemm-eager-softmax")
    gemm.prefill_piece_rows = piece_rows
    sdpa = TorchAttentionBackend(HEADS, KV_HEADS, DIM, prefill_piece_rows=piece_rows)
    prefill_rows = torch.tensor([n > 1 for n in layout.query_lens]).repeat_interleave(torch.tensor(layout.query_lens))
    errs = {}
    calls: list[torch.Size] = []
    for name, backend in (("sdpa", sdpa), ("gemm", gemm)):  # each writes the same K/V into the cache
        if name == "gemm":  # which prefill rows reach SDPA on this path
            real_sdpa = torch.nn.functional.scaled_dot_product_attention
            monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                                lambda q_, *a, **kw: calls.append(q_.shape) or real_sdpa(q_, *a, **kw))
        got = StepAttention(backend, cache16, layout)(0, q16, k16, v16)
        assert got.dtype == torch.bfloat16
        errs[name] = (got.float() - want)[prefill_rows].abs().max().item()
    # SDPA's prefill calls have q [1, HEADS, rows, D] (decode rows' folded calls [n, KV_HEADS, ...]):
    # none, or only the 19 rows of the 35-key chunk past max_keys.
    assert sum(shape[2] for shape in calls if shape[1] == HEADS) == (0 if max_keys is None else 19), calls
    # Every GEMM piece's softmax went through the compiled kernel: [KV_HEADS x G x rows, keys] each.
    gemm_rows = sum(n for n in layout.query_lens if n > 1) - (0 if max_keys is None else 19)
    assert sum(shape[0] for shape in softmax_calls) == (HEADS * gemm_rows if softmax == "compiled" else 0)
    assert 0 < errs["gemm"] <= 2**-9 * 16, errs
    # No worse than SDPA (here 0.0080 vs 0.0104); rounding the weights to bf16 after normalising
    # them, or the GEMM's output before dividing, would make it 0.013.
    assert errs["gemm"] <= errs["sdpa"] + 2**-12, errs
    # The float32 matmul mode is put back: later float32 matmuls are exact again.
    assert torch.backends.mkldnn.matmul.fp32_precision != "bf16"


class _CountingRunner:
    """A package runner that records the shape of each call's first input."""

    def __init__(self, runner, calls: list):
        self.runner, self.calls = runner, calls

    def run(self, inputs):
        self.calls.append(inputs[0].shape)
        return self.runner.run(inputs)


@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_prefill_softmax_equals_the_reference(threads):
    # Every shape a piece brings, from the smallest (2 x 2) up, with the causal mask's -inf keys
    # (a row may see a single key), on one thread and two (the loops run in parallel).
    kernel = softmax_kernel()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(3)
    try:
        with torch.inference_mode():
            for rows, keys in ((2, 2), (3, 17), (864, 512), (57, 1000), (9, 4096)):
                products = torch.randn(rows, keys, generator=g) * 40
                visible = torch.randint(1, keys + 1, (rows,), generator=g)
                visible[0] = 1  # a row that sees a single key
                scale = 0.15
                (weights, sums) = kernel(products, visible, scale)
                want_w, want_s = prefill_softmax_reference(products, visible, scale)
                assert weights.shape == products.shape and sums.shape == (rows, 1)
                # The same math; only exp's last bit and the order of the sum's terms may differ.
                torch.testing.assert_close(weights, want_w, atol=2e-7, rtol=1e-6)
                torch.testing.assert_close(sums, want_s, atol=0, rtol=1e-6)
                # Masked keys weigh exactly 0, and the rest are the plain scaled softmax's.
                masked = torch.arange(keys)[None, :] >= visible[:, None]
                assert torch.equal(weights == 0, masked) and weights[0, 0] == 1
                plain = torch.softmax((products * scale).masked_fill(masked, float("-inf")), -1)
                torch.testing.assert_close(weights / sums, plain, atol=1e-6, rtol=1e-5)
    finally:
        torch.set_num_threads(old_threads)


def test_the_prefill_softmax_package_is_built_once_then_loaded_and_off_under_enforce_eager():
    first = softmax_kernel()
    again = PrefillSoftmaxKernel(torch.device("cpu"), enforce_eager=False)
    assert again.ready and "loaded in" in again.reason and again.package == first.package
    assert again.package is not None and again.package.name.startswith("prefill_softmax_")
    eager = PrefillSoftmaxKernel(torch.device("cpu"), enforce_eager=True)
    assert not eager.ready and "--enforce-eager" in eager.reason
    # A kernel that is not ready is not used: the backend says so.
    backend = TorchAttentionBackend(HEADS, KV_HEADS, DIM, prefill_bf16_gemm=True, prefill_softmax=eager)
    assert backend.prefill_softmax is None and backend.prefill_path == "bf16-gemm-eager-softmax"
    assert TorchAttentionBackend(HEADS, KV_HEADS, DIM, prefill_softmax=first).prefill_path == "sdpa"
