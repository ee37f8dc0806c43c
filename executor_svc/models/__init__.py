"""Model definitions: the Llama family (Llama 2/3, SmolLM, Mistral-style, Qwen2)."""

from .llama import AttendFn, LlamaForCausalLM
from .spec import (
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_ROPE_TYPES,
    ModelSpec,
    RopeSpec,
    UnsupportedModelError,
    spec_from_hf_config,
)

__all__ = [
    "AttendFn",
    "LlamaForCausalLM",
    "ModelSpec",
    "RopeSpec",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "UnsupportedModelError",
    "spec_from_hf_config",
]
