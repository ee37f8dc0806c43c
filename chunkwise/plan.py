"""The step plan: what the scheduler asks the executor to compute in one step, and the answer.

One `StepPlan` is sent per engine step (with async scheduling, step n+1 is sent while step n
runs: it `follows_step_id` n and names the tokens n samples as `append_sampled`). It is *incremental*, in the spirit of vLLM V1's
SchedulerOutput: a request is sent in full once (`NewRequestData`, on admission or on resume
after preemption) and afterwards only as deltas (`RunningRequestDelta`: tokens and blocks
appended since the previous plan). So a decode step's plan has a size independent of context
length.

What to compute is said by `ScheduledChunk`: for request `req_id`, compute the query positions
`[num_computed_tokens, num_computed_tokens + num_tokens)` of its token sequence, write their KV
into the slots their positions map to through the block table, except positions below
`kv_write_start` (those already hold KV from a cached block shared with other requests; they are
never rewritten), and sample one token after the chunk if `sample` is set.

Invariants a valid plan keeps (checked by `validate_chunk_geometry`, and by the executor on
receipt, since the plan crosses a process boundary):
- `0 <= num_computed_tokens <= kv_write_start <= num_computed_tokens + num_tokens`
- `num_tokens >= 1`, and the executor knows at least `num_computed_tokens + num_tokens` tokens
  of the request and blocks covering every one of those positions.
- `sample` is set only when the chunk ends at the last known token.

This module is plain Python: no torch, no grpc.
"""

from __future__ import annotations

from dataclasses import dataclass, field


GREEDY_TEMPERATURE = 1e-5  # temperatures below this are treated as greedy (as in vLLM)


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the number of `b`-sized blocks that hold `a` items."""
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What the executor needs to pick the next token. Stop conditions live with the scheduler."""

    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0.0, say) means greedy
    top_p: float = 1.0  # (0, 1]; 1.0 disables
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0  # [0, 1]; 0.0 disables
    seed: int | None = None  # per-request seed; randomness is derived from (seed, position)
    num_logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus the top k

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


GREEDY = SamplingParams(temperature=0.0)


@dataclass(slots=True)
class NewRequestData:
    """A request the executor has not seen (or has dropped): sent once, in full."""

    req_id: str
    token_ids: list[int]  # every known token: the prompt, plus earlier outputs when resuming
    block_ids: list[int]  # the block table at admission
    sampling: SamplingParams


@dataclass(slots=True)
class RunningRequestDelta:
    """A request the executor already holds: only what was appended since the last plan."""

    req_id: str
    new_token_ids: list[int]  # tokens the scheduler accepted since (sampled outputs)
    new_block_ids: list[int]  # blocks appended to the block table since
    # Async scheduling: append the token this request sampled in the step the plan follows, which
    # the scheduler has not seen yet (its chunk in that step was still running when this plan was
    # built). Never set together with new_token_ids.
    append_sampled: bool = False


@dataclass(slots=True)
class ScheduledChunk:
    """Compute `num_tokens` query positions of one request, starting at `num_computed_tokens`."""

    req_id: str
    num_computed_tokens: int  # positions [0, this) already have KV in the cache
    num_tokens: int  # compute positions [num_computed_tokens, num_computed_tokens + num_tokens)
    kv_write_start: int  # write KV only for positions >= this; below it the KV is cached
    sample: bool  # sample a token after the last position of the chunk

    @property
    def end(self) -> int:
        return self.num_computed_tokens + self.num_tokens


@dataclass(slots=True)
class StepPlan:
    step_id: int
    # State changes, applied by the executor in this order: drop, add, extend.
    finished_req_ids: list[str] = field(default_factory=list)  # finished, aborted or preempted
    new_requests: list[NewRequestData] = field(default_factory=list)
    running: list[RunningRequestDelta] = field(default_factory=list)
    # The work, in batch order. Each request appears at most once.
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Set when this plan was built while step `follows_step_id` was in flight (async scheduling):
    # the executor runs it only right after that step ran, since it builds on that step's state.
    follows_step_id: int | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not (self.chunks or self.finished_req_ids or self.new_requests or self.running)


@dataclass(slots=True)
class SampledToken:
    req_id: str
    token_id: int
    logprob: float | None = None  # log-probability of token_id under the model (raw logits)
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # best first


@dataclass(slots=True)
class StepResult:
    step_id: int
    sampled: list[SampledToken] = field(default_factory=list)  # one per chunk with sample=True
    execute_seconds: float = 0.0  # time the executor spent on the step

    def by_request(self) -> dict[str, SampledToken]:
        return {s.req_id: s for s in self.sampled}


def validate_chunk_geometry(chunk: ScheduledChunk) -> None:
    """Raise ValueError if a chunk's numbers are inconsistent on their own."""
    if chunk.num_tokens < 1:
        raise ValueError(f"chunk for {chunk.req_id!r}: num_tokens must be >= 1, got {chunk.num_tokens}")
    if chunk.num_computed_tokens < 0:
        raise ValueError(f"chunk for {chunk.req_id!r}: num_computed_tokens must be >= 0")
    if not chunk.num_computed_tokens <= chunk.kv_write_start <= chunk.end:
        raise ValueError(
            f"chunk for {chunk.req_id!r}: kv_write_start {chunk.kv_write_start} outside "
            f"[{chunk.num_computed_tokens}, {chunk.end}]"
        )


@dataclass(frozen=True)
class ModelInfo:
    """What the executor says about its model in the handshake: executor.proto's ModelInfo, field
    for field (codec.py converts by this dataclass's fields, and tests/test_codec.py fails when
    the two differ)."""

    model_path: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: str  # "float32" | "bfloat16" | "float16"
    device: str  # "cpu", "cuda:0", ...
    attention_backend: str  # "torch" | "flashinfer" | "flash-attn" (provisional until Initialize)
    num_parameters: int
    decode_attention: str = ""  # torch backend: "paged-inductor" | "sdpa-folded"; else the backend's name
    prefill_attention: str = ""  # torch backend: "bf16-gemm" | "bf16-gemm-eager-softmax" | "sdpa"; else its name
    layer_ops: str = ""  # the element-wise ops between the matmuls: "compiled" | "eager"


@dataclass(frozen=True, kw_only=True)
class ExecutorInfo(ModelInfo):
    """The whole handshake answer (Initialize): the model, and the KV cache and epoch the
    scheduler sizes itself by."""

    epoch: str
    block_size: int
    num_kv_blocks: int
