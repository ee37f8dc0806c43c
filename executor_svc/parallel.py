"""Tensor parallelism on torch.distributed: one model sharded across `--tensor-parallel-size` ranks.

The layout follows vLLM's multiprocess executor. Rank 0 is the executor process: it keeps the gRPC
endpoint, the handshake, plan validation and sampling. It starts the other ranks of its host itself
(`torch.multiprocessing` with spawn) and, for every call that touches the model, broadcasts one
command to them (`initialize` with the block count it chose, `execute` with the plan). Every rank
runs the same forward over its shard; only rank 0 computes logits and samples. The scheduler sees
one executor and does not change.

Sharding (Megatron-style, in models/llama.py and its loader): q/k/v and gate/up are split by
output rows (each rank has num_heads / N query heads, num_kv_heads / N KV heads and
intermediate_size / N of the MLP), o_proj and down_proj by input columns, each followed by one
all-reduce. Embeddings, norms and lm_head are replicated (simpler than vocab-parallel, and the
models served here are small; noted as a cost in the README). Each rank's KV cache holds only its
KV heads, with the same block count on every rank, so block ids mean the same everywhere.

Plans reach the other ranks resolved: a delta that says `append_sampled` (async scheduling) names
a token only rank 0 has seen, so rank 0 replaces it by that token before broadcasting.

Several hosts (`--nnodes M --node-rank K`, torchrun's names): the N ranks are split evenly, N / M
per host; host 0 runs rank 0 (the executor proper) and its local ranks; every other host runs
`python -m executor_svc ... --node-rank K`, which serves nothing and only starts its ranks
(`run_node`). All meet at `--master-addr:--master-port` (torch.distributed's TCP rendezvous, which
has no authentication: keep it on a private network).

Failure: gloo on CPU, NCCL on CUDA. Rank 0 watches the ranks it started; if one exits, rank 0
logs it and exits too (status 1), so the step in flight fails with UNAVAILABLE at the scheduler,
which resynchronises with a restarted executor like after any executor crash. A rank on another
host that dies makes rank 0's next collective fail, and the server then exits the same way
(executor_svc/server.py). Ranks die with the process that started them (PR_SET_PDEATHSIG on
Linux; otherwise their next collective fails).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from chunkwise.plan import RunningRequestDelta, StepPlan

logger = logging.getLogger("chunkwise.executor.tp")

# How long a collective may wait for the other ranks (a step, or a rank's model load at start-up).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass
class Timings:
    """Time this process spent in collectives (rank 0's view: it includes waiting for the others).
    Read by bench/tp_step.py."""

    all_reduce_seconds: float = 0.0
    all_reduces: int = 0
    broadcast_seconds: float = 0.0
    broadcasts: int = 0


TIMINGS = Timings()


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (a no-op with one rank)."""
        if self.size > 1:
            t0 = time.perf_counter()
            dist.all_reduce(x)
            TIMINGS.all_reduce_seconds += time.perf_counter() - t0
            TIMINGS.all_reduces += 1
        return x


SINGLE = TPGroup()


def check_divisible(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int, model: str) -> None:
    """ValueError unless `size` ranks can share the heads and the MLP evenly."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {size}")
    if num_heads % size or num_kv_heads % size or intermediate_size % size:
        ok = [n for n in range(1, num_kv_heads + 1)
              if num_heads % n == 0 and num_kv_heads % n == 0 and intermediate_size % n == 0]
        raise ValueError(
            f"--tensor-parallel-size {size} does not divide {model}'s {num_heads} query heads, "
            f"{num_kv_heads} KV heads and MLP width {intermediate_size}; it can use "
            f"{', '.join(map(str, ok))}")


def threads_per_rank(ranks_here: int) -> int:
    """CPU threads for one of the `ranks_here` ranks sharing this host's cores."""
    return max(1, (os.cpu_count() or 1) // ranks_here)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_ranks(size: int, nnodes: int = 1, node_rank: int = 0) -> range:
    """The ranks that run on host `node_rank` of `nnodes`."""
    per = size // nnodes
    return range(node_rank * per, (node_rank + 1) * per)


def local_device_index(rank: int, size: int, nnodes: int = 1) -> int:
    """The GPU of `rank` on its host: each host numbers its GPUs from 0 and runs size / nnodes
    consecutive ranks (local_ranks), one GPU each."""
    return rank - local_ranks(size, nnodes, rank // (size // nnodes)).start


def init_group(rank: int, size: int, master_addr: str, master_port: int, backend: str) -> TPGroup:
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=size, timeout=COLLECTIVE_TIMEOUT)
    return TPGroup(rank, size)


def resolve_for_ranks(plan: StepPlan, last_sampled: dict[str, int | None]) -> StepPlan:
    """The plan as the other ranks run it: tokens named by append_sampled spelled out."""
    if not any(d.append_sampled for d in plan.running):
        return dataclasses.replace(plan, follows_step_id=None)
    running = []
    for d in plan.running:
        token = last_sampled.get(d.req_id) if d.append_sampled else None
        running.append(d if token is None else RunningRequestDelta(d.req_id, [token], d.new_block_ids))
    return dataclasses.replace(plan, running=running, follows_step_id=None)


def broadcast(command: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
    """Rank 0 sends `command`; the others receive and return it."""
    box: list[Any] = [command]
    t0 = time.perf_counter()
    dist.broadcast_object_list(box, src=0)
    TIMINGS.broadcast_seconds += time.perf_counter() - t0
    TIMINGS.broadcasts += 1
    received: tuple[Any, ...] = box[0]
    return received


def spawn_ranks(config, ranks, size: int, master_addr: str, master_port: int) -> list:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")  # a clean interpreter per rank: no forked torch/gRPC threads
    procs = [ctx.Process(target=worker_main, args=(config, rank, size, master_addr, master_port),
                         name=f"chunkwise-tp-rank{rank}", daemon=True) for rank in ranks]
    for p in procs:
        p.start()
    if procs:
        logger.info("tensor parallel: started ranks %s of %d (pids %s), rendezvous %s:%d",
                    ", ".join(map(str, ranks)), size, ", ".join(str(p.pid) for p in procs), master_addr, master_port)
    return procs


class Ranks:
    """Rank 0's handle on the other ranks: starts those of its host, broadcasts to all, watches
    the ones it started."""

    def __init__(self, config, size: int, master_addr: str = "127.0.0.1", master_port: int | None = None):
        self.size = size
        nnodes = config.nnodes
        port = master_port or free_port(master_addr)
        self.procs = spawn_ranks(config, local_ranks(size, nnodes, 0)[1:], size, master_addr, port)
        if nnodes > 1:
            logger.info("tensor parallel: waiting at %s:%d for the ranks of %d other host(s)",
                        master_addr, port, nnodes - 1)
        self._closing = False
        # Watched from now on: a rank that fails while loading must not leave rank 0 waiting for
        # it at the rendezvous until the collective timeout.
        if self.procs:
            threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()
        self.group = init_group(0, size, master_addr, port, backend_for(config_device(config)))

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        wait([p.sentinel for p in self.procs])
        if self._closing:
            return
        for p in self.procs:
            p.join(0.5)
        dead = [f"rank {i + 1} (exit code {p.exitcode})" for i, p in enumerate(self.procs) if p.exitcode is not None]
        logger.error("tensor parallel: %s died; the executor exits so that it is restarted whole",
                     ", ".join(dead) or "a rank")
        os._exit(1)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the ranks (they leave their loop) and leave the group."""
        if self._closing:
            return
        self._closing = True
        try:
            broadcast(("stop",))
        except Exception:  # a rank is already gone
            pass
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def config_device(config) -> torch.device:
    return torch.device(config.resolved_device())


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_node(config) -> int:
    """A host other than rank 0's (`--node-rank K > 0`): start this host's ranks, wait for them,
    and return the first non-zero exit status (SIGTERM/SIGINT stop them)."""
    from multiprocessing.connection import wait

    size = config.tensor_parallel_size
    ranks = local_ranks(size, config.nnodes, config.node_rank)
    procs = spawn_ranks(config, ranks, size, config.master_addr, config.master_port)

    def stop(*_):
        for p in procs:
            if p.is_alive():
                p.terminate()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    pending = list(procs)
    status = 0
    while pending:
        for sentinel in wait([p.sentinel for p in pending]):
            p = next(p for p in pending if p.sentinel == sentinel)
            p.join()
            pending.remove(p)
            if p.exitcode and not status:
                status = 1
                logger.error("tensor parallel: %s exited with %s; stopping this host's other ranks", p.name, p.exitcode)
                stop()
    return status


def worker_main(config, rank: int, size: int, master_addr: str, master_port: int) -> None:
    """Ranks 1..N-1: load the shard, then run what rank 0 broadcasts until it says stop."""
    from chunkwise import startup_heap
    from chunkwise.logging_setup import setup_logging

    startup_heap.pause_collection()
    from .engine import ModelRunner

    _die_with_parent()
    setup_logging()
    device = config_device(config)
    if device.type == "cpu":
        torch.set_num_threads(threads_per_rank(size // config.nnodes))
    else:
        torch.cuda.set_device(local_device_index(rank, size, config.nnodes))
    group = init_group(rank, size, master_addr, master_port, backend_for(device))
    runner = ModelRunner(config, tp=group)
    startup_heap.freeze_startup_heap(f"tensor parallel rank {rank}")
    logger.info("tensor parallel rank %d/%d ready", rank, size)
    try:
        while True:
            command = broadcast()
            op = command[0]
            if op == "initialize":
                runner.initialize(command[1], num_blocks=command[2])
            elif op == "execute":
                runner.execute_shard(command[1], command[2])
            elif op == "reset":
                runner.reset()
            elif op == "stop":
                break
            else:
                raise RuntimeError(f"unknown tensor-parallel command {op!r}")
    except Exception:
        logger.exception("tensor parallel rank %d failed", rank)
        os._exit(1)
    dist.destroy_process_group()
