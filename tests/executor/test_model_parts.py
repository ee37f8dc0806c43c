"""The decoder's element-wise parts against transformers' own, bit for bit: the rewrites that make
them cheaper (RoPE on half-width angles with q and k in one call, torch's rms_norm in float32)
must not change a single value, so the model parity tests' tolerances are not what holds them."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from executor_svc.models.llama import RMSNorm
from executor_svc.models.rope import RotaryEmbedding, apply_rotary
from executor_svc.models.spec import RopeSpec

HEADS, KV_HEADS, DIM = 4, 2, 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rotary_equals_transformers_bit_for_bit(dtype, tokens):
    torch.manual_seed(tokens)
    rope = RotaryEmbedding(RopeSpec(rope_type="default", theta=10000.0), DIM, 4096, torch.device("cpu"))
    positions = torch.randint(0, 4000, (tokens,))
    cos, sin = rope.cos_sin(positions, dtype)
    assert cos.shape == (tokens, 1, DIM // 2)
    # q and k as the model has them: adjacent heads in one projection output, a strided view.
    qkv = (torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM) * 4).to(dtype)
    qk = qkv[:, : (HEADS + KV_HEADS) * DIM].view(tokens, HEADS + KV_HEADS, DIM)
    ours = apply_rotary(qk, cos, sin)
    assert ours.is_contiguous()
    # transformers: [batch, heads, tokens, dim], cos/sin over the full head_dim.
    freqs = positions[:, None].float() * rope.inv_freq[None, :]
    full = torch.cat((freqs, freqs), dim=-1)
    ref_q, ref_k = apply_rotary_pos_emb(qk[:, :HEADS].transpose(0, 1)[None], qk[:, HEADS:].transpose(0, 1)[None],
                                        full.cos().to(dtype)[None], full.sin().to(dtype)[None])
    assert torch.equal(ours[:, :HEADS], ref_q[0].transpose(0, 1))
    assert torch.equal(ours[:, HEADS:], ref_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rms_norm_equals_transformers_bit_for_bit(dtype, tokens):
    torch.manual_seed(tokens)
    ref = LlamaRMSNorm(576, eps=1e-5)
    ref.weight.data = torch.randn(576)
    ref = ref.to(dtype)
    ours = RMSNorm(576, 1e-5, dtype, torch.device("cpu"))
    ours.weight.data.copy_(ref.weight.data)
    x = (torch.randn(tokens, 576) * 3).to(dtype)
    assert torch.equal(ours(x), ref(x))
