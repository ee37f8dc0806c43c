"""Conversion between the plan dataclasses (chunkwise.plan) and their protobuf mirror.

Kept in one place so the two sides cannot drift: tests/test_codec.py round-trips every field.
Decoding does only type-level work; semantic checks of a plan happen in the executor, which owns
the state a plan is checked against.
"""

from __future__ import annotations

from dataclasses import fields

from chunkwise.plan import (
    ExecutorInfo,
    ModelInfo,
    NewRequestData,
    RunningRequestDelta,
    SampledToken,
    SamplingParams,
    ScheduledChunk,
    StepPlan,
    StepResult,
)
from chunkwise.v1 import executor_pb2 as pb

# The handshake's model fields: the dataclass and the proto message have the same names
# (tests/test_codec.py checks it), so a field added to both needs no code here.
MODEL_INFO_FIELDS = tuple(f.name for f in fields(ModelInfo))


# ---- the handshake (Initialize) -------------------------------------------------------------


def model_info_to_proto(info: ModelInfo) -> pb.ModelInfo:
    """The executor's side: its ModelRunner.info, field by field."""
    return pb.ModelInfo(**{name: getattr(info, name) for name in MODEL_INFO_FIELDS})


def executor_info_from_proto(resp: pb.InitializeResponse) -> ExecutorInfo:
    """The scheduler's side of the same message."""
    model = {name: getattr(resp.model, name) for name in MODEL_INFO_FIELDS}
    model["eos_token_ids"] = tuple(model["eos_token_ids"])
    return ExecutorInfo(epoch=resp.executor_epoch, block_size=resp.block_size, num_kv_blocks=resp.num_kv_blocks,
                        **model)


# ---- step plans and results -------------------------------------------------------------------


def sampling_to_proto(sp: SamplingParams) -> pb.ExecSamplingParams:
    msg = pb.ExecSamplingParams(
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p
    )
    if sp.seed is not None:
        msg.seed = sp.seed
    if sp.num_logprobs is not None:
        msg.num_logprobs = sp.num_logprobs
    return msg


def sampling_from_proto(msg: pb.ExecSamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        num_logprobs=msg.num_logprobs if msg.HasField("num_logprobs") else None,
    )


# The step codec runs every step on both sides, so it builds repeated fields in place
# (`.add(...)`: a message passed to a constructor is copied into the field) and dataclasses with
# positional arguments. For a 32-decode step that is ~2x less codec time than plain constructors
# (bench/RESULTS.md section 4).


def plan_to_proto(plan: StepPlan, executor_epoch: str) -> pb.StepPlan:
    msg = pb.StepPlan(step_id=plan.step_id, executor_epoch=executor_epoch, finished_req_ids=plan.finished_req_ids)
    for r in plan.new_requests:
        msg.new_requests.add(req_id=r.req_id, token_ids=r.token_ids, block_ids=r.block_ids,
                             sampling=sampling_to_proto(r.sampling))
    add_delta = msg.running.add
    for d in plan.running:
        add_delta(req_id=d.req_id, new_token_ids=d.new_token_ids, new_block_ids=d.new_block_ids,
                  append_sampled=d.append_sampled)
    add_chunk = msg.chunks.add
    for c in plan.chunks:
        add_chunk(req_id=c.req_id, num_computed_tokens=c.num_computed_tokens, num_tokens=c.num_tokens,
                  kv_write_start=c.kv_write_start, sample=c.sample)
    if plan.follows_step_id is not None:
        msg.follows_step_id = plan.follows_step_id
    return msg


def plan_from_proto(msg: pb.StepPlan) -> StepPlan:
    return StepPlan(
        step_id=msg.step_id,
        finished_req_ids=list(msg.finished_req_ids),
        new_requests=[
            NewRequestData(r.req_id, list(r.token_ids), list(r.block_ids), sampling_from_proto(r.sampling))
            for r in msg.new_requests
        ],
        running=[
            RunningRequestDelta(d.req_id, list(d.new_token_ids), list(d.new_block_ids), d.append_sampled)
            for d in msg.running
        ],
        chunks=[
            ScheduledChunk(c.req_id, c.num_computed_tokens, c.num_tokens, c.kv_write_start, c.sample)
            for c in msg.chunks
        ],
        follows_step_id=msg.follows_step_id if msg.HasField("follows_step_id") else None,
    )


def result_to_proto(result: StepResult) -> pb.StepResult:
    msg = pb.StepResult(step_id=result.step_id, execute_seconds=result.execute_seconds)
    add_sampled = msg.sampled.add
    for s in result.sampled:
        token = add_sampled(req_id=s.req_id, token_id=s.token_id)
        if s.logprob is not None:
            token.logprob = s.logprob
        for t, lp in s.top_logprobs:
            token.top_logprobs.add(token_id=t, logprob=lp)
    return msg


def result_from_proto(msg: pb.StepResult) -> StepResult:
    sampled = []
    for s in msg.sampled:
        top = s.top_logprobs
        sampled.append(SampledToken(s.req_id, s.token_id, s.logprob if s.HasField("logprob") else None,
                                    [(t.token_id, t.logprob) for t in top] if top else []))
    return StepResult(msg.step_id, sampled, msg.execute_seconds)
