"""Executor configuration: a dataclass and vLLM-style command-line flags.

Every flag can also be given through an environment variable named `CHUNKWISE_<FLAG>`, the flag's
name upper-cased with dashes as underscores (`--num-kv-blocks` -> `CHUNKWISE_NUM_KV_BLOCKS`).
A flag on the command line wins over the environment. The token also falls back to
`CHUNKWISE_EXECUTOR_TOKEN` (after `CHUNKWISE_TOKEN`, the same order as the scheduler), so the
secret never has to appear in a process listing.

torch is imported lazily so that `--help` and config parsing stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from chunkwise.cliutil import env_name

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
ATTENTION_BACKEND_CHOICES = ("auto", "torch", "flashinfer", "flash-attn", "flex")
TOKEN_ENV = "CHUNKWISE_EXECUTOR_TOKEN"


class ConfigError(ValueError):
    """An invalid executor configuration; the message lists every problem found."""


@dataclass
class ExecutorConfig:
    # A local checkpoint directory (config.json + *.safetensors). None means "not given": the
    # server resolves a default through chunkwise.model_source before building the runner.
    model: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with native bf16, else float32
    device: str = "auto"  # auto: cuda when available, else cpu
    num_kv_blocks: int | None = None  # None: size the KV cache from memory
    gpu_memory_utilization: float = 0.9  # fraction of the free CUDA memory (after weights) for KV
    kv_cache_space: float = 1.0  # GiB of KV cache on CPU
    attention_backend: str = "auto"
    max_model_len: int | None = None  # optional cap below the model's max_position_embeddings
    host: str = "127.0.0.1"
    port: int = 50061
    token: str | None = None  # shared secret every call must carry; the server refuses to start without one
    enforce_eager: bool = False  # no torch.compile: decode attention takes the folded-query SDPA path
    # CPU: batches of at least this many rows take a linear layer's plain weight (F.linear) instead
    # of its oneDNN-packed copy, so every linear layer holds both (packed_linear.py). 0 (default):
    # the packed copy only.
    cpu_plain_weight_min_rows: int = 0
    # CPU: glibc keeps the memory a step frees for the next step instead of returning it to the
    # kernel and faulting it in again (cpu_malloc.py). False: glibc's defaults.
    cpu_keep_freed_memory: bool = True
    # Tensor parallelism on one host: this process is rank 0 and starts the others, which meet at
    # master_addr:master_port (torch.distributed's rendezvous; None: a free port on loopback).
    tensor_parallel_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # Several hosts: the ranks are split evenly over nnodes; host node_rank 0 runs rank 0 (the
    # executor proper), the others only start their ranks.
    nnodes: int = 1
    node_rank: int = 0
    # TLS for the internal API (the server's concern; the model runner ignores them). Both or neither.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    # ----------------------------------------------------------------------------- parsing

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the executor's flags to `parser` (so a server can combine them with its own).

        Defaults are suppressed here: `from_namespace` fills what was not given from the
        environment, then from the dataclass defaults, and can name the env var in errors.
        """
        s = argparse.SUPPRESS
        g = parser.add_argument_group("executor")
        g.add_argument("--model", default=s, metavar="DIR", help="local checkpoint directory")
        g.add_argument("--dtype", default=s, choices=DTYPE_CHOICES,
                       help="weights/activations dtype (float16 only on CUDA; auto: bfloat16 on CUDA and on CPUs "
                            "with native bf16 (avx512_bf16 or AMX), else float32)")
        g.add_argument("--device", default=s, choices=DEVICE_CHOICES)
        g.add_argument("--num-kv-blocks", default=s, type=int, metavar="N",
                       help="KV cache blocks (default: sized from memory)")
        g.add_argument("--gpu-memory-utilization", default=s, type=float, metavar="F",
                       help="fraction of free CUDA memory after loading weights used for the KV cache (0.9)")
        g.add_argument("--kv-cache-space", default=s, type=float, metavar="GIB",
                       help="GiB of KV cache on CPU (1)")
        g.add_argument("--attention-backend", default=s, choices=ATTENTION_BACKEND_CHOICES)
        g.add_argument("--max-model-len", default=s, type=int, metavar="N",
                       help="cap on the context length (default: the model's max_position_embeddings)")
        g.add_argument("--enforce-eager", default=s, action="store_true",
                       help="never compile: decode attention gathers blocks and calls SDPA (slower, starts faster)")
        g.add_argument("--cpu-plain-weight-min-rows", default=s, type=int, metavar="N",
                       help="CPU: batches of >= N rows use a second, plain copy of each linear layer's weight "
                            "(F.linear: MKL in float32, faster than the oneDNN-packed copy at prefill-sized "
                            "batches on an AVX2 CPU in process, not in served runs); costs the linear weights "
                            "twice in memory; 0: the packed copy only (default 0)")
        g.add_argument("--cpu-keep-freed-memory", default=s, action=argparse.BooleanOptionalAction,
                       help="CPU: glibc keeps what a step frees (blocks under 32 MiB, up to 1 GiB of the heap's "
                            "top) for the next step, instead of returning it to the kernel and faulting it in "
                            "again (default: on; --no-cpu-keep-freed-memory: glibc's defaults)")
        g.add_argument("--tensor-parallel-size", "-tp", default=s, type=int, metavar="N",
                       help="shard the model over N ranks (processes) on this host: query/KV heads and the MLP "
                            "split N ways, gloo on CPU, NCCL on CUDA (1)")
        g.add_argument("--master-addr", default=s, help="rendezvous address of the tensor-parallel ranks (127.0.0.1)")
        g.add_argument("--master-port", default=s, type=int,
                       help="rendezvous port of the tensor-parallel ranks (default: a free one)")
        g.add_argument("--nnodes", default=s, type=int, metavar="M",
                       help="hosts the tensor-parallel ranks are spread over, N / M each (1)")
        g.add_argument("--node-rank", default=s, type=int, metavar="K",
                       help="this host's place among them: 0 runs the executor, others only start their ranks (0)")
        g.add_argument("--host", default=s, help="address to listen on (127.0.0.1)")
        g.add_argument("--port", default=s, type=int, help="port to listen on (50061)")
        g.add_argument("--token", default=s,
                       help=f"shared secret callers must present (default: $CHUNKWISE_TOKEN, then ${TOKEN_ENV})")
        g.add_argument("--tls-cert-file", default=s, metavar="PEM",
                       help="certificate (chain); with --tls-key-file serves the internal API over TLS")
        g.add_argument("--tls-key-file", default=s, metavar="PEM", help="private key for --tls-cert-file")
        return parser

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, env: Mapping[str, str] | None = None) -> ExecutorConfig:
        """Build and validate a config from parsed flags, falling back to the environment."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        problems: list[str] = []
        for f in fields(cls):
            if hasattr(ns, f.name):
                values[f.name] = getattr(ns, f.name)
                continue
            names = [env_name(f.name)]
            if f.name == "token":
                names.append(TOKEN_ENV)
            for var in names:
                raw = env.get(var)
                if raw is None or raw == "":
                    continue
                try:
                    values[f.name] = _ENV_CONVERTERS.get(f.name, str)(raw)
                except ValueError:
                    problems.append(f"${var}={raw!r} is not a valid {f.name.replace('_', '-')}")
                break
        if problems:
            raise ConfigError("invalid executor configuration:\n  - " + "\n  - ".join(problems))
        config = cls(**values)
        config.validate()
        return config

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> ExecutorConfig:
        """Parse `argv` (default: sys.argv[1:]); bad syntax exits like any argparse CLI, bad
        values raise ConfigError naming every problem."""
        parser = cls.add_arguments(argparse.ArgumentParser(description="chunkwise executor"))
        return cls.from_namespace(parser.parse_args(argv), env)

    # ----------------------------------------------------------------------------- checks

    def validate(self) -> None:
        """Check every field once; raise ConfigError listing all problems."""
        p: list[str] = []
        if self.model is not None and not str(self.model).strip():
            p.append("--model must not be empty")
        if self.dtype not in DTYPE_CHOICES:
            p.append(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.device not in DEVICE_CHOICES:
            p.append(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            p.append(f"--attention-backend must be one of {', '.join(ATTENTION_BACKEND_CHOICES)}, "
                     f"got {self.attention_backend!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            p.append(f"--num-kv-blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            p.append(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.kv_cache_space > 0.0:
            p.append(f"--kv-cache-space must be > 0 GiB, got {self.kv_cache_space}")
        if not isinstance(self.cpu_plain_weight_min_rows, int) or self.cpu_plain_weight_min_rows < 0:
            p.append(f"--cpu-plain-weight-min-rows must be >= 0, got {self.cpu_plain_weight_min_rows}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            p.append(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.master_port is not None and not 0 < self.master_port <= 65535:
            p.append(f"--master-port must be in [1, 65535], got {self.master_port}")
        if not self.master_addr:
            p.append("--master-addr must not be empty")
        if not isinstance(self.nnodes, int) or self.nnodes < 1:
            p.append(f"--nnodes must be >= 1, got {self.nnodes}")
        elif isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size % self.nnodes:
            p.append(f"--tensor-parallel-size {self.tensor_parallel_size} must be a multiple of --nnodes {self.nnodes}")
        elif not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            p.append(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        elif self.nnodes > 1 and self.master_port is None:
            p.append("--nnodes > 1 needs --master-addr and --master-port: every host must find the same rendezvous")
        if self.max_model_len is not None and self.max_model_len < 1:
            p.append(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if not self.host:
            p.append("--host must not be empty")
        if not 0 <= self.port <= 65535:
            p.append(f"--port must be in [0, 65535], got {self.port}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            p.append("--tls-cert-file and --tls-key-file go together: give both or neither")
        for flag, path in (("--tls-cert-file", self.tls_cert_file), ("--tls-key-file", self.tls_key_file)):
            if path and not os.access(path, os.R_OK):
                p.append(f"{flag} {path!r} is not a readable file")

        # Device-dependent checks only make sense once device and dtype are themselves valid.
        if self.device in DEVICE_CHOICES and self.dtype in DTYPE_CHOICES:
            cuda = _cuda_available()
            if self.device == "cuda" and not cuda:
                p.append("--device cuda was requested but torch sees no CUDA device")
            device = self.resolved_device() if (self.device != "cuda" or cuda) else "cuda"
            if (device == "cuda" and cuda and isinstance(self.tensor_parallel_size, int)
                    and isinstance(self.nnodes, int) and self.nnodes >= 1
                    and self.tensor_parallel_size // self.nnodes > _cuda_device_count()):
                # Each host runs its share of the ranks, one GPU each.
                per_host = self.tensor_parallel_size // self.nnodes
                p.append(f"--tensor-parallel-size {self.tensor_parallel_size} over --nnodes {self.nnodes} puts "
                         f"{per_host} ranks on this host, one GPU each; torch sees {_cuda_device_count()}")
            if self.dtype == "float16" and device != "cuda":
                p.append("--dtype float16 is only supported on CUDA (use float32 or bfloat16 on CPU)")
            if self.attention_backend in ("flash-attn", "flashinfer"):
                name, package = self.attention_backend, self.attention_backend.replace("-", "_")
                if device != "cuda":
                    p.append(f"--attention-backend {name} needs a CUDA device (use torch on CPU)")
                elif self.resolved_dtype_name() not in ("float16", "bfloat16"):
                    p.append(f"--attention-backend {name} needs --dtype float16 or bfloat16")
                elif not _importable(package):
                    p.append(f"--attention-backend {name} was requested but the {package} package "
                             "cannot be imported (install it, or use --attention-backend torch)")
            if self.attention_backend == "flex" and device == "cuda" and not _importable("triton"):
                p.append("--attention-backend flex on CUDA needs triton (FlexAttention compiles to Triton "
                         "kernels there); install it, or use --attention-backend torch")
        if p:
            raise ConfigError("invalid executor configuration:\n  - " + "\n  - ".join(p))

    # ----------------------------------------------------------------------------- resolution

    def resolved_device(self) -> str:
        """'cpu' or 'cuda' ('auto' picks cuda when torch sees a device)."""
        if self.device == "auto":
            return "cuda" if _cuda_available() else "cpu"
        return self.device

    def resolved_dtype_name(self) -> str:
        """'float32', 'bfloat16' or 'float16'; see `dtype_choice` for 'auto'."""
        return self.dtype_choice()[0]

    def dtype_choice(self) -> tuple[str, str]:
        """The dtype's name and a sentence saying why (logged, so 'auto' is never a mystery)."""
        if self.dtype != "auto":
            return self.dtype, f"--dtype {self.dtype}"
        if self.resolved_device() == "cuda":
            return "bfloat16", "auto: bfloat16 on CUDA"
        flags = cpu_bf16_flags()
        if flags:
            return "bfloat16", f"auto: this CPU has native bf16 ({', '.join(flags)})"
        return "float32", "auto: float32, this CPU has no native bf16 (avx512_bf16 or amx_bf16)"

    def resolved_dtype(self) -> Any:
        import torch

        return getattr(torch, self.resolved_dtype_name())


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The native-bf16 CPU flags present (avx512_bf16, amx_bf16), read from /proc/cpuinfo; empty
    where that file is missing (not Linux) or has none."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    present = set(line.split(":", 1)[1].split())
                    return [flag for flag in ("avx512_bf16", "amx_bf16") if flag in present]
    except OSError:
        pass
    return []


def _bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


def _int(raw: str) -> int:
    return int(raw.strip())


def _float(raw: str) -> float:
    return float(raw.strip())


_ENV_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "num_kv_blocks": _int,
    "gpu_memory_utilization": _float,
    "kv_cache_space": _float,
    "max_model_len": _int,
    "enforce_eager": _bool,
    "cpu_plain_weight_min_rows": _int,
    "cpu_keep_freed_memory": _bool,
    "port": _int,
    "tensor_parallel_size": _int,
    "nnodes": _int,
    "node_rank": _int,
    "master_port": _int,
    "dtype": lambda s: s.strip().lower(),
    "device": lambda s: s.strip().lower(),
    "attention_backend": lambda s: s.strip().lower(),
}


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def _importable(package: str) -> bool:
    try:
        importlib.import_module(package)
    except Exception:  # ImportError, or a broken CUDA extension raising OSError/RuntimeError
        return False
    return True
