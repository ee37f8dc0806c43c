"""Helpers for the reliability tests: a tiny model with a real tokenizer, processes on fixed
loopback ports (so an executor or scheduler can be killed and restarted on the same address),
and waiting for the scheduler to be idle.

Everything here talks to 127.0.0.1 only, and every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from client import Client
from chunkwise_tools.serve import Process, StackError, launch, start_executor, start_scheduler

# The shared scheduler geometry: block 16, budget 64 (the seed's case), short contexts.
BLOCK = 16
MAX_MODEL_LEN = 256
SCHEDULER_FLAGS = [
    "--block-size", str(BLOCK), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "64",
    "--stats-interval", "0",
]
START_TIMEOUT = 180.0


def add_byte_tokenizer(model_dir: Path) -> Path:
    """Save a byte-level BPE tokenizer (ids 0-2 special, 3-258 bytes, the rest letter pairs, 384
    in all: the tiny model's vocabulary) with a chat template into `model_dir`, so that text
    prompts, messages, stop strings and detokenization can be exercised on the tiny model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = []
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    for a in letters:
        for b in letters:
            if len(vocab) < 384 and a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast.save_pretrained(str(model_dir))
    return model_dir


def free_port() -> int:
    """A port that was free a moment ago (the processes bind it themselves; good enough on loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_idle(client: Client, timeout: float = 30.0) -> dict:
    """Stats once nothing runs, waits or holds a block; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        st = client.stats()
        if st["num_running"] == 0 and st["num_waiting"] == 0 and st["kv_blocks_used"] == 0:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: {st}")
        time.sleep(0.05)


def assert_no_leak(st: dict) -> None:
    """Every block free (empty or cached-and-evictable), none held."""
    assert st["kv_blocks_used"] == 0, st
    assert st["kv_blocks_free"] == st["kv_blocks_total"], st
    assert 0 <= st["kv_blocks_cached"] <= st["kv_blocks_free"], st
    assert st["num_running"] == 0 and st["num_waiting"] == 0, st


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def paused(proc: Process):
    """SIGSTOP a process for the duration (so nothing it serves can progress), then SIGCONT.

    Used to make "the request is still running" a fact instead of a race against a fast model.
    """
    proc.popen.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        if proc.alive():  # it may have been killed meanwhile (and reaped: its pid is not ours)
            proc.popen.send_signal(signal.SIGCONT)


class Deployment:
    """An executor on a fixed port and a scheduler pointing at it, each killable and restartable.

    `start_executor`/`start_scheduler` from chunkwise_tools.serve do the work; fixed ports (instead of
    port 0) are what let a restarted process come back on the address the other side knows.
    """

    def __init__(self, model_dir: Path, executor_args=(), scheduler_args=(), scheduler_port: int | None = None):
        self.model_dir = Path(model_dir)
        self.token = secrets.token_urlsafe(24)
        self.executor_port = free_port()
        self.scheduler_port = scheduler_port or free_port()
        self.executor_args = ["--dtype", "float32", "--port", str(self.executor_port), *executor_args]
        self.scheduler_args = [*SCHEDULER_FLAGS, *scheduler_args]
        self.executor: Process | None = None
        self.scheduler: Process | None = None

    @property
    def executor_address(self) -> str:
        return f"127.0.0.1:{self.executor_port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.scheduler_port}"

    def start(self) -> "Deployment":
        self.start_executor()
        self.start_scheduler()
        return self

    def start_executor(self, extra_args=()) -> Process:
        self.executor = start_executor(self.model_dir, self.token, [*self.executor_args, *extra_args],
                                       timeout=START_TIMEOUT)
        return self.executor

    def start_scheduler(self, extra_args=()) -> Process:
        self.scheduler = start_scheduler(
            self.executor_address, self.token, [*self.scheduler_args, *extra_args], port=self.scheduler_port,
            timeout=START_TIMEOUT,
        )
        return self.scheduler

    def client(self, **kw) -> Client:
        return Client(self.address, **kw)

    @staticmethod
    def kill(proc: Process | None, sig=signal.SIGKILL, timeout: float = 30.0) -> int | None:
        """Send `sig` and wait for the process to exit; its exit status."""
        if proc is None or not proc.alive():
            return None if proc is None else proc.popen.returncode
        proc.popen.send_signal(sig)
        try:
            return proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            return proc.popen.wait()

    def stop(self) -> None:
        for proc in (self.scheduler, self.executor):
            if proc is not None and proc.alive():
                proc.popen.send_signal(signal.SIGCONT)  # a test may have left it stopped
                self.kill(proc, signal.SIGTERM, timeout=15)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def health(address: str, service: str = "chunkwise.v1.Generation", credentials=None, **channel_kw) -> str:
    """'SERVING', 'NOT_SERVING', or the gRPC status name of a failed check."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = (grpc.secure_channel(address, credentials, **channel_kw) if credentials is not None
               else grpc.insecure_channel(address))
    with channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def call_code(call):
    """The gRPC status code `call()` ends with (OK if it returns)."""
    import grpc

    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


class StreamInThread:
    """Stream one request in a thread, recording its tokens, finish reason or error."""

    def __init__(self, address: str, prompt: list[int], *, client_kw=None, **kw):
        self.prompt = prompt
        self.max_tokens = kw.get("max_tokens")
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.error = None
        self.first_chunk = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address, client_kw or {}, kw), daemon=True)
        self._thread.start()

    def _run(self, address, client_kw, kw):
        from client import ChunkwiseError

        try:
            with Client(address, **{"timeout": 120, **client_kw}) as c:
                for chunk in c.stream(prompt_token_ids=self.prompt, **kw):
                    self.tokens += chunk.token_ids
                    self.finish = chunk.finish_reason or self.finish
                    self.first_chunk.set()
        except ChunkwiseError as e:
            self.error = e
        finally:
            self.first_chunk.set()

    def join(self, timeout: float = 120) -> "StreamInThread":
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "a stream did not end in time (a client hung)"
        return self


def launch_service(name: str, args: list[str], ready: str, env_extra: dict) -> Process:
    """Start `python -m <name> ...` and wait for its ready line only (for TLS servers, which
    chunkwise_tools.serve's plaintext health check cannot probe)."""
    env = {**os.environ, **env_extra}
    return launch(name, [sys.executable, "-m", name, *args], ready, env, START_TIMEOUT)


__all__ = [
    "BLOCK", "MAX_MODEL_LEN", "SCHEDULER_FLAGS", "Deployment", "StackError", "add_byte_tokenizer",
    "StreamInThread", "assert_no_leak", "health", "free_port", "launch_service", "paused", "wait_idle", "wait_until",
]
