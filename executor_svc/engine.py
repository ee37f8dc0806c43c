"""ModelRunner: the executor core the gRPC server wraps.

    runner = ModelRunner(ExecutorConfig(model="/path/to/checkpoint"))
    num_blocks = runner.initialize(block_size=16)   # allocate the paged KV cache
    result = runner.execute(plan)                   # one StepPlan -> one StepResult

The runner keeps per-request state (known tokens, block table, sampling params, seed) from the
incremental plans. Each plan is validated completely before anything changes, since it crosses a
process boundary: an inconsistent plan raises PlanError naming the request and field, and leaves
the runner exactly as it was. Then it applies finished_req_ids, new_requests and running deltas
(in that order) and runs all chunks as one flat batch: every linear layer sees all scheduled
tokens at once, attention runs per request over its block table, and only the rows that sample go
through lm_head.

KV-write contract: positions below a chunk's kv_write_start are never written (their slots belong
to cached blocks that other requests may share); a fully cached prompt is sent as a one-token
chunk at its last position with kv_write_start = its length, so it computes one query and writes
nothing.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch.nn.utils.rnn import pad_sequence

from chunkwise.plan import (
    ModelInfo,
    NewRequestData,
    RunningRequestDelta,
    SampledToken,
    SamplingParams,
    ScheduledChunk,
    StepPlan,
    StepResult,
    cdiv,
    validate_chunk_geometry,
)

from . import cpu_malloc
from .attention import (AttentionBackend, BatchLayout, FlexAttentionBackend, StepAttention, TorchAttentionBackend,
                        select_backend)
from .attention.paged_decode import PagedDecodeKernel
from .attention.prefill_softmax import PrefillSoftmaxKernel
from .attention.torch_backend import prefill_gemm_pays
from .config import ExecutorConfig, cpu_bf16_flags
from .kv_cache import KVCache, KVCacheShape, plan_num_blocks
from .loader import load_model, read_spec
from .models import packed_linear
from .models.layer_ops import CompiledLayerOps
from .models.llama import Linear
from .parallel import SINGLE, Ranks, TPGroup, broadcast, check_divisible, resolve_for_ranks, threads_per_rank
from .sampling import new_random_seed, sample

logger = logging.getLogger("chunkwise.executor")


def _memory_available() -> int | None:
    """Bytes of memory available to new allocations (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class PlanError(ValueError):
    """A StepPlan that is inconsistent with itself or with the executor's state."""


@dataclass
class _Request:
    token_ids: list[int]
    block_ids: list[int]
    sampling: SamplingParams
    seed: int  # the request's seed, or one drawn when the executor first saw it
    # Positions [0, kv_end) hold KV for this request. None until its first chunk ran: the first
    # chunk's num_computed_tokens (a prefix-cache hit) is taken on trust.
    kv_end: int | None = None
    # The last token sampled for it and the step that sampled it, for a delta that says
    # append_sampled (async scheduling: the scheduler had not seen the token yet).
    last_sampled: int | None = None
    sampled_in_step: int | None = None
    _block_tensor: torch.Tensor | None = field(default=None, repr=False)

    def block_tensor(self) -> torch.Tensor:
        # Cached because block tables change only once every block_size tokens.
        if self._block_tensor is None or self._block_tensor.numel() != len(self.block_ids):
            self._block_tensor = torch.tensor(self.block_ids, dtype=torch.int64)
        return self._block_tensor


@dataclass
class _View:
    """A request as it will be once the plan's state changes are applied (for validation)."""

    tokens: Sequence[int]
    blocks: Sequence[int]
    extra_tokens: Sequence[int] = ()
    extra_blocks: Sequence[int] = ()
    kv_end: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) + len(self.extra_tokens)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + len(self.extra_blocks)

    def block(self, i: int) -> int:
        return self.blocks[i] if i < len(self.blocks) else self.extra_blocks[i - len(self.blocks)]


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    layout: BatchLayout
    sample_rows: list[int]  # batch row of each sampling chunk's last token
    sample_chunks: list[ScheduledChunk]


def _padded(t: torch.Tensor, n: int) -> torch.Tensor:
    """t [T] with zeros appended up to n entries (t itself when T == n)."""
    return t if t.numel() == n else torch.cat([t, t.new_zeros(n - t.numel())])


class ModelRunner:
    """Loads the model at construction; `initialize` allocates the KV cache; `execute` runs steps.
    Not thread-safe: the server runs one call at a time.

    With --tensor-parallel-size N > 1 the runner built without `tp` is rank 0: it starts ranks
    1..N-1 (each a ModelRunner built with its `tp`, driven by executor_svc.parallel.worker_main)
    and broadcasts to them every initialize, reset and step. `close()` stops them."""

    def __init__(self, config: ExecutorConfig, tp: TPGroup | None = None):
        config.validate()
        if not config.model:
            raise ValueError("no model given: pass --model DIR (a local checkpoint directory)")
        self.config = config
        self._ranks: Ranks | None = None
        if tp is None and config.tensor_parallel_size > 1:
            size = config.tensor_parallel_size
            spec, _ = read_spec(config.model, config.max_model_len)  # refuse before starting anything
            check_divisible(spec.num_heads, spec.num_kv_heads, spec.intermediate_size, size, spec.architecture)
            if config.resolved_device() == "cpu":
                torch.set_num_threads(threads_per_rank(size // config.nnodes))  # a share of this host's cores
            self._ranks = Ranks(config, size, config.master_addr, config.master_port)
            tp = self._ranks.group
        self.tp = tp or SINGLE
        self.device = torch.device(config.resolved_device())
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        dtype_name, dtype_reason = config.dtype_choice()
        self.dtype: torch.dtype = getattr(torch, dtype_name)
        logger.info("dtype %s (%s)", dtype_name, dtype_reason)
        loaded = load_model(config.model, self.dtype, self.device, config.max_model_len, tp=self.tp)
        self.model = loaded.model
        self.spec = loaded.spec
        # This rank's attention heads (all of them without tensor parallelism).
        self.num_heads = self.spec.num_heads // self.tp.size
        self.num_kv_heads = self.spec.num_kv_heads // self.tp.size
        self.max_model_len = loaded.max_model_len
        # Provisional until initialize() knows the block size (flash-attn needs a multiple of 256).
        backend_cls, _ = select_backend(config.attention_backend, self.device, self.dtype,
                                        self.spec.head_dim, None)
        self._info = ModelInfo(
            model_path=str(loaded.path),
            architecture=self.spec.architecture,
            vocab_size=self.spec.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=self.spec.eos_token_ids,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            attention_backend=backend_cls.name,
            num_parameters=self.model.num_parameters(),
        )
        # After num_parameters() above: packing frees the plain weights it counts.
        # Steps are padded to bounded row counts where oneDNN multiplies (packed_linear.padded_rows).
        self.pad_rows = self.device.type == "cpu" and self._pack_linear_layers(config.cpu_plain_weight_min_rows)
        # Built (compiled or loaded from inductor's on-disk cache) and checked here, before the
        # server reports ready, so that no request ever waits for a compile.
        self.decode_kernel: PagedDecodeKernel | None = None
        if backend_cls is TorchAttentionBackend and self.device.type == "cpu":
            self.decode_kernel = PagedDecodeKernel(self.num_heads, self.num_kv_heads, self.spec.head_dim,
                                                   self.dtype, self.device, config.enforce_eager)
            logger.info("decode attention: %s", self.decode_kernel.reason)
        # bf16 prefill as GEMMs where the CPU multiplies bf16 natively with AVX512-BF16 but has no
        # AMX (see torch_backend.py), with the softmax between them compiled, built here for the
        # same reason. With AMX, torch's flash kernel multiplies its tiles on AMX and beats the
        # GEMM path (seed-shaped run 1.27x, its mixed steps 1.48x; bench/RESULTS.md section 2b).
        self.prefill_bf16_gemm = self.device.type == "cpu" and self.dtype == torch.bfloat16 and \
            prefill_gemm_pays(cpu_bf16_flags())
        self.prefill_softmax: PrefillSoftmaxKernel | None = None
        if backend_cls is TorchAttentionBackend and self.prefill_bf16_gemm:
            self.prefill_softmax = PrefillSoftmaxKernel(self.device, config.enforce_eager)
            logger.info("prefill attention: %s", self.prefill_softmax.reason)
        # The element-wise ops between the matmuls (residual add + RMSNorm, RoPE) compiled, built
        # here for the same reason; the model runs them eager where they are not ready.
        if self.device.type == "cpu":
            attn = self.model.layers[0].self_attn
            layer_ops = CompiledLayerOps(self.spec.hidden_size, attn.q_size + 2 * attn.kv_size,
                                         self.num_heads + self.num_kv_heads, self.spec.head_dim, self.dtype,
                                         self.device, config.enforce_eager)
            logger.info("element-wise ops: %s", layer_ops.reason)
            if layer_ops.ready:
                self.model.layer_ops = layer_ops
        self._info = replace(self._info, layer_ops=self.model.layer_ops.name)
        if self.device.type == "cpu" and config.cpu_keep_freed_memory:
            # Last: what loading, packing and the kernel's build freed goes back to the kernel first.
            logger.info("memory: %s", cpu_malloc.keep_freed_memory())
        self.kv_cache: KVCache | None = None
        self.backend: AttentionBackend | None = None
        self.block_size: int | None = None
        self._requests: dict[str, _Request] = {}
        self.last_step_id: int | None = None  # the last plan executed since initialize()
        self.last_layout: BatchLayout | None = None  # the last step's layout (debugging, tests)

    def _pack_linear_layers(self, plain_rows: int) -> bool:
        """oneDNN-packed linear weights, float32 copies of bf16/fp16 ones where this CPU has no
        matmul in their dtype, and plain second copies for batches of >= plain_rows rows (0:
        none), unless the extra copies would crowd memory (packed_linear.py). True if packed."""
        notes = []
        linear_bytes = sum(m.weight.numel() * m.weight.element_size()
                           for m in self.model.modules() if isinstance(m, Linear))
        available = _memory_available()
        # A second copy of every linear weight, and a float32 one twice its size, are for speed
        # only: never at the risk of swapping.
        crowded = ""
        if available is not None and linear_bytes > available // 4:
            crowded = (f"the linear weights, {linear_bytes >> 20} MiB, are over 1/4 of the memory available, "
                       f"{available >> 20} MiB")
        if plain_rows and crowded:
            plain_rows = 0
            notes.append(f"no plain copies: {crowded}")
        reduced = self.dtype in (torch.bfloat16, torch.float16)
        dtype_name = str(self.dtype).removeprefix("torch.")
        rows_hint = packed_linear.layer_rows_hint(self.dtype, cpu_bf16_flags())
        if not self.model.pack_linear_weights(plain_rows, widen=reduced and not crowded, rows_hint=rows_hint):
            logger.info("linear layers: F.linear (oneDNN packing unavailable or refused by its self-check)%s",
                        f"; no float32 copies of the {dtype_name} weights: {crowded}" if reduced and crowded else "")
            return False
        if self.model.widened_bytes:
            notes.append(f"float32 copies of the {dtype_name} weights "
                         f"({self.model.widened_bytes >> 20} MiB): oneDNN has no matmul in that dtype on this "
                         "CPU; float32 arithmetic, each result rounded back")
        if plain_rows and not self.model.plain_layers:
            notes.append("no plain copies: the float32 copies are the faster ones at every batch size")
        elif plain_rows:
            notes.append(f"for batches of >= {plain_rows} rows F.linear on a second, plain copy of the weights "
                         f"({self.model.plain_layers} layers, {self.model.plain_bytes >> 20} MiB)")
        if rows_hint != packed_linear.ROWS_HINT:
            notes.append(f"q/k/v, o and down packed for {rows_hint} row(s), not {packed_linear.ROWS_HINT}: with AMX "
                         "oneDNN then splits their prefill-sized bf16 batches over every thread")
        notes.append("each step padded to a bounded row count (a multiple of 8 up to 512, under 1/32 more "
                     "beyond), so that oneDNN compiles kernels for few")
        logger.info("linear layers: oneDNN with prepacked weights%s", "".join(f"; {n}" for n in notes))
        return True

    # ------------------------------------------------------------------------------ public API

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks if self.kv_cache is not None else 0

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def has_request(self, req_id: str) -> bool:
        return req_id in self._requests

    def kv_cache_shape(self) -> KVCacheShape:
        s = self.spec  # this rank's KV heads only, with tensor parallelism
        return KVCacheShape(s.num_layers, self.num_kv_heads, s.head_dim, self.dtype)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (if this runner started them)."""
        if self._ranks is not None:
            self._ranks.close()
            self._ranks = None

    def initialize(self, block_size: int, num_blocks: int | None = None) -> int:
        """Allocate the KV cache for the scheduler's block size; returns the number of blocks
        (`num_blocks`: exactly that many, as rank 0 tells the other ranks). Calling it again
        reallocates and drops every request."""
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        backend_cls, reason = select_backend(self.config.attention_backend, self.device, self.dtype,
                                             self.spec.head_dim, block_size)
        backend_cls.check_block_size(block_size)
        self.reset()
        # Free the old cache before sizing the new one from free memory.
        self.kv_cache = None
        self.backend = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        shape = self.kv_cache_shape()
        if num_blocks is None:
            num_blocks = plan_num_blocks(shape, block_size, self.device, self.config.num_kv_blocks,
                                         self.config.gpu_memory_utilization, self.config.kv_cache_space)
        if self._ranks is not None:  # the same block count on every rank: block ids mean the same
            broadcast(("initialize", block_size, num_blocks))
        self.kv_cache = KVCache(shape, num_blocks, block_size, self.device)
        if backend_cls is TorchAttentionBackend:
            torch_backend = TorchAttentionBackend(self.num_heads, self.num_kv_heads, self.spec.head_dim,
                                                  decode_kernel=self.decode_kernel,
                                                  prefill_bf16_gemm=self.prefill_bf16_gemm,
                                                  prefill_softmax=self.prefill_softmax)
            backend: AttentionBackend = torch_backend
            decode, prefill = torch_backend.decode_path, torch_backend.prefill_path
        elif backend_cls is FlexAttentionBackend:  # --enforce-eager: FlexAttention's dense eager reference
            backend = FlexAttentionBackend(self.num_heads, self.num_kv_heads, self.spec.head_dim,
                                           compile=not self.config.enforce_eager)
            if self.device.type == "cpu":  # inductor's CPU template is wrong at some block sizes on some CPUs
                why = backend.cpu_self_check(block_size, self.dtype)
                if why is not None:
                    self.kv_cache = None
                    raise ValueError(f"--attention-backend flex cannot be used: {why}; use --attention-backend "
                                     "torch (the CPU default) or another --block-size")
            decode = prefill = backend_cls.name
        else:
            backend = backend_cls(self.num_heads, self.num_kv_heads, self.spec.head_dim)
            decode = prefill = backend_cls.name
        self.backend = backend
        self.block_size = block_size
        self._info = replace(self._info, attention_backend=backend_cls.name, decode_attention=decode,
                             prefill_attention=prefill)
        logger.info("attention backend %s (%s), decode rows: %s, prefill: %s; KV cache %d blocks x %d tokens, "
                    "%.1f MiB", backend_cls.name, reason, decode, prefill, num_blocks, block_size,
                    self.kv_cache.nbytes / 2**20)
        return num_blocks

    def reset(self) -> None:
        """Drop all request state (the KV cache stays allocated)."""
        if self._ranks is not None:
            broadcast(("reset",))
        self._requests.clear()
        self.last_step_id = None
        self.last_layout = None

    def execute(self, plan: StepPlan) -> StepResult:
        result, _ = self._execute(plan, want_all_logits=False)
        return result

    def execute_shard(self, plan: StepPlan, want_all_logits: bool = False) -> None:
        """Ranks other than 0: run a plan rank 0 validated and broadcast, without sampling (and
        through the last layer on the rows rank 0 keeps: all of them where it wants every logit)."""
        self._execute(plan, want_all_logits=want_all_logits, do_sample=False)

    def execute_with_logits(self, plan: StepPlan) -> tuple[StepResult, dict[str, torch.Tensor]]:
        """Like execute, plus float32 logits [num_tokens, vocab] of every computed position of
        every chunk, keyed by req_id. For tests and debugging: it runs lm_head on all rows."""
        return self._execute(plan, want_all_logits=True)

    # ------------------------------------------------------------------------------ execution

    @torch.inference_mode()
    def _execute(self, plan: StepPlan, want_all_logits: bool,
                 do_sample: bool = True) -> tuple[StepResult, dict[str, torch.Tensor]]:
        t0 = time.perf_counter()
        if self.kv_cache is None or self.backend is None or self.block_size is None:
            raise RuntimeError("the executor is not initialized: call initialize(block_size) first")
        self._validate(plan)
        if self._ranks is not None:  # valid: every rank runs it (tokens only rank 0 knows spelled out)
            sampled_here = {d.req_id: self._requests[d.req_id].last_sampled for d in plan.running if d.append_sampled}
            broadcast(("execute", resolve_for_ranks(plan, sampled_here), want_all_logits))
        self._apply_state_changes(plan)
        self.last_step_id = plan.step_id
        if not plan.chunks:
            return StepResult(plan.step_id, [], time.perf_counter() - t0), {}

        batch = self._build_batch(plan.chunks)
        self.last_layout = batch.layout
        attend = StepAttention(self.backend, self.kv_cache, batch.layout)
        # Only the sampling rows' hidden states leave the model, unless every row's logits are
        # wanted. Every rank computes the same rows (the plan says which), so shapes agree.
        keep = None if want_all_logits else batch.sample_rows
        input_ids, positions = batch.input_ids, batch.positions
        if self.pad_rows:
            # Row counts from a bounded set (packed_linear.padded_rows): the pad rows are token 0
            # at position 0, attention leaves them out (StepAttention), and the last layer's kept
            # rows are padded with copies of the first. Every row is computed on its own, so a
            # real row's values do not depend on the padding.
            input_ids = _padded(input_ids, packed_linear.padded_rows(input_ids.numel()))
            positions = _padded(positions, input_ids.numel())
            if keep:
                keep = keep + [keep[0]] * (packed_linear.padded_rows(len(keep)) - len(keep))
        keep_rows = None if keep is None else torch.tensor(keep, dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, positions, attend, keep_rows)
        for c in plan.chunks:
            st = self._requests[c.req_id]
            st.kv_end = c.end if st.kv_end is None else max(st.kv_end, c.end)
        if not do_sample:  # another rank: its part of the forward is done
            return StepResult(plan.step_id, [], time.perf_counter() - t0), {}

        all_logits: dict[str, torch.Tensor] = {}
        if want_all_logits:
            logits = self.model.compute_logits(hidden)[: batch.layout.num_tokens]
            starts = batch.layout.query_start
            for i, c in enumerate(plan.chunks):
                all_logits[c.req_id] = logits[starts[i] : starts[i + 1]].cpu()
            sample_logits = logits[batch.sample_rows] if batch.sample_rows else logits[:0]
        elif batch.sample_rows:
            sample_logits = self.model.compute_logits(hidden)[: len(batch.sample_rows)]  # the sampling rows, in order
        else:
            sample_logits = hidden.new_empty((0, self.spec.vocab_size), dtype=torch.float32)

        sampled: list[SampledToken] = []
        if batch.sample_chunks:
            reqs = [self._requests[c.req_id] for c in batch.sample_chunks]
            outs = sample(sample_logits, [r.sampling for r in reqs], [r.seed for r in reqs],
                          [c.end for c in batch.sample_chunks])
            sampled = [SampledToken(c.req_id, o.token_id, o.logprob, o.top_logprobs)
                       for c, o in zip(batch.sample_chunks, outs)]
            for r, o in zip(reqs, outs):
                r.last_sampled, r.sampled_in_step = o.token_id, plan.step_id
        return StepResult(plan.step_id, sampled, time.perf_counter() - t0), all_logits

    def _build_batch(self, chunks: list[ScheduledChunk]) -> _Batch:
        bs = self.block_size
        assert bs is not None
        ids: list[int] = []
        q_lens: list[int] = []
        starts: list[int] = [0]
        tables: list[torch.Tensor] = []
        num_blocks: list[int] = []
        sample_rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        for c in chunks:
            st = self._requests[c.req_id]
            ids.extend(st.token_ids[c.num_computed_tokens : c.end])
            q_lens.append(c.num_tokens)
            starts.append(starts[-1] + c.num_tokens)
            nb = cdiv(c.end, bs)
            num_blocks.append(nb)
            tables.append(st.block_tensor()[:nb])
            if c.sample:
                sample_rows.append(starts[-1] - 1)
                sample_chunks.append(c)
        total = starts[-1]
        r = len(chunks)

        # Positions and slots for every row, vectorised: row -> its request -> block -> slot.
        q_len_t = torch.tensor(q_lens, dtype=torch.int64)
        row_req = torch.repeat_interleave(torch.arange(r), q_len_t)
        first_pos = torch.tensor([c.num_computed_tokens for c in chunks], dtype=torch.int64)
        offset = first_pos - torch.tensor(starts[:-1], dtype=torch.int64)
        positions = torch.arange(total, dtype=torch.int64) + offset[row_req]
        block_table = pad_sequence(tables, batch_first=True, padding_value=0)
        slots = block_table[row_req, positions // bs] * bs + positions % bs
        write_start = torch.tensor([c.kv_write_start for c in chunks], dtype=torch.int64)
        write = positions >= write_start[row_req]
        if bool(write.all()):
            write_rows, slot_mapping = None, slots
        else:
            write_rows = write.nonzero().squeeze(1)
            slot_mapping = slots[write_rows]

        dev = self.device
        layout = BatchLayout(
            num_tokens=total,
            block_size=bs,
            query_start=starts,
            num_computed=[c.num_computed_tokens for c in chunks],
            context_lens=[c.end for c in chunks],
            num_blocks=num_blocks,
            block_table=block_table.to(dev),
            slot_mapping=slot_mapping.to(dev),
            write_rows=write_rows.to(dev) if write_rows is not None else None,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev)
        return _Batch(input_ids, positions.to(dev), layout, sample_rows, sample_chunks)

    # ------------------------------------------------------------------------------ plan state

    def _apply_state_changes(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids:
            self._requests.pop(req_id, None)
        for nr in plan.new_requests:
            seed = nr.sampling.seed if nr.sampling.seed is not None else new_random_seed()
            self._requests[nr.req_id] = _Request(list(nr.token_ids), list(nr.block_ids), nr.sampling, seed)
        for d in plan.running:
            st = self._requests[d.req_id]
            if d.append_sampled:
                assert st.last_sampled is not None  # checked by _validate
                st.token_ids.append(st.last_sampled)
            st.token_ids.extend(d.new_token_ids)
            st.block_ids.extend(d.new_block_ids)

    def _validate(self, plan: StepPlan) -> None:
        """Raise PlanError for anything inconsistent; mutates nothing."""
        assert self.kv_cache is not None and self.block_size is not None
        vocab, nblocks, bs = self.spec.vocab_size, self.kv_cache.num_blocks, self.block_size

        # A plan built while another step was in flight builds on that step's state.
        follows = plan.follows_step_id
        if follows is not None and follows != self.last_step_id:
            raise PlanError(f"plan follows step {follows}, but the last step run is "
                            f"{'none' if self.last_step_id is None else self.last_step_id}")

        # Unknown ids in finished_req_ids are ignored: dropping is idempotent, and a scheduler
        # may finish requests that never reached the executor (aborted while waiting).
        dropped = set(plan.finished_req_ids)
        views: dict[str, _View] = {
            rid: _View(st.token_ids, st.block_ids, kv_end=st.kv_end)
            for rid, st in self._requests.items() if rid not in dropped
        }

        for nr in plan.new_requests:
            if not isinstance(nr, NewRequestData):
                raise PlanError(f"new_requests holds a {type(nr).__name__}, not NewRequestData")
            where = f"new request {nr.req_id!r}"
            if not isinstance(nr.req_id, str) or not nr.req_id:
                raise PlanError(f"{where}: req_id must be a non-empty string")
            if nr.req_id in views:
                held = "appears twice in new_requests" if nr.req_id not in self._requests or nr.req_id in dropped \
                    else "is already held by the executor (duplicate new request; finish it first)"
                raise PlanError(f"{where}: {held}")
            if not nr.token_ids:
                raise PlanError(f"{where}: token_ids is empty")
            self._check_tokens(nr.token_ids, vocab, f"{where}: token_ids")
            self._check_blocks(nr.block_ids, nblocks, f"{where}: block_ids")
            self._check_sampling(nr.sampling, vocab, where)
            views[nr.req_id] = _View(nr.token_ids, nr.block_ids)

        seen_running: set[str] = set()
        for d in plan.running:
            if not isinstance(d, RunningRequestDelta):
                raise PlanError(f"running holds a {type(d).__name__}, not RunningRequestDelta")
            where = f"running request {d.req_id!r}"
            if d.req_id in seen_running:
                raise PlanError(f"{where}: appears twice in running")
            seen_running.add(d.req_id)
            view = views.get(d.req_id)
            if view is None:
                raise PlanError(f"{where}: unknown req_id (never sent as a new request, or finished)")
            self._check_tokens(d.new_token_ids, vocab, f"{where}: new_token_ids")
            self._check_blocks(d.new_block_ids, nblocks, f"{where}: new_block_ids")
            view.extra_tokens, view.extra_blocks = d.new_token_ids, d.new_block_ids
            if d.append_sampled:
                if d.new_token_ids:
                    raise PlanError(f"{where}: append_sampled and new_token_ids together")
                st = self._requests.get(d.req_id)
                if follows is None or st is None or st.sampled_in_step != follows or st.last_sampled is None:
                    raise PlanError(f"{where}: append_sampled, but the request sampled nothing in the step "
                                    f"this plan follows ({'none' if follows is None else follows})")
                view.extra_tokens = (st.last_sampled,)

        # Every slot written this step, per block: (first offset, end offset, req_id).
        writes: dict[int, list[tuple[int, int, str]]] = {}
        seen_chunks: set[str] = set()
        for c in plan.chunks:
            if not isinstance(c, ScheduledChunk):
                raise PlanError(f"chunks holds a {type(c).__name__}, not ScheduledChunk")
            where = f"chunk for {c.req_id!r}"
            for name in ("num_computed_tokens", "num_tokens", "kv_write_start"):
                value = getattr(c, name)
                if not isinstance(value, int) or isinstance(value, bool):
                    raise PlanError(f"{where}: {name} must be an int, got {value!r}")
            try:
                validate_chunk_geometry(c)
            except ValueError as e:
                raise PlanError(str(e)) from None
            if c.req_id in seen_chunks:
                raise PlanError(f"{where}: the request has more than one chunk in this plan")
            seen_chunks.add(c.req_id)
            view = views.get(c.req_id)
            if view is None:
                raise PlanError(f"{where}: unknown req_id (never sent as a new request, or finished)")
            known = view.num_tokens
            if c.end > known:
                raise PlanError(f"{where}: num_computed_tokens {c.num_computed_tokens} + num_tokens {c.num_tokens} "
                                f"= {c.end} exceeds the {known} tokens the executor knows")
            if c.end > self.max_model_len:
                raise PlanError(f"{where}: chunk ends at position {c.end}, beyond max_model_len {self.max_model_len}")
            if c.sample and c.end != known:
                raise PlanError(f"{where}: sample is set but the chunk ends at {c.end}, not at the last known "
                                f"token ({known})")
            needed = cdiv(c.end, bs)
            if view.num_blocks < needed:
                raise PlanError(f"{where}: block table has {view.num_blocks} blocks, positions [0, {c.end}) "
                                f"need {needed} (block size {bs})")
            if view.kv_end is not None and c.kv_write_start > view.kv_end:
                raise PlanError(f"{where}: kv_write_start {c.kv_write_start} claims cached KV up to there, but "
                                f"the request's KV only covers positions [0, {view.kv_end}) "
                                f"(num_computed_tokens {c.num_computed_tokens})")
            p = c.kv_write_start
            while p < c.end:
                b, off = divmod(p, bs)
                off_end = min(bs, off + c.end - p)
                writes.setdefault(view.block(b), []).append((off, off_end, c.req_id))
                p += off_end - off

        for block, spans in writes.items():
            if len(spans) > 1:
                spans.sort()
                for (a0, a1, ra), (b0, b1, rb) in zip(spans, spans[1:]):
                    if b0 < a1:
                        raise PlanError(f"chunks for {ra!r} and {rb!r} both write KV block {block} (offsets "
                                        f"[{max(a0, b0)}, {min(a1, b1)})); each slot is written at most once")

    @staticmethod
    def _check_tokens(ids: Sequence[int], vocab: int, where: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise PlanError(f"{where}: token id {bad} outside the vocabulary [0, {vocab})")

    @staticmethod
    def _check_blocks(ids: Sequence[int], num_blocks: int, where: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= num_blocks):
            bad = next(b for b in ids if not 0 <= b < num_blocks)
            raise PlanError(f"{where}: block id {bad} outside [0, {num_blocks})")

    @staticmethod
    def _check_sampling(p: SamplingParams, vocab: int, where: str) -> None:
        if not isinstance(p, SamplingParams):
            raise PlanError(f"{where}: sampling must be SamplingParams, got {type(p).__name__}")
        if not (math.isfinite(p.temperature) and p.temperature >= 0.0):
            raise PlanError(f"{where}: sampling.temperature must be finite and >= 0, got {p.temperature}")
        if not 0.0 < p.top_p <= 1.0:
            raise PlanError(f"{where}: sampling.top_p must be in (0, 1], got {p.top_p}")
        if not isinstance(p.top_k, int) or p.top_k < -1:
            raise PlanError(f"{where}: sampling.top_k must be -1, 0 (disabled) or a positive int, got {p.top_k}")
        if not 0.0 <= p.min_p <= 1.0:
            raise PlanError(f"{where}: sampling.min_p must be in [0, 1], got {p.min_p}")
        if p.seed is not None and not isinstance(p.seed, int):
            raise PlanError(f"{where}: sampling.seed must be an int or None, got {p.seed!r}")
        if p.num_logprobs is not None and not (isinstance(p.num_logprobs, int) and 0 <= p.num_logprobs <= vocab):
            raise PlanError(f"{where}: sampling.num_logprobs must be None or in [0, {vocab}], got {p.num_logprobs}")
