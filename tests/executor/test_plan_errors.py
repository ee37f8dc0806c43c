"""Invalid plans raise PlanError naming the request and field, and change nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from chunkwise.plan import GREEDY, NewRequestData, RunningRequestDelta, SamplingParams, ScheduledChunk, StepPlan
from executor_svc.engine import PlanError

from .helpers import make_runner

BS = 8
NUM_BLOCKS = 16


@pytest.fixture
def runner(tiny_llama_path):
    """A runner holding request "a": 10 prompt tokens computed, blocks [3, 4], one sampled
    token (id 7) not yet sent back."""
    r = make_runner(tiny_llama_path, block_size=BS, num_kv_blocks=NUM_BLOCKS)
    r.execute(StepPlan(1, new_requests=[NewRequestData("a", list(range(10, 20)), [3, 4], GREEDY)],
                       chunks=[ScheduledChunk("a", 0, 10, 0, True)]))
    return r


def snapshot(r):
    return copy.deepcopy({k: (v.token_ids, v.block_ids, v.sampling, v.seed, v.kv_end) for k, v in r._requests.items()}), \
        [t.clone() for t in r.kv_cache.layers]


def assert_unchanged(r, snap):
    state, kv = snap
    assert {k: (v.token_ids, v.block_ids, v.sampling, v.seed, v.kv_end) for k, v in r._requests.items()} == state
    assert all(torch.equal(a, b) for a, b in zip(kv, r.kv_cache.layers))


def decode_a(step=2, **kw):
    """A valid decode step for "a" (plus whatever the case adds)."""
    plan = StepPlan(step, running=[RunningRequestDelta("a", [7], [])], chunks=[ScheduledChunk("a", 10, 1, 10, True)])
    for k, v in kw.items():
        setattr(plan, k, v)
    return plan


NEW_B = NewRequestData("b", [1, 2, 3], [9], GREEDY)
CHUNK_B = ScheduledChunk("b", 0, 3, 0, True)

CASES = {
    "unknown request in chunks": (
        decode_a(chunks=[ScheduledChunk("a", 10, 1, 10, True), ScheduledChunk("zz", 0, 1, 0, True)]),
        r"chunk for 'zz': unknown req_id"),
    "unknown request in running": (
        decode_a(running=[RunningRequestDelta("a", [7], []), RunningRequestDelta("zz", [1], [])]),
        r"running request 'zz': unknown req_id"),
    "finished request still scheduled": (
        decode_a(finished_req_ids=["a"]), r"'a': unknown req_id"),
    "duplicate new request (already held)": (
        decode_a(new_requests=[NewRequestData("a", [1, 2], [5], GREEDY)]),
        r"new request 'a': is already held"),
    "duplicate new request in one plan": (
        StepPlan(2, new_requests=[NEW_B, NewRequestData("b", [4], [10], GREEDY)]),
        r"new request 'b': appears twice"),
    "empty prompt": (StepPlan(2, new_requests=[NewRequestData("b", [], [9], GREEDY)]), r"'b': token_ids is empty"),
    "token id beyond vocab (new)": (
        StepPlan(2, new_requests=[NewRequestData("b", [1, 384], [9], GREEDY)]),
        r"new request 'b': token_ids: token id 384 outside the vocabulary \[0, 384\)"),
    "negative token id (delta)": (
        decode_a(running=[RunningRequestDelta("a", [-1], [])]),
        r"running request 'a': new_token_ids: token id -1 outside"),
    "block id out of range (new)": (
        StepPlan(2, new_requests=[NewRequestData("b", [1], [NUM_BLOCKS], GREEDY)]),
        rf"new request 'b': block_ids: block id {NUM_BLOCKS} outside \[0, {NUM_BLOCKS}\)"),
    "negative block id (delta)": (
        decode_a(running=[RunningRequestDelta("a", [7], [-2])]), r"'a': new_block_ids: block id -2"),
    "block table too short": (
        StepPlan(2, new_requests=[NewRequestData("b", list(range(1, 12)), [9], GREEDY)],
                 chunks=[ScheduledChunk("b", 0, 11, 0, True)]),
        r"chunk for 'b': block table has 1 blocks, positions \[0, 11\) need 2"),
    "chunk beyond known tokens": (
        StepPlan(2, chunks=[ScheduledChunk("a", 10, 1, 10, True)]),
        r"chunk for 'a': .* = 11 exceeds the 10 tokens"),
    "sample not at the last token": (
        StepPlan(2, new_requests=[NEW_B], chunks=[ScheduledChunk("b", 0, 2, 0, True)]),
        r"chunk for 'b': sample is set but the chunk ends at 2, not at the last known token \(3\)"),
    "kv_write_start below num_computed_tokens": (
        decode_a(chunks=[ScheduledChunk("a", 10, 1, 9, True)]), r"chunk for 'a': kv_write_start 9 outside"),
    "zero tokens": (decode_a(chunks=[ScheduledChunk("a", 10, 0, 10, False)]), r"chunk for 'a': num_tokens must be >= 1"),
    "skipped positions (claims KV never computed)": (
        StepPlan(2, running=[RunningRequestDelta("a", [7, 8, 9], [])], chunks=[ScheduledChunk("a", 12, 1, 12, True)]),
        r"chunk for 'a': kv_write_start 12 claims cached KV .* only covers positions \[0, 10\)"),
    "two chunks for one request": (
        decode_a(chunks=[ScheduledChunk("a", 10, 1, 10, True), ScheduledChunk("a", 10, 1, 10, True)]),
        r"chunk for 'a': the request has more than one chunk"),
    "two requests write one block": (
        decode_a(new_requests=[NewRequestData("b", [1, 2, 3], [4], GREEDY)], chunks=[
            ScheduledChunk("a", 10, 1, 10, True), ScheduledChunk("b", 0, 3, 0, True)]),
        r"chunks for 'b' and 'a' both write KV block 4|chunks for 'a' and 'b' both write KV block 4"),
    "bad top_p": (StepPlan(2, new_requests=[NewRequestData("b", [1], [9], SamplingParams(top_p=0.0))]),
                  r"new request 'b': sampling.top_p"),
    "bad temperature": (StepPlan(2, new_requests=[NewRequestData("b", [1], [9], SamplingParams(temperature=-1))]),
                        r"sampling.temperature"),
    "bad min_p": (StepPlan(2, new_requests=[NewRequestData("b", [1], [9], SamplingParams(min_p=1.5))]),
                  r"sampling.min_p"),
    "bad num_logprobs": (StepPlan(2, new_requests=[NewRequestData("b", [1], [9], SamplingParams(num_logprobs=-1))]),
                         r"sampling.num_logprobs"),
    "append_sampled in a plan that follows no step": (
        StepPlan(2, running=[RunningRequestDelta("a", [], [], append_sampled=True)],
                 chunks=[ScheduledChunk("a", 10, 1, 10, True)]),
        r"running request 'a': append_sampled, but the request sampled nothing in the step this plan follows \(none\)"),
    "a plan that follows a step other than the last one run": (
        decode_a(follows_step_id=0), r"plan follows step 0, but the last step run is 1"),
    "append_sampled with new_token_ids": (
        decode_a(follows_step_id=1, running=[RunningRequestDelta("a", [7], [], append_sampled=True)]),
        r"running request 'a': append_sampled and new_token_ids together"),
    "beyond max_model_len": (  # (the repeated block 0 is never reached: the length check comes first)
        StepPlan(2, new_requests=[NewRequestData("b", [5] * 513, list(range(5, 16)) + [0] * 54, GREEDY)],
                 chunks=[ScheduledChunk("b", 0, 513, 0, True)]),
        r"chunk for 'b': chunk ends at position 513, beyond max_model_len 512"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_invalid_plan_raises_and_changes_nothing(runner, case):
    plan, message = CASES[case]
    plan = copy.deepcopy(plan)
    before = snapshot(runner)
    with pytest.raises(PlanError, match=message):
        runner.execute(plan)
    assert_unchanged(runner, before)


def test_state_changes_before_the_bad_chunk_are_not_applied(runner):
    plan = StepPlan(2, finished_req_ids=["a"], new_requests=[NEW_B],
                    chunks=[CHUNK_B, ScheduledChunk("c", 0, 1, 0, True)])
    with pytest.raises(PlanError, match="'c': unknown"):
        runner.execute(plan)
    assert runner.has_request("a") and not runner.has_request("b")


def test_runner_works_normally_after_a_rejected_plan(runner, tiny_llama_path):
    with pytest.raises(PlanError):
        runner.execute(decode_a(chunks=[ScheduledChunk("zz", 0, 1, 0, True)]))
    got = runner.execute(decode_a()).sampled[0].token_id
    control = make_runner(tiny_llama_path, block_size=BS, num_kv_blocks=NUM_BLOCKS)
    control.execute(StepPlan(1, new_requests=[NewRequestData("a", list(range(10, 20)), [3, 4], GREEDY)],
                             chunks=[ScheduledChunk("a", 0, 10, 0, True)]))
    assert control.execute(decode_a()).sampled[0].token_id == got


def test_unknown_finished_ids_are_ignored_and_preempt_resume_works(runner):
    runner.execute(StepPlan(2, finished_req_ids=["never-seen"]))
    # Preempt "a" and resume it in the same plan with its tokens so far (recompute).
    result = runner.execute(StepPlan(3, finished_req_ids=["a"],
                                     new_requests=[NewRequestData("a", list(range(10, 20)) + [7], [6, 2], GREEDY)],
                                     chunks=[ScheduledChunk("a", 0, 11, 0, True)]))
    assert [s.req_id for s in result.sampled] == ["a"]
    assert runner._requests["a"].block_ids == [6, 2]


def test_plan_error_is_a_value_error():
    assert issubclass(PlanError, ValueError)


def test_append_sampled_equals_sending_the_sampled_token(runner, tiny_llama_path):
    """Async scheduling's delta (the executor appends the token it sampled in the step the plan
    follows) computes exactly what the explicit delta does."""
    sampled = runner.execute(decode_a(follows_step_id=None)).sampled[0].token_id  # step 2, token after 7
    blind = runner.execute(StepPlan(3, follows_step_id=2, running=[RunningRequestDelta("a", [], [], append_sampled=True)],
                                    chunks=[ScheduledChunk("a", 11, 1, 11, True)]))
    assert runner._requests["a"].token_ids[-1] == sampled
    control = make_runner(tiny_llama_path, block_size=BS, num_kv_blocks=NUM_BLOCKS)
    control.execute(StepPlan(1, new_requests=[NewRequestData("a", list(range(10, 20)), [3, 4], GREEDY)],
                             chunks=[ScheduledChunk("a", 0, 10, 0, True)]))
    control.execute(decode_a())
    explicit = control.execute(StepPlan(3, running=[RunningRequestDelta("a", [sampled], [])],
                                        chunks=[ScheduledChunk("a", 11, 1, 11, True)]))
    assert blind.sampled == explicit.sampled
    # 'a' sampled nothing in step 4 (only 'b' ran): it has no token to append from it.
    plan = StepPlan(4, follows_step_id=3, new_requests=[NEW_B], chunks=[CHUNK_B])
    runner.execute(plan)
    with pytest.raises(PlanError, match=r"running request 'a': append_sampled, but the request sampled nothing .*\(4\)"):
        runner.execute(StepPlan(5, follows_step_id=4, running=[
            RunningRequestDelta("a", [], [], append_sampled=True), RunningRequestDelta("b", [], [], append_sampled=True)]))
    assert runner.last_step_id == 4
