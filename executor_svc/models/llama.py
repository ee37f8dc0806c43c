"""A compact Llama-family decoder for serving: flattened tokens in, hidden states out.

The batch is one flat sequence of T tokens from many requests (prefill chunks and decodes mixed);
every linear layer runs once over all T rows. Attention is the only per-request operation and is
delegated to an `attend(layer_idx, q, k, v)` callable supplied per step by the engine (which owns
the paged KV cache and the attention backend), so this module knows nothing about blocks.

q/k/v and gate/up projections are fused into single matmuls; the loader slices the checkpoint's
separate tensors into them. On CPU, once loaded, every linear weight (and lm_head) is repacked
for oneDNN (`pack_linear_weights`, packed_linear.py; as float32 copies of bf16 weights where the
CPU has no bf16 matmul), and may keep its plain weight too, for prefill-sized batches; the MLP's
gate/up weight is packed as two halves whose matmuls apply silu * up in their epilogues
(`GateUpSiluMul`). Numerics follow the HF reference: RMSNorm in float32 then cast back, RoPE
angles in float32, logits returned as float32.

The residual stream and its normed copy travel together between layers: each residual add is
one op with the RMSNorm after it (the next layer's input norm, or the final norm), so that with
compiled element-wise ops (layer_ops.py; the engine sets `layer_ops`) it is one kernel, and so
is RoPE.

With tensor parallelism (`tp`, see executor_svc/parallel.py) each rank holds num_heads / N query
heads, num_kv_heads / N KV heads and intermediate_size / N of the MLP: q/k/v and gate/up are
sliced by output rows, o_proj and down_proj by input columns and summed over the ranks with one
all-reduce each (their biases, if any, live on rank 0 only, so the sum counts them once).
Embeddings, norms and lm_head are replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import SINGLE, TPGroup
from . import packed_linear
from .layer_ops import EAGER, LayerOps, rms_norm_reference
from .rope import RotaryEmbedding
from .spec import ModelSpec

# attend(layer_idx, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> [T, H, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by the loader (which checks that).
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _param((out_features, in_features), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's layout, once pack() ran
        self.packed_bias: torch.Tensor | None = None  # the bias in the packed weight's dtype
        # With a packed copy: batches of at least this many rows still go to F.linear on the plain
        # weight, which is then kept (0: the packed copy serves every batch, the plain one is freed).
        self.plain_min_rows = 0

    def pack(self, plain_min_rows: int = 0, widen: bool = True, rows_hint: int = packed_linear.ROWS_HINT) -> bool:
        """Copy the weight into oneDNN's prepacked layout (packed_linear.py) and free the plain
        copy, unless `plain_min_rows` keeps it for batches of that many rows and more; False
        (nothing changed) where packing is not possible. `widen`, `rows_hint`: see packed_linear.pack."""
        if not self._pack_copies(widen, rows_hint):
            return False
        assert self.packed is not None
        if self.packed.dtype != self.weight.dtype:
            plain_min_rows = 0  # a widened copy is the fast one at every batch size
        self.plain_min_rows = plain_min_rows
        if not plain_min_rows:
            self.weight.data = self.weight.data.new_empty(0)  # only the packed copy is read from now on
        return True

    def _pack_copies(self, widen: bool, rows_hint: int) -> bool:
        packed = packed_linear.pack(self.weight, self.bias, widen, rows_hint)
        if packed is None:
            return False
        self.packed = packed
        # Converted once here, not in every call (it is the bias itself when the dtypes agree).
        self.packed_bias = None if self.bias is None else self.bias.to(packed.dtype)
        return True

    def packed_copies(self) -> list[torch.Tensor]:
        return [] if self.packed is None else [self.packed]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and not (self.plain_min_rows and x.shape[0] >= self.plain_min_rows):
            return packed_linear.linear(x, self.packed, self.packed_bias)
        return F.linear(x, self.weight, self.bias)


class GateUpSiluMul(Linear):
    """An MLP's gate and up projections as one [2n, in] weight (gate rows first), returning
    silu(gate) * up [T, n], the MLP's activation included.

    Packed in bf16 (CPU), the halves are packed apart and multiplied as two matmuls whose
    epilogues do the element-wise work (packed_linear.silu_mul): on a Xeon with AMX 1.14-1.21x
    faster than the [T, 2n] matmul with eager silu and mul after it at 32-1024 rows in
    isolation, the seed workload's mixed steps 1.04x (bench/RESULTS.md section 2b). In float32
    (and float32 copies of bf16 weights) it was no faster over the workload (decode-sized batches
    5% slower, prefill-sized ones faster), and fp16 is unmeasured, so there, as everywhere else
    (no packing, a refused pair, or the plain weight kept for large batches), one matmul and then
    silu * up."""

    def __init__(self, in_features: int, intermediate: int, bias: bool, dtype: torch.dtype, device: torch.device):
        super().__init__(in_features, 2 * intermediate, bias, dtype, device)
        self.intermediate = intermediate
        # With the halves packed apart: `packed` is the gate's, these the up projection's.
        self.up_packed: torch.Tensor | None = None
        self.up_packed_bias: torch.Tensor | None = None

    def _pack_copies(self, widen: bool, rows_hint: int) -> bool:
        # `rows_hint` is not taken: gate/up stay packed for ROWS_HINT rows, as the one-row layout
        # that splits the other layers' prefill-sized batches over the threads with AMX gained
        # nothing here (packed_linear.AMX_BF16_LAYER_ROWS_HINT).
        hint = packed_linear.ROWS_HINT
        bf16 = self.weight.dtype == torch.bfloat16
        pair = packed_linear.pack_silu_mul(self.weight, self.bias, False, hint) if bf16 else None
        if pair is None:  # the whole weight packed as one, silu * up eager
            return super()._pack_copies(widen, hint)
        (self.packed, self.up_packed), (self.packed_bias, self.up_packed_bias) = pair
        return True

    def packed_copies(self) -> list[torch.Tensor]:
        return super().packed_copies() + ([] if self.up_packed is None else [self.up_packed])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plain = self.plain_min_rows and x.shape[0] >= self.plain_min_rows
        if self.up_packed is not None and not plain:
            assert self.packed is not None
            return packed_linear.silu_mul(x, self.packed, self.up_packed, self.packed_bias, self.up_packed_bias)
        gate, up = super().forward(x).split(self.intermediate, dim=-1)
        return F.silu(gate) * up


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _param((num, dim), dtype, device)  # no random init: the loader fills it

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _param((size,), dtype, device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, dtype: torch.dtype, device: torch.device, tp: TPGroup):
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads = spec.num_heads // tp.size, spec.num_kv_heads // tp.size
        self.head_dim = spec.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, spec.hidden_size, spec.o_bias, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn,
                ops: LayerOps, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """With `keep_rows`, only those rows of the output (every row still writes its K/V)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # q's and k's heads are adjacent in qkv: rotated in one call, then split as views.
        qk = ops.rotary(qkv, cos, sin, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        out = attend(self.layer_idx, q, k, v).reshape(t, self.q_size)
        if keep_rows is not None:
            out = out.index_select(0, keep_rows)
            if not keep_rows.numel():  # no row samples: the K/V writes were all this layer owed
                return out
        return self.tp.all_reduce(self.o_proj(out))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.intermediate_size = spec.intermediate_size // tp.size  # this rank's part
        # gate and up as one matmul (or two with fused epilogues), the activation included.
        self.gate_up_proj = GateUpSiluMul(spec.hidden_size, self.intermediate_size, spec.mlp_bias, dtype, device)
        self.down_proj = Linear(self.intermediate_size, spec.hidden_size, spec.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, dtype: torch.dtype, device: torch.device, tp: TPGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.self_attn = Attention(spec, layer_idx, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.mlp = MLP(spec, dtype, device, tp)

    def forward(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn,
                next_norm: RMSNorm, ops: LayerOps,
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream into this layer; h: x already normed by input_layernorm. Returns
        the stream out of the layer and it normed by `next_norm` (the next layer's input norm,
        or the final norm): each residual add is one op with the norm that follows it. With
        `keep_rows` (the last layer), everything after attention runs on those rows only."""
        post = self.post_attention_layernorm
        attn = self.self_attn(h, cos, sin, attend, ops, keep_rows)
        if keep_rows is not None:
            x = x.index_select(0, keep_rows)
            if not keep_rows.numel():
                return x, x
        x, h = ops.add_rms_norm(x, attn, post.weight, post.eps)
        return ops.add_rms_norm(x, self.mlp(h), next_norm.weight, next_norm.eps)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 decoder; which biases exist is decided by the spec."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, tp: TPGroup = SINGLE):
        super().__init__()
        device = torch.device(device)
        self.spec = spec
        self.dtype = dtype
        self.tp = tp
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, dtype, device)
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, spec.max_position_embeddings, device)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, dtype, device, tp) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        # Tied: lm_head shares the embedding matrix (no copy, counted once in num_parameters).
        self.lm_head_weight = (
            self.embed_tokens.weight if spec.tie_word_embeddings
            else _param((spec.vocab_size, spec.hidden_size), dtype, device)
        )
        self.lm_head_packed: torch.Tensor | None = None  # set by pack_linear_weights()
        self.plain_layers, self.plain_bytes = 0, 0  # set by pack_linear_weights()
        self.widened_bytes = 0  # set by pack_linear_weights(): float32 copies of bf16/fp16 weights
        # The element-wise ops between the matmuls (layer_ops.py): eager torch unless the engine
        # hands the model compiled ones.
        self.layer_ops: LayerOps = EAGER

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for flat token ids / positions [T]; with
        `keep_rows` (int64 row indices), only those rows, in that order.

        Only the rows that sample need hidden states at the end, and after the last layer's
        attention a row's work (o_proj, the MLP, the norms) touches no other row: so the last
        layer runs that part on `keep_rows` alone. Every row still writes its K/V in every layer.
        (llama.cpp does the same with the rows whose outputs are wanted.)"""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # shared by every layer
        h = self.layers[0].input_layernorm(x)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i < last else self.norm
            x, h = layer(x, h, cos, sin, attend, next_norm, self.layer_ops, keep_rows if i == last else None)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the N rows given (only the rows that sample)."""
        if self.lm_head_packed is not None:
            return packed_linear.linear(hidden, self.lm_head_packed, None).to(torch.float32)
        return F.linear(hidden, self.lm_head_weight).to(torch.float32)

    def pack_linear_weights(self, plain_min_rows: int = 0, widen: bool = True,
                            rows_hint: int = packed_linear.ROWS_HINT) -> bool:
        """Every linear layer and lm_head through oneDNN with prepacked weights (CPU; see
        packed_linear.py). Call after loading; num_parameters() counts the plain weights, so ask
        it first. True if all were packed (then no plain linear weight is kept, except lm_head's
        when it is the embedding matrix, and the layers' own with `plain_min_rows`).

        With `plain_min_rows` > 0 every linear layer also keeps its plain weight, for batches of
        at least that many rows; `plain_layers` and `plain_bytes` count those second copies.
        `widen` lets bf16/fp16 weights be packed as float32 where this CPU has no matmul in their
        dtype; `widened_bytes` counts those copies. The layers are packed for `rows_hint` rows
        (packed_linear.layer_rows_hint), lm_head, which sees only the sampling rows, for
        packed_linear.ROWS_HINT."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if not linears or not linears[0].pack(plain_min_rows, widen, rows_hint):  # one refusal says the rest would be refused too
            return False
        ok = all([m.pack(plain_min_rows, widen, rows_hint) for m in linears[1:]])
        kept = [m for m in linears if m.plain_min_rows]
        self.plain_layers = len(kept)
        self.plain_bytes = sum(m.weight.numel() * m.weight.element_size() for m in kept)
        self.lm_head_packed = packed_linear.pack(self.lm_head_weight, None, widen)
        copies = [p for m in linears for p in m.packed_copies()] + [self.lm_head_packed]
        self.widened_bytes = sum(p.numel() * p.element_size() for p in copies if p is not None and p.dtype != self.dtype)
        if self.lm_head_packed is not None and not self.spec.tie_word_embeddings:
            self.lm_head_weight.data = self.lm_head_weight.data.new_empty(0)
        return ok and self.lm_head_packed is not None

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() de-duplicates tied weights

    # ------------------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the fused parameters; error on anything
        missing, unexpected or mis-shaped, naming the tensor."""
        s, tp = self.spec, self.tp
        # This rank's sizes (the whole model's without tensor parallelism).
        q, kv, inter = s.q_size // tp.size, s.kv_size // tp.size, s.intermediate_size // tp.size
        # Checkpoint tensors this rank takes a slice of: (dim, rows or columns per rank).
        row_parallel = {"self_attn.o_proj": q, "mlp.down_proj": inter}
        # checkpoint suffix -> (parameter name within the layer, row offset, rows)
        fused = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
            "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
        }
        params = dict(self.named_parameters(remove_duplicate=False))
        # Every (parameter, row offset) piece that must arrive: fused parameters need all parts.
        expected: set[tuple[str, int]] = set()
        for name in params:
            if name.startswith("layers.") and (".qkv_proj." in name or ".gate_up_proj." in name):
                parts = (0, q, q + kv) if ".qkv_proj." in name else (0, inter)
                expected.update((name, off) for off in parts)
            else:
                expected.add((name, 0))
        if s.tie_word_embeddings:
            expected.discard(("lm_head_weight", 0))  # same storage as embed_tokens.weight
        loaded: set[tuple[str, int]] = set()

        for raw_name, tensor in weights:
            name = raw_name[len("model."):] if raw_name.startswith("model.") else raw_name
            if name.endswith("rotary_emb.inv_freq"):
                continue  # buffer some old checkpoints saved; recomputed here
            if name == "lm_head.weight":
                if s.tie_word_embeddings:
                    continue  # the reference ties it to the embedding as well
                name = "lm_head_weight"
            target, offset, rows = name, 0, None
            if name.startswith("layers."):
                _, idx, rest = name.split(".", 2)
                module, _, kind = rest.rpartition(".")  # e.g. "self_attn.q_proj", "weight"
                if module in fused:
                    fused_module, offset, rows = fused[module]
                    target = f"layers.{idx}.{fused_module}.{kind}"
                    if tp.size > 1:  # column-parallel: this rank's output rows
                        tensor = tensor.narrow(0, tp.rank * rows, rows)
                elif module in row_parallel and tp.size > 1:
                    if kind == "weight":  # row-parallel: this rank's input columns
                        width = row_parallel[module]
                        tensor = tensor.narrow(1, tp.rank * width, width)
                    elif tp.rank != 0:  # the bias is added once, by rank 0
                        tensor = torch.zeros_like(tensor)
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected tensor {raw_name!r} in checkpoint for {s.architecture}")
            dest = param.data if rows is None else param.data.narrow(0, offset, rows)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"tensor {raw_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add((target, offset))

        missing = sorted({name for name, off in expected - loaded})
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {', '.join(missing[:8])}"
                             + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
