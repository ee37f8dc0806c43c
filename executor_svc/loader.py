"""Load a local Hugging Face checkpoint directory into the compact model.

config.json is read with transformers' AutoConfig (local_files_only: never the hub), weights with
safetensors, one tensor at a time straight into the model's (fused) parameters, converting to the
requested dtype on the way. A sharded checkpoint is read through model.safetensors.index.json.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .models import LlamaForCausalLM, ModelSpec, UnsupportedModelError, spec_from_hf_config
from .parallel import SINGLE, TPGroup, check_divisible

logger = logging.getLogger("chunkwise.executor.loader")

INDEX_FILE = "model.safetensors.index.json"


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    spec: ModelSpec
    max_model_len: int
    path: Path


def _checkpoint_dir(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} is not a directory (expected a local checkpoint "
                                "directory with config.json and *.safetensors)")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(p)!r} has no config.json")
    return p


def _generation_eos_ids(path: Path) -> list[int]:
    gen = path / "generation_config.json"
    if not gen.is_file():
        return []
    try:
        value = json.loads(gen.read_text()).get("eos_token_id")
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable %s: %s", gen, e)
        return []
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def read_spec(path: str | Path, max_model_len: int | None = None) -> tuple[ModelSpec, int]:
    """The checkpoint's ModelSpec and the effective max_model_len (raises for unsupported models)."""
    from transformers import AutoConfig

    p = _checkpoint_dir(path)
    try:
        hf_config = AutoConfig.from_pretrained(str(p), local_files_only=True)
    except (KeyError, ValueError) as e:  # an unknown model_type
        raise UnsupportedModelError(
            f"cannot read {p / 'config.json'} as a supported model config ({e}); supported "
            "architectures: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
        ) from e
    spec = spec_from_hf_config(hf_config, extra_eos_token_ids=_generation_eos_ids(p))

    limit = spec.max_position_embeddings
    if max_model_len is not None:
        if max_model_len > limit:
            raise ValueError(
                f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings {limit}"
            )
        limit = max_model_len
    if spec.sliding_window is not None and spec.sliding_window < limit:
        raise UnsupportedModelError(
            f"sliding-window attention (window {spec.sliding_window} < max_model_len {limit}) is not "
            f"supported; pass --max-model-len {spec.sliding_window} or less to serve it with full attention "
            "(identical within the window)"
        )
    return spec, limit


def safetensors_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {path} (only safetensors checkpoints are supported)"
        )
    return files


def iter_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    tp: TPGroup = SINGLE,
) -> LoadedModel:
    """`tp`: load this rank's shard of a tensor-parallel model (see models/llama.py)."""
    p = _checkpoint_dir(path)
    spec, limit = read_spec(p, max_model_len)
    check_divisible(spec.num_heads, spec.num_kv_heads, spec.intermediate_size, tp.size, spec.architecture)
    device = torch.device(device)
    model = LlamaForCausalLM(spec, dtype=dtype, device=device, tp=tp)
    with torch.inference_mode():
        model.load_weights(iter_weights(p))
    model.eval()
    logger.info("loaded %s from %s: %d layers, %.1fM parameters, %s on %s, max_model_len %d",
                spec.architecture, p, spec.num_layers, model.num_parameters() / 1e6,
                str(dtype).removeprefix("torch."), device, limit)
    return LoadedModel(model=model, spec=spec, max_model_len=limit, path=p)
