"""Tiny random Hugging Face checkpoints for tests (no hub access).

`make_tiny_checkpoint(path, arch="llama", **config_overrides)` writes a small model with
transformers' `save_pretrained` (safetensors) and returns the directory. The weights are
deterministic (fixed seed, independent of the global RNG), so every call with the same arguments
writes the same model. `max_shard_size=...` produces a sharded checkpoint with
model.safetensors.index.json.

The default sizes (hidden 64, 2 layers, vocab 384, GQA 4 heads / 2 KV heads) keep a forward pass
at well under a millisecond per token on a CPU core. The init range is wider than HF's 0.02 so
that the random model's next-token distribution is peaked: greedy decoding then has clear
winners and token-for-token comparisons with transformers are not decided by float noise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.15,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

ARCHES = ("llama", "qwen2", "mistral")


def tiny_config(arch: str = "llama", **overrides: Any) -> Any:
    """A transformers config object for a tiny model of `arch`."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
    if arch not in classes:
        raise ValueError(f"arch must be one of {', '.join(classes)}, got {arch!r}")
    values = dict(TINY_DEFAULTS)
    if arch == "mistral":
        values["sliding_window"] = None
    values.update(overrides)
    return classes[arch](**values)


def make_tiny_checkpoint(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random `arch` checkpoint into `path` (created if needed) and return it.

    config_overrides go to the transformers config (e.g. tie_word_embeddings=True,
    num_key_value_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0}).
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **config_overrides)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float()
        # Norm weights are initialised to ones; perturb them (and biases, zero by default) so a
        # loader that drops or misplaces them is caught.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(torch.randn_like(p) * 0.1)
                elif name.endswith(".bias"):
                    p.copy_(torch.randn_like(p) * 0.1)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    try:
        model.save_pretrained(path, **kwargs)
    except TypeError:  # transformers versions without the safe_serialization argument
        kwargs.pop("safe_serialization")
        model.save_pretrained(path, **kwargs)
    return path


def load_reference(path: str | Path) -> Any:
    """The transformers model for a checkpoint directory, float32, eval mode (the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    return model.float().eval()
