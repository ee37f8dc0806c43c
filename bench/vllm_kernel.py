"""vLLM's own C++ CPU paged-attention kernel as a plain function, to time chunkwise's against.

    bench/.venv-peers/bin/python bench/vllm_kernel.py      # self-check against a torch reference

Facts about vLLM 0.32.0 (CPU build), read from the installed package under
bench/.venv-peers/lib/python3.11/site-packages/vllm:
- The CPU attention backend is vllm/v1/attention/backends/cpu_attn.py (CPU_ATTN). It makes ONE
  kernel call per layer for the whole batch, decodes and prefill chunks alike (no decode/prefill
  split, no batch reordering): CPUAttentionBackendImpl.forward calls
  vllm._custom_ops.cpu_attention_with_kv_cache -> torch.ops._C.cpu_attention_with_kv_cache(query,
  key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal, alibi_slopes,
  sliding_window, block_table, softcap, scheduler_metadata, s_aux, dynamic_causal, k_scale,
  v_scale, kv_cache_dtype). A pure decode batch is the same call with every query length 1.
- Metadata, built once per step by CPUAttentionMetadataBuilder.build (same file):
  query_start_loc [R+1] int32 (cumulative query lengths), seq_lens [R] int32 (keys per request,
  *including* this step's queries), block_table [R, max_blocks] int32, causal=True, and
  scheduler_metadata = vllm._custom_ops.cpu_attn_get_scheduler_metadata ->
  torch.ops._C.get_scheduler_metadata(num_reqs, num_heads, num_kv_heads, head_dim, seq_lens, dtype,
  query_start_loc, causal, sliding_window_size=-1, isa, enable_kv_split, dynamic_causal=None,
  kv_cache_dtype="auto"); enable_kv_split is envs.VLLM_CPU_ATTN_SPLIT_KV (default 1).
  (The C++ side reads query_start_loc/seq_lens/block_table as int32, slot_mapping as int64.)
- KV cache: one tensor per layer [num_blocks, num_kv_heads, block_size, 2 * head_dim] (layout
  LBHNC), viewed as [num_blocks, num_kv_heads, 2 * block_size, head_dim] and chunk(2, dim=2)
  into key_cache / value_cache (strided views). Writes go through
  vllm._custom_ops.cpu_attn_reshape_and_cache -> torch.ops._C.cpu_attn_reshape_and_cache(key,
  value, key_cache, value_cache, slot_mapping, isa, k_scale, v_scale, kv_cache_dtype), called by
  CPUAttentionBackendImpl.do_kv_cache_update before forward. For the "vec"/"vec16" ISAs that op
  stores, per (block, kv head), K transposed as [head_dim, block_size] and V as
  [block_size, head_dim] (vLLM csrc/cpu/cpu_attn_vec.hpp, reshape_and_cache); "amx" packs
  differently, so this module only ever writes through the op.
- ISA: _get_attn_isa in cpu_attn.py picks "vec16" if head_dim % 32 != 0 and head_dim % 16 == 0;
  else "amx" if AMX tiles are available, dtype is bfloat16 and block_size % 32 == 0; else (x86)
  "vec" if block_size % 32 == 0; else "vec16". _choose_isa below follows the same rule. On this
  machine (AMD EPYC, avx512_bf16, no AMX) that gives "vec" for block sizes that are multiples of
  32 and "vec16" for block 16. vLLM's CPU platform defaults to block_size 128 and warns that
  sizes not a multiple of 32 are "not optimized"; the kernel asserts block_size % 16 (vec16) or
  % 32 (vec) == 0.
- The C extension is loaded as vllm/platforms/cpu.py CpuPlatform.import_kernels does on x86:
  `import vllm._C` when the CPU has avx512 + avx512_bf16, else vllm._C_AVX512 (avx512) or
  vllm._C_AVX2, whose import raises a harmless "does not define module export function"
  ImportError after registering the ops. The kernel parallelises with OpenMP over its threads.

Usage (from a script run with bench/.venv-peers/bin/python):
    import vllm_kernel
    if (why := vllm_kernel.available()) is None:
        att = vllm_kernel.VllmPagedAttention(H, KVH, D, block_size, num_blocks, torch.bfloat16)
        att.write(k, v, slots)                    # [N, KVH, D], [N, KVH, D], [N] int64
        att.prepare(query_lens, context_lens, block_table)   # once per step
        out = att.forward(q)                      # [T, H, D] -> [T, H, D]
"""

from __future__ import annotations

import math
import sys

import torch

_load_error: str | None = None
_loaded = False


def _load() -> str | None:
    global _load_error, _loaded
    if _loaded:
        return _load_error
    _loaded = True
    try:
        if torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported():
            import vllm._C  # noqa: F401
        else:
            name = "_C_AVX512" if torch.cpu._is_avx512_supported() else "_C_AVX2"
            try:
                __import__(f"vllm.{name}")
            except ImportError as e:
                if "does not define module export function" not in str(e):
                    raise
        # Linux lets a process use AMX tiles only after asking (arch_prctl XTILEDATA); oneDNN asks
        # when its first AMX matmul runs, which in vLLM's server comes before any attention. Here
        # the kernel may be the first AMX user: without this its "amx" ISA dies of SIGILL.
        if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
            raise RuntimeError("the kernel asked for AMX tiles and Linux refused them")
        for op in ("cpu_attention_with_kv_cache", "get_scheduler_metadata",
                   "cpu_attn_reshape_and_cache"):
            if not hasattr(torch.ops._C, op):
                raise RuntimeError(f"torch.ops._C.{op} not registered")
    except Exception as e:  # noqa: BLE001 - any failure means "not available"
        _load_error = f"vLLM CPU attention kernel not loadable: {e!r}"
    return _load_error


def available() -> str | None:
    """None if vLLM's CPU attention kernel can be loaded, else the reason."""
    return _load()


def _choose_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The ISA vLLM's _get_attn_isa would pick on an x86 CPU (see module docstring)."""
    if head_dim % 32 != 0 and head_dim % 16 == 0:
        return "vec16"
    if torch.cpu._is_amx_tile_supported() and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


class VllmPagedAttention:
    """One layer's KV cache in vLLM's CPU layout plus the kernel call over a whole batch."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_blocks: int, dtype: torch.dtype, isa: str | None = None,
                 split_kv: bool | None = None):
        if (why := _load()) is not None:
            raise RuntimeError(why)
        self.h, self.kvh, self.d, self.bs = num_heads, num_kv_heads, head_dim, block_size
        self.dtype = dtype
        self.isa = isa or _choose_isa(dtype, block_size, head_dim)
        if split_kv is None:
            from vllm import envs
            split_kv = bool(envs.VLLM_CPU_ATTN_SPLIT_KV)
        self.split_kv = split_kv
        self.scale = 1.0 / math.sqrt(head_dim)
        self.kv_cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_dim,
                                    dtype=dtype)
        halves = self.kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, head_dim)
        self.key_cache, self.value_cache = halves.chunk(2, dim=2)
        self._meta: tuple | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store k[i], v[i] ([N, KVH, D]) at slot slots[i] (= block * block_size + offset)."""
        torch.ops._C.cpu_attn_reshape_and_cache(
            k.to(self.dtype).contiguous(), v.to(self.dtype).contiguous(), self.key_cache,
            self.value_cache, slots.to(torch.int64).contiguous(), self.isa, 1.0, 1.0, "auto")

    def prepare(self, query_lens: list[int], context_lens: list[int],
                block_table: torch.Tensor) -> None:
        """Per-step metadata: request r has query_lens[r] query rows, the last positions of its
        context_lens[r] keys (which must already be in the cache), in block_table[r]."""
        assert len(query_lens) == len(context_lens) == block_table.shape[0]
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        seq_lens = torch.tensor(context_lens, dtype=torch.int32)
        sched = torch.ops._C.get_scheduler_metadata(
            len(query_lens), self.h, self.kvh, self.d, seq_lens, self.dtype, qsl, True, -1,
            self.isa, self.split_kv, None, "auto")
        self._meta = (qsl, seq_lens, block_table.to(torch.int32).contiguous(), sched,
                      int(qsl[-1]))

    def forward(self, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [T, H, D] over the prepared batch; returns [T, H, D] in q's dtype."""
        assert self._meta is not None, "call prepare() first"
        qsl, seq_lens, blt, sched, t = self._meta
        assert q.shape == (t, self.h, self.d) and q.dtype == self.dtype and q.stride(2) == 1
        if out is None:
            out = torch.empty_like(q)
        torch.ops._C.cpu_attention_with_kv_cache(
            q, self.key_cache, self.value_cache, out, qsl, seq_lens, self.scale, True, None, -1,
            blt, 0.0, sched, None, None, 1.0, 1.0, "auto")
        return out


# ---------------------------------------------------------------- self-check


def _reference(q, kpool, vpool, query_lens, context_lens, block_table, bs):
    """float32 causal attention with explicit per-request gathers from a [slots, KVH, D] pool."""
    h, kvh, d = q.shape[1], kpool.shape[1], q.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    start = 0
    for r, (ql, cl) in enumerate(zip(query_lens, context_lens)):
        pos = torch.arange(cl)
        slots = block_table[r, pos // bs] * bs + pos % bs
        k, v = kpool[slots].float(), vpool[slots].float()         # [cl, KVH, D]
        for i in range(ql):
            n = cl - ql + i + 1                                  # keys visible to this row
            for hh in range(h):
                g = hh // (h // kvh)
                s = (q[start + i, hh].float() @ k[:n, g].T) / math.sqrt(d)
                out[start + i, hh] = torch.softmax(s, dim=0) @ v[:n, g]
        start += ql
    return out


def _check(dtype, block_size, query_lens, context_lens, gen) -> tuple[float, str]:
    h, kvh, d = 9, 3, 64
    need = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(need), max(need), dtype=torch.int64)
    used = 0
    for r, nb in enumerate(need):
        table[r, :nb] = perm[used:used + nb]
        used += nb
    kpool = torch.randn(num_blocks * block_size, kvh, d, generator=gen).to(dtype)
    vpool = torch.randn(num_blocks * block_size, kvh, d, generator=gen).to(dtype)
    q = torch.randn(sum(query_lens), h, d, generator=gen).to(dtype)
    att = VllmPagedAttention(h, kvh, d, block_size, num_blocks, dtype)
    att.write(kpool, vpool, torch.arange(num_blocks * block_size))
    att.prepare(query_lens, context_lens, table)
    got = att.forward(q).float()
    want = _reference(q, kpool, vpool, query_lens, context_lens, table, block_size)
    return (got - want).abs().max().item(), att.isa


def main() -> int:
    if (why := available()) is not None:
        print(why)
        return 2
    gen = torch.Generator().manual_seed(0)
    decode_ctx = [37, 58, 81, 100]
    cases = {
        "decode": ([1] * 4, decode_ctx),
        "mixed": ([1] * 4 + [20], decode_ctx + [33 + 20]),   # chunk of 20 after 33 cached keys
        "mixed, prefill first": ([20] + [1] * 4, [53] + decode_ctx),
    }
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        for block_size in (16, 32):
            for name, (ql, cl) in cases.items():
                err, isa = _check(dtype, block_size, ql, cl, gen)
                good = err <= tol[dtype]
                ok &= good
                print(f"{str(dtype):15} block {block_size:3} isa {isa:6} {name:21} "
                      f"max abs diff {err:.2e} {'ok' if good else 'FAIL'}")
    print("all ok" if ok else "SELF-CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
