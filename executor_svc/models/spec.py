"""What the executor needs to know about a checkpoint's architecture, read from its HF config.

Parsing is strict: anything the compact model does not implement (another architecture, a RoPE
variant, a sliding window that would actually slide, a non-SiLU MLP, ...) raises
UnsupportedModelError with a message saying what is supported, instead of computing something
subtly different from the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> family flavour. All are the same decoder (RMSNorm, RoPE, GQA, SwiGLU);
# they differ only in which projections carry biases and in config field names.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",  # Llama 2/3/3.x, SmolLM/SmolLM2, TinyLlama, ...
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",  # Qwen2 / Qwen2.5 (q/k/v biases)
}
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or feature this executor does not implement."""


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0  # linear / dynamic / llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec = field(default_factory=RopeSpec)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # None: full attention
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _unsupported(what: str) -> UnsupportedModelError:
    archs = ", ".join(SUPPORTED_ARCHITECTURES)
    return UnsupportedModelError(
        f"{what}. Supported: architectures {archs} (RMSNorm, RoPE types {', '.join(SUPPORTED_ROPE_TYPES)}, "
        "GQA, SwiGLU/SiLU MLP, tied or untied embeddings, full attention)"
    )


def _eos_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_spec(config: Any) -> RopeSpec:
    # transformers >= 5 keeps everything in `rope_parameters`; 4.x used rope_theta + rope_scaling.
    params = getattr(config, "rope_parameters", None)
    if params and any(isinstance(v, dict) for v in params.values()):
        raise _unsupported("per-layer-type RoPE parameters are not supported")
    params = dict(params or {})
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        for k, v in scaling.items():
            params.setdefault(k, v)
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    theta = 10000.0 if theta is None else float(theta)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise _unsupported(f"partial_rotary_factor={partial} is not supported")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _unsupported(f"RoPE type {rope_type!r} is not supported")
    if rope_type == "default":
        return RopeSpec("default", theta)
    factor = float(params.get("factor", 1.0))
    if rope_type == "llama3":
        return RopeSpec(
            "llama3",
            theta,
            factor=factor,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings") or config.max_position_embeddings
            ),
        )
    return RopeSpec(rope_type, theta, factor=factor)


def spec_from_hf_config(config: Any, extra_eos_token_ids: list[int] | None = None) -> ModelSpec:
    """Turn a transformers PretrainedConfig into a ModelSpec, or raise UnsupportedModelError."""
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if not archs and model_type in _MODEL_TYPE_TO_ARCH:
        archs = [_MODEL_TYPE_TO_ARCH[model_type]]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise _unsupported(f"architecture {archs or model_type!r} (model_type {model_type!r}) is not supported")
    flavour = SUPPORTED_ARCHITECTURES[arch]

    hidden_act = getattr(config, "hidden_act", "silu")
    if hidden_act != "silu":
        raise _unsupported(f"hidden_act {hidden_act!r} is not supported (only silu / SwiGLU)")

    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    if num_heads % num_kv_heads:
        raise _unsupported(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads

    # A sliding window only changes results once a sequence is longer than the window. Record
    # it; the loader rejects it unless max_model_len stays within the window.
    window = getattr(config, "sliding_window", None)
    if flavour == "qwen2" and not getattr(config, "use_sliding_window", False):
        window = None
    layer_types = getattr(config, "layer_types", None) or []
    if window is None and any(t != "full_attention" for t in layer_types):
        raise _unsupported(f"layer types {sorted(set(layer_types))} are not supported")

    if flavour == "qwen2":
        qkv_bias, o_bias, mlp_bias = True, False, False
    elif flavour == "mistral":
        qkv_bias = o_bias = mlp_bias = False
    else:
        qkv_bias = o_bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))

    eos: list[int] = []
    for t in _eos_ids(getattr(config, "eos_token_id", None)) + list(extra_eos_token_ids or []):
        if t not in eos:
            eos.append(t)

    return ModelSpec(
        architecture=arch,
        vocab_size=int(config.vocab_size),
        hidden_size=int(config.hidden_size),
        intermediate_size=int(config.intermediate_size),
        num_layers=int(config.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.max_position_embeddings),
        rope=_rope_spec(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        sliding_window=int(window) if window is not None else None,
        eos_token_ids=tuple(eos),
    )
