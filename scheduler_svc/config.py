"""The scheduler service's one configuration dataclass, built from vLLM-named CLI flags."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from chunkwise.cliutil import add_flag


@dataclass(frozen=True)
class ServiceConfig:
    executor: str = "127.0.0.1:50061"  # HOST:PORT of executor_svc
    host: str = "127.0.0.1"
    port: int = 50051
    token: str = ""  # the executor's shared token
    tokenizer: str | None = None  # directory; default: the executor's model directory
    served_model_name: str | None = None  # the model's name in GetModelInfo; default: its directory's name
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None  # default: the model's
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    async_scheduling: bool = True  # plan step n+1 while step n runs
    stream_interval: int = 1  # tokens per streamed message after the first (SGLang's --stream-interval)
    max_waiting_requests: int = 4096
    api_keys: tuple[str, ...] = field(default_factory=tuple)
    executor_connect_timeout: float = 300.0  # seconds to wait for the executor at start-up
    executor_wait_timeout: float = 30.0  # how long new requests wait for a lost executor
    stats_interval: float = 10.0  # seconds between status log lines; 0 disables
    executor_step_timeout: float = 60.0  # a step taking longer counts as a failed executor
    shutdown_grace: float = 10.0  # seconds running requests get after SIGTERM
    # TLS for the public API (both files, or neither) and for the connection to the executor.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    executor_tls_ca_file: str | None = None  # set: talk TLS to the executor, trusting this CA
    executor_tls_server_name: str | None = None  # name to check in the executor's certificate
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: off, 0: any free port

    def validate(self) -> None:
        """Checks that need no executor; the rest happen once its handshake is in."""
        problems = []
        host, sep, port = self.executor.rpartition(":")
        if not sep or not host or not port.isdigit():
            problems.append(f"--executor must be HOST:PORT, got {self.executor!r}")
        if not self.token:
            problems.append("--token (or CHUNKWISE_TOKEN) is required: the executor refuses calls without it")
        if not 0 <= self.port <= 65535:
            problems.append(f"--port must be in [0, 65535], got {self.port}")
        if self.max_waiting_requests < 1:
            problems.append("--max-waiting-requests must be >= 1")
        if not 1 <= self.stream_interval <= 1024:
            problems.append(f"--stream-interval must be in [1, 1024], got {self.stream_interval}")
        if self.executor_connect_timeout <= 0 or self.executor_wait_timeout <= 0 or self.executor_step_timeout <= 0:
            problems.append("executor timeouts must be > 0")
        if self.shutdown_grace < 0:
            problems.append("--shutdown-grace must be >= 0")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            problems.append("--tls-cert-file and --tls-key-file go together: give both or neither")
        for flag, path in (("--tls-cert-file", self.tls_cert_file), ("--tls-key-file", self.tls_key_file),
                           ("--executor-tls-ca-file", self.executor_tls_ca_file)):
            if path and not os.access(path, os.R_OK):
                problems.append(f"{flag} {path!r} is not a readable file")
        if self.served_model_name is not None and not (0 < len(self.served_model_name) <= 256
                                                       and self.served_model_name.isprintable()):
            problems.append("--served-model-name must be 1-256 printable characters")
        if self.executor_tls_server_name and not self.executor_tls_ca_file:
            problems.append("--executor-tls-server-name needs --executor-tls-ca-file")
        # The core's own checks (power-of-two block size, budget of at least one block, ...) run
        # now on the flags; until the handshake tells the model's context length, the budget
        # stands in for an unset max_model_len, so the no-chunked-prefill check waits for it.
        from scheduler_svc.core import SchedulerConfig

        try:
            SchedulerConfig(
                max_model_len=self.max_model_len or self.max_num_batched_tokens,
                block_size=self.block_size,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                enable_prefix_caching=self.enable_prefix_caching,
                enable_chunked_prefill=self.enable_chunked_prefill,
            ).validate()
        except ValueError as e:
            problems.append(str(e))
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "ServiceConfig":
        p = argparse.ArgumentParser(
            prog="python -m scheduler_svc",
            description="chunkwise scheduler: the public gRPC API, the KV block pool, prefix cache and "
            "the step loop that drives an executor_svc.",
        )
        add_flag(p, "--executor", default=cls.executor, help="executor_svc address HOST:PORT")
        add_flag(p, "--host", default=cls.host, help="address to serve the public API on")
        add_flag(p, "--port", type=int, default=cls.port, help="port for the public API (0: pick a free one)")
        add_flag(p, "--token", default=os.environ.get("CHUNKWISE_EXECUTOR_TOKEN", ""),
                 help="shared token the executor requires (also CHUNKWISE_EXECUTOR_TOKEN)")
        add_flag(p, "--tokenizer", default=None,
                 help="tokenizer directory for text prompts; default: the executor's model directory")
        add_flag(p, "--served-model-name", default=None,
                 help="the model's name as the vLLM-protocol service reports it (default: the model directory's name)")
        add_flag(p, "--block-size", type=int, default=cls.block_size, help="tokens per KV block (a power of two)")
        add_flag(p, "--max-num-batched-tokens", type=int, default=cls.max_num_batched_tokens,
                 help="token budget of one step, shared by decodes and prefill chunks")
        add_flag(p, "--max-num-seqs", type=int, default=cls.max_num_seqs, help="most requests running at once")
        add_flag(p, "--max-model-len", type=int, default=None,
                 help="longest prompt + output in tokens; default: the model's context length")
        add_flag(p, "--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                 default=cls.enable_prefix_caching, help="reuse the KV of shared prompt prefixes")
        add_flag(p, "--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                 default=cls.enable_chunked_prefill, help="split long prompts into budget-sized chunks")
        add_flag(p, "--async-scheduling", action=argparse.BooleanOptionalAction, default=cls.async_scheduling,
                 help="plan and send the next step while the executor runs the current one, so it never "
                 "waits for the scheduler (--no-async-scheduling: one step at a time)")
        add_flag(p, "--stream-interval", type=int, default=cls.stream_interval,
                 help="a stream gets its first token at once, then a message every N tokens (and the rest at "
                 "its end): fewer messages cost the server and its clients less CPU, for coarser streaming")
        add_flag(p, "--max-waiting-requests", type=int, default=cls.max_waiting_requests,
                 help="queued requests beyond this are refused with RESOURCE_EXHAUSTED")
        add_flag(p, "--api-key", action="append", dest="api_keys", default=None,
                 help="require this API key (authorization: Bearer KEY) on the public API; repeatable")
        add_flag(p, "--executor-connect-timeout", type=float, default=cls.executor_connect_timeout,
                 help="seconds to wait for the executor's handshake at start-up")
        add_flag(p, "--executor-wait-timeout", type=float, default=cls.executor_wait_timeout,
                 help="seconds a request waits for a lost executor before UNAVAILABLE")
        add_flag(p, "--executor-step-timeout", type=float, default=cls.executor_step_timeout,
                 help="seconds one step may take before the executor is treated as failed")
        add_flag(p, "--stats-interval", type=float, default=cls.stats_interval,
                 help="seconds between one-line status logs (0: off)")
        add_flag(p, "--shutdown-grace", type=float, default=cls.shutdown_grace,
                 help="on SIGTERM, seconds running requests get to finish before they are aborted")
        add_flag(p, "--tls-cert-file", default=None,
                 help="PEM certificate (chain) for the public API; with --tls-key-file enables TLS")
        add_flag(p, "--tls-key-file", default=None, help="PEM private key for --tls-cert-file")
        add_flag(p, "--executor-tls-ca-file", default=None,
                 help="PEM CA certificate(s): connect to the executor over TLS and trust these")
        add_flag(p, "--executor-tls-server-name", default=None,
                 help="name expected in the executor's certificate, if it differs from the --executor host")
        add_flag(p, "--metrics-host", default=cls.metrics_host, help="address of the Prometheus endpoint")
        add_flag(p, "--metrics-port", type=int, default=None,
                 help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port; unset: off)")
        ns = p.parse_args(argv)
        values = vars(ns)
        values["api_keys"] = tuple(values["api_keys"] or ())
        config = cls(**values)
        try:
            config.validate()
        except ValueError as e:
            p.error(str(e))
        return config
