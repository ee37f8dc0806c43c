"""Configuration is validated once at start-up, with messages that say what to change."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest

from chunkwise_tools.serve import start_executor


def run_scheduler(args: list[str], env_extra: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "CHUNKWISE_EXECUTOR_TOKEN": "t0ken", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "scheduler_svc", "--port", "0", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.parametrize("args,needle", [
    (["--block-size", "24"], "power of two"),
    (["--block-size", "16", "--max-num-batched-tokens", "8"], "at least one block"),
    (["--no-enable-chunked-prefill", "--max-model-len", "4096", "--max-num-batched-tokens", "2048"],
     "without chunked prefill"),
    (["--executor", "nohostport"], "HOST:PORT"),
])
def test_bad_flags_exit_with_a_clear_message(args, needle):
    r = run_scheduler(args)
    assert r.returncode == 2
    assert needle in r.stderr


def test_flags_are_read_from_the_environment():
    r = run_scheduler([], {"CHUNKWISE_BLOCK_SIZE": "24"})
    assert r.returncode == 2 and "power of two" in r.stderr
    r = run_scheduler([], {"CHUNKWISE_ENABLE_PREFIX_CACHING": "maybe"})
    assert r.returncode == 2 and "CHUNKWISE_ENABLE_PREFIX_CACHING" in r.stderr


def test_help_names_every_flag_and_its_env_var():
    r = subprocess.run([sys.executable, "-m", "scheduler_svc", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for flag in ("--block-size", "--max-num-batched-tokens", "--max-num-seqs", "--max-model-len",
                 "--enable-prefix-caching", "--enable-chunked-prefill", "--executor", "--token"):
        assert flag in r.stdout
    assert "CHUNKWISE_MAX_NUM_BATCHED_TOKENS" in r.stdout.replace("\n", "").replace(" ", "")


@pytest.fixture(scope="module")
def small_executor(tiny_llama_dir):
    token = secrets.token_hex(8)
    proc = start_executor(tiny_llama_dir, token, ["--num-kv-blocks", "8", "--dtype", "float32"], timeout=120)
    yield proc, token
    proc.popen.terminate()
    proc.popen.wait(30)


@pytest.mark.parametrize("args,needle", [
    (["--max-model-len", "1024"], "above the model's context length 512"),
    (["--max-model-len", "256"], "needs 16 blocks"),  # 8 blocks of 16 hold 128 tokens
])
def test_checks_that_need_the_executor(small_executor, args, needle):
    proc, token = small_executor
    r = run_scheduler(["--executor", proc.address, *args], {"CHUNKWISE_EXECUTOR_TOKEN": token})
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr


def test_wrong_token_is_refused_at_handshake(small_executor):
    proc, _ = small_executor
    r = run_scheduler(["--executor", proc.address, "--max-model-len", "128"], {"CHUNKWISE_EXECUTOR_TOKEN": "wrong"})
    assert r.returncode == 1
    assert "UNAUTHENTICATED" in r.stderr


def run_executor(model: str, extra: list[str] = (), timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "CHUNKWISE_EXECUTOR_TOKEN": "t0ken"}
    return subprocess.run([sys.executable, "-m", "executor_svc", "--port", "0", "--model", model, *extra],
                          capture_output=True, text=True, env=env, timeout=timeout)


def _gpt2_dir(tmp_path) -> str:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("case,needle", [
    ("gpt2", "architecture 'gpt2'"),
    ("sliding-window", "sliding-window attention"),
    ("max-model-len", "exceeds the model's max_position_embeddings"),
])
def test_models_refused_at_load_get_one_line_and_exit_2(tmp_path, tiny_checkpoint, case, needle):
    # Issue 17: these used to end in a Python traceback with exit code 1.
    if case == "gpt2":
        r = run_executor(_gpt2_dir(tmp_path))
    elif case == "sliding-window":
        r = run_executor(str(tiny_checkpoint("mistral", sliding_window=64)))
    else:
        r = run_executor(str(tiny_checkpoint("llama")), ["--max-model-len", "100000"])
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("executor_svc: error:")]
    assert len(errors) == 1 and needle in errors[0], r.stderr
