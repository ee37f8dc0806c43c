"""SMG (the Shepherd Model Gateway) in front of chunkwise replicas: OpenAI-compatible HTTP.

SMG speaks HTTP to users (/v1/completions, /v1/chat/completions, /v1/models, ...), tokenises,
applies the chat template, detokenises and matches stop strings itself, and talks to each
replica's scheduler over gRPC with token ids only, through the `vllm.grpc.engine.VllmEngine`
service chunkwise serves beside its own (scheduler_svc/vllm_api.py). With `--policy cache_aware`
it routes each request to the replica whose prefix cache holds most of its prompt, from the KV
events the replicas stream.

`start_gateway` runs `smg launch` (the `gateway` extra: `pip install -e '.[gateway]'`, smg pinned)
bound to loopback for both its HTTP and its Prometheus port (SMG's own defaults are every
interface), and returns once the gateway answers a one-token completion: its workers are
registered and its tokenizer is loaded (before that it answers 503).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.request import Request, urlopen

from chunkwise_tools.serve import Process, StackError, launch

SMG_VERSION = "1.13.0"  # what the `gateway` extra installs
DEFAULT_PORT = 30080
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "least_load", "prefix_hash")


def smg_binary() -> str | None:
    """The `smg` command of this Python environment (where the extra installs it), else on PATH."""
    beside = Path(sys.executable).parent / "smg"
    return str(beside) if beside.exists() else shutil.which("smg")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Gateway:
    process: Process
    url: str  # http://HOST:PORT, the OpenAI-compatible base (append /v1/...)
    metrics_url: str
    model: str  # the model id SMG serves (its /v1/models), what requests name

    def stop(self, timeout: float = 15.0) -> None:
        self.process.terminate()
        self.process.wait_or_kill(timeout)


def start_gateway(workers: list[str], model_dir: str | Path, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                  policy: str = "cache_aware", metrics_port: int = 0, timeout: float = 120.0, echo=None,
                  die_with_parent: bool = False, extra_args: list[str] = ()) -> Gateway:
    """SMG on host:port (0: a free port) in front of the schedulers at `workers` (HOST:PORT each)."""
    smg = smg_binary()
    if smg is None:
        raise StackError(f"the gateway needs SMG: pip install -e '.[gateway]' (smg=={SMG_VERSION})")
    if policy not in POLICIES:
        raise ValueError(f"--gateway-policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    port = port or _free_port(host)
    metrics_port = metrics_port or _free_port(host)
    cmd = [smg, "launch", "--host", host, "--port", str(port),
           "--worker-urls", *[f"grpc://{w}" for w in workers], "--policy", policy,
           "--model-path", str(model_dir), "--tokenizer-path", str(model_dir),
           "--prometheus-host", host, "--prometheus-port", str(metrics_port),
           "--shutdown-grace-period-secs", "5", *extra_args]
    env = {**os.environ, "NO_COLOR": "1"}
    proc = launch("gateway", cmd, "Starting router on ", env, timeout, echo, die_with_parent)
    url = f"http://{host}:{port}"
    try:
        model = _wait_ready(url, timeout)
    except BaseException:
        proc.kill()
        raise
    return Gateway(proc, url, f"http://{host}:{metrics_port}/metrics", model)


def _wait_ready(url: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    model, last = None, "no answer"
    while True:
        try:
            if model is None:
                with urlopen(url + "/v1/models", timeout=5) as r:  # noqa: S310 (loopback URL we built)
                    data = json.loads(r.read())["data"]
                model = data[0]["id"] if data else None
            if model is not None:
                body = json.dumps({"model": model, "prompt": "ready", "max_tokens": 1}).encode()
                req = Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
                with urlopen(req, timeout=30) as r:  # noqa: S310
                    if r.status == 200:
                        return model
        except (OSError, ValueError, KeyError) as e:  # HTTPError (503 until ready) is an OSError
            last = str(e)
        if time.monotonic() > deadline:
            raise StackError(f"the gateway at {url} did not answer a completion within {timeout:.0f} s ({last})")
        time.sleep(0.3)
