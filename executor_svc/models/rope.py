"""Rotary position embeddings (the "rotate half" / GPT-NeoX layout used by HF Llama checkpoints).

Frequencies are computed in float32 exactly like the reference (positions * inv_freq, then
cos/sin), per step for the positions present, so no table of max_model_len rows is kept and
every position's angle is bit-identical however the positions are batched.
"""

from __future__ import annotations

import math

import torch

from .spec import RopeSpec


def inverse_frequencies(rope: RopeSpec, head_dim: int, max_position_embeddings: int) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies for the given RoPE variant."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        # Position interpolation: angle(p) = p / factor * inv_freq.
        return inv_freq / rope.factor
    if rope.rope_type == "dynamic":
        # Dynamic NTK only rescales the base once a sequence exceeds max_position_embeddings. The
        # loader caps max_model_len there, so within the served range it equals plain RoPE
        # (which is also what the reference computes for such lengths).
        return inv_freq
    if rope.rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low frequencies by `factor`, and interpolate
        # smoothly between the two wavelength thresholds.
        old_len = rope.original_max_position_embeddings or max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported RoPE type {rope.rope_type!r}")


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rope: RopeSpec, head_dim: int, max_position_embeddings: int, device: torch.device) -> None:
        super().__init__()
        inv = inverse_frequencies(rope, head_dim, max_position_embeddings).to(device)
        self.register_buffer("inv_freq", inv, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim // 2] in `dtype` for int positions [T]: the angle of
        each pair of dims (i, i + head_dim // 2). The reference repeats them for both halves."""
        freqs = positions[:, None].to(torch.float32) * self.inv_freq[None, :]
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] (any strides) rotated by the per-token angles of `cos_sin`, into a
    new contiguous tensor: each pair (x1, x2) = (x[i], x[i + half]) becomes
    (x1 cos - x2 sin, x2 cos + x1 sin).

    Bit for bit the reference's `x * cat(cos, cos) + cat(-x2, x1) * cat(sin, sin)`: negating is
    exact, and adding a negated product is subtracting it. Written on the halves it makes no
    `cat` and no negated copy, and one call serves q and k together (`Attention.forward`): fewer
    passes over memory and half the calls (1.3-3x faster alone; bench/RESULTS.md section 2b)."""
    x1, x2 = x.chunk(2, dim=-1)
    out = x.new_empty(x.shape)  # contiguous, whatever x's strides
    out1, out2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=out1)
    out1.sub_(x2 * sin)
    torch.mul(x2, cos, out=out2)
    out2.add_(x1 * sin)
    return out
