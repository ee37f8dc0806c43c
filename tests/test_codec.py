"""Every field of the plan and the result survives the trip through protobuf bytes."""

import dataclasses

from chunkwise import codec
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


def _roundtrip_plan(plan: StepPlan) -> StepPlan:
    wire = codec.plan_to_proto(plan, "epoch-1").SerializeToString()
    msg = pb.StepPlan.FromString(wire)
    assert msg.executor_epoch == "epoch-1"
    return codec.plan_from_proto(msg)


def test_plan_roundtrip_keeps_every_field():
    plan = StepPlan(
        step_id=7,
        finished_req_ids=["gone", "preempted"],
        new_requests=[
            NewRequestData(
                "a",
                [1, 2, 3, 40000],
                [5, 6],
                # floats chosen to be exact in float32, the wire type
                SamplingParams(temperature=0.5, top_p=0.75, top_k=20, min_p=0.125, seed=2**63 + 5, num_logprobs=3),
            ),
            NewRequestData("b", [9], [0], SamplingParams(temperature=0.0)),
        ],
        running=[RunningRequestDelta("c", [11], []), RunningRequestDelta("d", [], [8], append_sampled=True)],
        chunks=[
            ScheduledChunk("c", 40, 1, 40, True),
            ScheduledChunk("a", 0, 4, 0, True),
            ScheduledChunk("b", 0, 1, 1, False),
        ],
        follows_step_id=6,
    )
    assert _roundtrip_plan(plan) == plan


def test_unset_optional_fields_stay_unset():
    plan = StepPlan(step_id=1, new_requests=[NewRequestData("a", [1], [0], SamplingParams())])
    back = _roundtrip_plan(plan)
    assert back.follows_step_id is None
    assert back.new_requests[0].sampling.seed is None
    assert back.new_requests[0].sampling.num_logprobs is None
    # 0 is a meaningful value (the sampled token's logprob only) and must not read as unset
    plan.new_requests[0] = NewRequestData("a", [1], [0], SamplingParams(seed=0, num_logprobs=0))
    back = _roundtrip_plan(plan)
    assert back.new_requests[0].sampling.seed == 0
    assert back.new_requests[0].sampling.num_logprobs == 0
    # and step 0 is a step a plan can follow
    assert _roundtrip_plan(StepPlan(step_id=1, follows_step_id=0)).follows_step_id == 0


def test_result_roundtrip():
    result = StepResult(
        step_id=3,
        sampled=[
            SampledToken("a", 17, -0.25, [(17, -0.25), (3, -2.5)]),
            SampledToken("b", 0, None, []),
        ],
        execute_seconds=0.125,
    )
    wire = codec.result_to_proto(result).SerializeToString()
    assert codec.result_from_proto(pb.StepResult.FromString(wire)) == result


def test_handshake_roundtrip_keeps_every_field():
    model = ModelInfo(model_path="/models/m", architecture="LlamaForCausalLM", vocab_size=49152, max_model_len=8192,
                      eos_token_ids=(2, 7), dtype="bfloat16", device="cpu", attention_backend="torch",
                      num_parameters=135_000_000, decode_attention="paged-inductor", prefill_attention="bf16-gemm",
                      layer_ops="compiled")
    # Every field differs from its default, so a field the codec dropped would show.
    assert all(getattr(model, f.name) != f.default for f in dataclasses.fields(ModelInfo))
    msg = pb.InitializeResponse(executor_epoch="e1", model=codec.model_info_to_proto(model), block_size=16,
                                num_kv_blocks=321)
    info = codec.executor_info_from_proto(pb.InitializeResponse.FromString(msg.SerializeToString()))
    assert info == ExecutorInfo(epoch="e1", block_size=16, num_kv_blocks=321, **dataclasses.asdict(model))


def test_handshake_dataclasses_mirror_the_proto():
    """ModelInfo and executor.proto's ModelInfo have the same fields, and so have ExecutorInfo and
    InitializeResponse (the model's fields flattened into it): a field added on one side only
    fails here, not as a value silently left at its default."""
    assert {f.name for f in dataclasses.fields(ModelInfo)} == set(pb.ModelInfo.DESCRIPTOR.fields_by_name)
    response = set(pb.InitializeResponse.DESCRIPTOR.fields_by_name) - {"model", "executor_epoch"} | {"epoch"}
    assert {f.name for f in dataclasses.fields(ExecutorInfo)} == response | set(pb.ModelInfo.DESCRIPTOR.fields_by_name)
