"""Scheduler behaviours: admission checks, limits, ordering, preemption, abort, restart, stops."""

import sys
import subprocess

import pytest

from chunkwise.plan import SampledToken, StepResult
from scheduler_svc.core import Request, RequestStatus, Scheduler, SchedulerConfig

from ._fake_executor import (
    FakeExecutor,
    check_invariants,
    expected_outputs_ok,
    fake_next_token,
    run_step,
    run_until_done,
)


def make(budget=64, block_size=16, num_blocks=64, max_model_len=256, max_num_seqs=64, caching=True, chunked=True):
    config = SchedulerConfig(
        max_model_len=max_model_len,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=caching,
        enable_chunked_prefill=chunked,
    )
    scheduler = Scheduler(config, num_blocks)
    return scheduler, FakeExecutor(num_blocks, block_size, scheduler)


def tokens(n, seed=0):
    return [(seed * 131 + i * 17 + 1) % 1000 for i in range(n)]


# ----- admission checks -----


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt_token_ids": []}, "must not be empty"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"prompt_token_ids": tokens(250), "max_tokens": 7}, r"prompt \(250 tokens\) \+ max_tokens \(7\) exceeds max_model_len \(256\)"),
        ({"prompt_token_ids": [1, -2, 3]}, "token ids must be >= 0"),
    ],
)
def test_add_request_rejects_what_can_never_be_served(kwargs, message):
    scheduler, _ = make()
    args = {"req_id": "x", "prompt_token_ids": [1, 2, 3], "max_tokens": 4} | kwargs
    with pytest.raises(ValueError, match=message):
        scheduler.add_request(Request(**args))
    assert not scheduler.has_unfinished_requests()


def test_duplicate_request_id_is_rejected_while_the_first_is_unfinished():
    scheduler, executor = make()
    scheduler.add_request(Request("x", [1, 2, 3], max_tokens=1))
    with pytest.raises(ValueError, match="duplicate request id 'x'"):
        scheduler.add_request(Request("x", [4, 5], max_tokens=1))
    run_until_done(scheduler, executor)
    scheduler.add_request(Request("x", [4, 5], max_tokens=1))  # the id is free again


# ----- the plan-in-flight protocol -----


def test_at_most_one_plan_in_flight():
    scheduler, executor = make()
    scheduler.add_request(Request("a", tokens(10), max_tokens=3))
    plan = scheduler.schedule()
    with pytest.raises(RuntimeError, match="still in flight"):
        scheduler.schedule()
    result = executor.execute(plan)
    scheduler.update(plan, result)
    with pytest.raises(RuntimeError, match="not the oldest plan in flight"):
        scheduler.update(plan, result)


def test_a_result_missing_a_sampled_token_is_refused_without_changing_state():
    scheduler, executor = make()
    req = Request("a", tokens(10), max_tokens=3)
    scheduler.add_request(req)
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match="no sampled token for 'a'"):
        scheduler.update(plan, StepResult(step_id=plan.step_id))
    with pytest.raises(ValueError, match="result of step"):
        scheduler.update(plan, StepResult(step_id=plan.step_id + 1))
    assert req.num_computed_tokens == 0 and scheduler.has_plan_in_flight
    scheduler.update(plan, executor.execute(plan))
    assert req.num_computed_tokens == 10


def test_empty_plan_is_not_in_flight():
    scheduler, _ = make()
    plan = scheduler.schedule()
    assert plan.is_empty and not scheduler.has_plan_in_flight
    assert scheduler.update(plan, StepResult(plan.step_id)) == []
    assert scheduler.schedule().is_empty


# ----- incremental plans -----


def test_running_requests_are_sent_as_deltas_of_tokens_and_blocks():
    scheduler, executor = make(block_size=4)
    scheduler.add_request(Request("a", tokens(6), max_tokens=5))
    plan = scheduler.schedule()
    (new,) = plan.new_requests
    assert new.token_ids == tokens(6) and new.block_ids == [0, 1] and not plan.running
    scheduler.update(plan, executor.execute(plan))
    t1 = fake_next_token(tokens(6))
    plan = scheduler.schedule()
    assert not plan.new_requests
    (delta,) = plan.running
    assert (delta.req_id, delta.new_token_ids, delta.new_block_ids) == ("a", [t1], [])  # position 6 is in block 1
    scheduler.update(plan, executor.execute(plan))
    plan = scheduler.schedule()
    (delta,) = plan.running
    assert len(delta.new_token_ids) == 1 and delta.new_block_ids == []  # position 7 is block 1's last slot
    assert plan.chunks[0].num_computed_tokens == 7
    scheduler.update(plan, executor.execute(plan))
    plan = scheduler.schedule()
    (delta,) = plan.running
    assert len(delta.new_token_ids) == 1 and delta.new_block_ids == [2]  # position 8 starts block 2
    assert plan.chunks[0].num_computed_tokens == 8
    scheduler.update(plan, executor.execute(plan))


# ----- limits and ordering -----


def test_max_num_seqs_is_honoured():
    scheduler, executor = make(max_num_seqs=2, budget=256)
    reqs = [Request(f"r{i}", tokens(20, i), max_tokens=4) for i in range(5)]
    for r in reqs:
        scheduler.add_request(r)
    while scheduler.has_work():
        plan, _ = run_step(scheduler, executor)
        assert len(plan.chunks) <= 2 and scheduler.num_running <= 2
        check_invariants(scheduler, executor)
    assert all(r.finish_reason == "length" and expected_outputs_ok(r) for r in reqs)


def test_budget_is_shared_by_decodes_first():
    scheduler, executor = make(budget=16, block_size=16)
    a = Request("a", tokens(16, 1), max_tokens=8)
    scheduler.add_request(a)
    run_step(scheduler, executor)
    scheduler.add_request(Request("b", tokens(40, 2), max_tokens=1))
    plan = scheduler.schedule()
    # a decodes (1 token); 15 are left, less than a block, so b's first (non-final) chunk must wait.
    assert [(c.req_id, c.num_tokens) for c in plan.chunks] == [("a", 1)]
    scheduler.update(plan, executor.execute(plan))
    run_until_done(scheduler, executor)
    check_invariants(scheduler, executor)


def test_waiting_queue_is_first_come_first_served_with_head_of_line_blocking():
    scheduler, executor = make(budget=64, chunked=False, max_model_len=64)
    decoders = [Request(f"d{i}", tokens(10, i), max_tokens=3) for i in range(2)]
    for r in decoders:
        scheduler.add_request(r)
    run_step(scheduler, executor)
    scheduler.add_request(Request("big", tokens(63, 5), max_tokens=1))
    scheduler.add_request(Request("small", tokens(3, 6), max_tokens=1))
    admitted = []
    while scheduler.has_work():
        plan, _ = run_step(scheduler, executor)
        admitted += [n.req_id for n in plan.new_requests]
        if any(not r.is_finished for r in decoders):
            # Two decodes leave 62 tokens: "big" (63) does not fit, and "small", though it would, must
            # not jump the queue.
            assert not plan.new_requests
    assert admitted == ["big", "small"]


# ----- preemption -----


def test_preemption_newest_first_then_resume_reuses_cached_blocks():
    # 10 blocks of 4 tokens: room for one max_model_len (40) request, not for three 28-token ones.
    scheduler, executor = make(budget=64, block_size=4, num_blocks=10, max_model_len=40)
    a = Request("a", tokens(12, 1), max_tokens=16)
    b = Request("b", tokens(12, 2), max_tokens=16)
    scheduler.add_request(a)
    scheduler.add_request(b)
    preempting_plan = None
    outputs_at_preemption: list[int] = []
    resume_checked = False
    while scheduler.has_work():
        before = scheduler.stats().preemptions
        plan, _ = run_step(scheduler, executor)
        check_invariants(scheduler, executor)
        if scheduler.stats().preemptions > before and preempting_plan is None:
            preempting_plan = plan
            # The newest request was preempted and its executor state dropped in this very plan.
            assert plan.finished_req_ids == ["b"] and b.status is RequestStatus.PREEMPTED
            assert not plan.new_requests  # nothing admitted in a step that preempted
            assert a.status is RequestStatus.RUNNING and a.num_preemptions == 0
            outputs_at_preemption = list(b.output_token_ids)
        resumed = [n for n in plan.new_requests if n.req_id == "b"]
        if preempting_plan is not None and resumed:
            (new,) = resumed
            assert new.token_ids[: 12 + len(outputs_at_preemption)] == b.prompt_token_ids + outputs_at_preemption
            (chunk,) = [c for c in plan.chunks if c.req_id == "b"]
            # Its own full blocks were found in the cache again.
            assert chunk.num_computed_tokens > 0 and chunk.num_computed_tokens % 4 == 0
            resume_checked = True
    assert preempting_plan is not None, "the pool was meant to force a preemption"
    assert resume_checked
    assert b.num_preemptions >= 1 and b.num_cached_tokens == 0  # resume does not change user-visible usage
    assert expected_outputs_ok(a) and expected_outputs_ok(b)
    assert a.finish_reason == b.finish_reason == "length"
    stats = scheduler.stats()
    assert stats.preemptions >= 1 and stats.kv_blocks_used == 0
    # The resume's reuse of its own blocks is counted apart, never as a prefix-cache hit: the two
    # prompts share nothing, so the hit rate stays 0 however often they are preempted.
    assert stats.prefix_cache_hits == 0 and stats.prefix_cache_queries == 24
    assert stats.resumed_cached_tokens > 0
    # Recompute is counted, and less than recomputing everything thanks to the cache.
    assert 0 < stats.recomputed_tokens < 12 + 16


def test_the_newest_running_request_is_preempted_first():
    # 9 blocks of 4; three requests of 8 + up to 20 tokens: all fit at first, then decodes run out.
    scheduler, executor = make(budget=64, block_size=4, num_blocks=9, max_model_len=36)
    reqs = [Request(name, tokens(8, i), max_tokens=20) for i, name in enumerate("abc")]
    for r in reqs:
        scheduler.add_request(r)
    victims = []
    while scheduler.has_work():
        before = scheduler.stats().preemptions
        plan, _ = run_step(scheduler, executor)
        if scheduler.stats().preemptions > before:
            victims.append(plan.finished_req_ids)
    assert victims[0] == ["c"]  # a needed a block: c (newest) goes, not b
    assert reqs[0].num_preemptions == 0  # the oldest is never preempted
    assert all(r.finish_reason == "length" and expected_outputs_ok(r) for r in reqs)


def test_no_deadlock_when_every_running_request_is_half_prefilled_and_the_pool_is_full(monkeypatch):
    # 6 blocks of 4 tokens: exactly one max_model_len (24) request. Three 20-token prompts.
    scheduler, executor = make(budget=24, block_size=4, num_blocks=6, max_model_len=24, max_num_seqs=3)
    reqs = [Request(f"r{i}", tokens(20, i), max_tokens=4) for i in range(3)]
    for r in reqs:
        scheduler.add_request(r)
    # Reach the classic deadlock state by hand: for one step, cap every chunk at 8 tokens, so all
    # three are admitted with 2 blocks each and the pool is full with every prompt half done.
    original = scheduler._chunk_length
    monkeypatch.setattr(scheduler, "_chunk_length", lambda start, remaining, budget: min(original(start, remaining, budget), 8))
    run_step(scheduler, executor)
    monkeypatch.undo()
    assert [(r.num_computed_tokens, len(r.block_ids)) for r in reqs] == [(8, 2)] * 3
    assert scheduler.block_pool.num_free_blocks == 0
    # Without preemption of the newest, nobody could get a block. Here the oldest always can.
    plan, _ = run_step(scheduler, executor)
    assert plan.chunks and plan.chunks[0].req_id == "r0" and plan.finished_req_ids
    plans = run_until_done(scheduler, executor, max_steps=500)  # raises on an empty plan or no progress
    assert all(r.finish_reason == "length" and expected_outputs_ok(r) for r in reqs)
    assert scheduler.stats().preemptions >= 1 and len(plans) < 500
    check_invariants(scheduler, executor)


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    # Preempting b frees more than a needs; b (now at the queue's head) would fit again at once and
    # thrash, re-admitted in the very plan that dropped it.
    scheduler, executor = make(budget=2, block_size=1, num_blocks=8, max_model_len=8, max_num_seqs=2, caching=False)
    scheduler.add_request(Request("a", [1, 2, 3], max_tokens=4))
    scheduler.add_request(Request("b", [10], max_tokens=4))
    preempting_steps = 0
    while scheduler.has_work():
        before = scheduler.stats().preemptions
        plan, _ = run_step(scheduler, executor)
        if scheduler.stats().preemptions > before:
            preempting_steps += 1
            assert not plan.new_requests
    assert preempting_steps >= 1


# ----- abort, finish, restart -----


def test_abort_between_schedule_and_update_ignores_results_and_frees_unregistered_blocks():
    scheduler, executor = make(budget=64)
    req = Request("a", tokens(120), max_tokens=4)
    scheduler.add_request(req)
    plan = scheduler.schedule()
    assert scheduler.abort_request("a")
    assert not scheduler.abort_request("a")
    assert scheduler.block_pool.num_used_blocks == 0
    result = executor.execute(plan)
    assert scheduler.update(plan, result) == []
    assert scheduler.block_pool.num_indexed_blocks == 0  # never registered: not executed as far as we know
    assert req.finish_reason == "abort" and req.num_computed_tokens == 0
    # The same id may come back at once; the executor drops the old state before adding the new.
    scheduler.add_request(Request("a", tokens(20), max_tokens=1))
    plan = scheduler.schedule()
    assert plan.finished_req_ids == ["a"] and [n.req_id for n in plan.new_requests] == ["a"]
    scheduler.update(plan, executor.execute(plan))
    run_until_done(scheduler, executor)
    check_invariants(scheduler, executor)
    assert scheduler.stats().requests_finished["abort"] == 1


def test_aborting_a_decoding_request_mid_step_drops_its_token():
    scheduler, executor = make()
    a = Request("a", tokens(10, 1), max_tokens=5)
    b = Request("b", tokens(10, 2), max_tokens=5)
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_step(scheduler, executor)
    plan = scheduler.schedule()
    scheduler.abort_request("a")
    outputs = scheduler.update(plan, executor.execute(plan))
    assert [o.req_id for o in outputs] == ["b"] and len(a.output_token_ids) == 1
    plan = scheduler.schedule()
    assert plan.finished_req_ids == ["a"]
    scheduler.update(plan, executor.execute(plan))
    run_until_done(scheduler, executor)
    check_invariants(scheduler, executor)


def test_abort_of_a_waiting_request_sends_nothing_to_the_executor():
    scheduler, executor = make()
    scheduler.add_request(Request("w", tokens(10), max_tokens=1))
    assert scheduler.abort_request("w")
    assert scheduler.schedule().is_empty
    assert not scheduler.abort_request("never-seen")


def test_finish_request_for_stop_strings():
    scheduler, executor = make()
    req = Request("a", tokens(10), max_tokens=20)
    scheduler.add_request(req)
    run_step(scheduler, executor)
    run_step(scheduler, executor)
    with pytest.raises(ValueError, match="finish reason"):
        scheduler.finish_request("a", "because")
    assert scheduler.finish_request("a", "stop")
    assert req.is_finished and req.finish_reason == "stop" and not req.block_ids
    assert not scheduler.finish_request("a", "stop")
    stats = scheduler.stats()
    assert stats.requests_finished["stop"] == 1 and stats.kv_blocks_used == 0
    # Nothing else to do: no plan just to drop its executor state; that goes with the next work.
    assert not scheduler.has_work()
    assert scheduler.schedule().is_empty
    scheduler.add_request(Request("b", tokens(5), max_tokens=1))
    plan = scheduler.schedule()
    assert plan.finished_req_ids == ["a"] and [c.req_id for c in plan.chunks] == ["b"]
    scheduler.update(plan, executor.execute(plan))
    assert not scheduler.has_work()


def test_executor_restart_resends_running_requests_in_full_and_recomputes_them():
    scheduler, executor = make(budget=64)
    shared = tokens(48, 9)
    reqs = [Request(f"r{i}", shared + tokens(20, i), max_tokens=6) for i in range(3)]
    for r in reqs:
        scheduler.add_request(r)
    for _ in range(4):
        run_step(scheduler, executor)
    assert scheduler.block_pool.num_indexed_blocks > 0
    in_flight = scheduler.schedule()
    executor.restart()  # the executor died with the plan: its KV and request state are gone
    scheduler.handle_executor_restart()
    with pytest.raises(RuntimeError, match="not the oldest plan in flight"):
        scheduler.update(in_flight, StepResult(in_flight.step_id))
    assert scheduler.block_pool.num_indexed_blocks == 0 and scheduler.num_running == 0
    plan = scheduler.schedule()
    assert plan.finished_req_ids == []  # nothing to drop: the new executor holds nothing
    running_before = [r for r in reqs if r.output_token_ids]
    for new in plan.new_requests:
        req = scheduler.get_request(new.req_id)
        assert new.token_ids == req.prompt_token_ids + req.output_token_ids
    assert all(c.num_computed_tokens == 0 for c in plan.chunks)  # nothing may come from the lost cache
    scheduler.update(plan, executor.execute(plan))
    run_until_done(scheduler, executor)
    assert running_before and all(r.finish_reason == "length" and expected_outputs_ok(r) for r in reqs)
    stats = scheduler.stats()
    assert stats.executor_restarts == 1 and stats.recomputed_tokens > 0
    check_invariants(scheduler, executor)


@pytest.mark.parametrize("chunked", [True, False])
def test_a_hit_whose_step_never_ran_is_not_counted_or_reported(chunked):
    # Issue 17: an executor that restarted while the scheduler was idle. The scheduler still
    # matches the new request against the old prefix index, but the step is refused (new epoch),
    # so that match must leave no trace: not in the request's usage, nor in hits or recomputes.
    scheduler, executor = make(chunked=chunked, budget=256)
    shared = tokens(64, 3)
    first = Request("first", shared, max_tokens=2)
    scheduler.add_request(first)
    run_until_done(scheduler, executor)
    before = scheduler.stats()
    assert before.prefix_cache_queries == 64 and before.prefix_cache_hits == 0
    second = Request("second", shared, max_tokens=2)
    scheduler.add_request(second)
    refused = scheduler.schedule()
    assert refused.chunks[0].num_computed_tokens == 63  # matched against the (stale) index
    executor.restart()
    scheduler.handle_executor_restart()
    run_until_done(scheduler, executor)
    after = scheduler.stats()
    assert second.num_cached_tokens == 0 and expected_outputs_ok(second)
    assert after.prefix_cache_hits == 0 and after.prefix_cache_queries == 128
    assert after.recomputed_tokens == 0 and after.resumed_cached_tokens == 0
    assert after.prefill_tokens - before.prefill_tokens == 64


def test_a_hit_is_counted_once_the_step_that_used_it_ran():
    scheduler, executor = make()
    shared = tokens(64, 4)
    scheduler.add_request(Request("first", shared, max_tokens=2))
    run_until_done(scheduler, executor)
    second = Request("second", shared + [7], max_tokens=2)
    scheduler.add_request(second)
    plan = scheduler.schedule()
    assert scheduler.stats().prefix_cache_hits == 0  # scheduled, not executed yet
    outputs = scheduler.update(plan, executor.execute(plan))
    assert scheduler.stats().prefix_cache_hits == 64 and second.num_cached_tokens == 64
    assert [o.num_cached_tokens for o in outputs if o.req_id == "second"] == [64]


def test_reset_prefix_cache():
    scheduler, executor = make()
    scheduler.add_request(Request("a", tokens(64), max_tokens=1))
    run_until_done(scheduler, executor)
    assert scheduler.stats().kv_blocks_cached == 4
    # With a request running too: its blocks stay its own, they only leave the index.
    running = Request("b", tokens(40, 3), max_tokens=10)
    scheduler.add_request(running)
    run_step(scheduler, executor)
    assert scheduler.reset_prefix_cache() is True
    stats = scheduler.stats()
    assert stats.kv_blocks_cached == 0 and scheduler.block_pool.num_indexed_blocks == 0
    assert stats.kv_blocks_used == 3
    again = Request("again", tokens(64), max_tokens=1)
    scheduler.add_request(again)
    run_until_done(scheduler, executor)
    assert again.num_cached_tokens == 0 and expected_outputs_ok(running)
    check_invariants(scheduler, executor)


# ----- prefix sharing -----


def test_shared_prefix_across_concurrent_requests_counts_references():
    scheduler, executor = make(budget=256)
    prefix = tokens(64, 5)
    first = Request("first", prefix + tokens(10, 1), max_tokens=8)
    scheduler.add_request(first)
    run_step(scheduler, executor)
    prefix_blocks = first.block_ids[:4]
    others = [Request(f"o{i}", prefix + tokens(7 + i, 10 + i), max_tokens=4) for i in range(2)]
    for r in others:
        scheduler.add_request(r)
    run_step(scheduler, executor)
    pool = scheduler.block_pool
    assert all(r.block_ids[:4] == prefix_blocks and r.num_cached_tokens == 64 for r in others)
    assert [pool.blocks[b].ref_count for b in prefix_blocks] == [3, 3, 3, 3]
    suffix_blocks = [b for r in [first] + others for b in r.block_ids[4:]]
    assert len(suffix_blocks) == len(set(suffix_blocks))  # suffixes are private
    check_invariants(scheduler, executor)
    run_until_done(scheduler, executor)
    assert all(pool.blocks[b].ref_count == 0 for b in prefix_blocks)
    assert set(prefix_blocks) <= set(pool.cached_free_block_ids())
    assert all(expected_outputs_ok(r) for r in [first] + others)


def test_cache_salt_separates_tenants():
    scheduler, executor = make(budget=256)
    prompt = tokens(64)
    scheduler.add_request(Request("a", prompt, max_tokens=1, cache_salt="tenant-a"))
    run_until_done(scheduler, executor)
    other = Request("b", prompt, max_tokens=1, cache_salt="tenant-b")
    same = Request("a2", prompt, max_tokens=1, cache_salt="tenant-a")
    unsalted = Request("c", prompt, max_tokens=1)
    for r in (other, same, unsalted):
        scheduler.add_request(r)
        run_until_done(scheduler, executor)
    assert (other.num_cached_tokens, same.num_cached_tokens, unsalted.num_cached_tokens) == (0, 63, 0)


def test_eviction_keeps_the_head_of_an_old_chain_longest():
    scheduler, executor = make(budget=64, block_size=4, num_blocks=8, max_model_len=32)
    a = tokens(12, 1)
    b = tokens(12, 2)
    for rid, prompt in (("a", a), ("b", b)):
        scheduler.add_request(Request(rid, prompt, max_tokens=1))
        run_until_done(scheduler, executor)
    pool = scheduler.block_pool
    assert pool.num_cached_free_blocks == 6
    # 16 new tokens need 4 blocks: the 2 never-used ones, then a's tail two (a was freed first).
    scheduler.add_request(Request("c", tokens(16, 3), max_tokens=1))
    run_until_done(scheduler, executor)
    a_again = Request("a-again", a, max_tokens=1)
    b_again = Request("b-again", b, max_tokens=1)
    scheduler.add_request(b_again)
    run_until_done(scheduler, executor)
    scheduler.add_request(a_again)
    run_until_done(scheduler, executor)
    assert b_again.num_cached_tokens == 11  # b untouched: a full hit
    assert a_again.num_cached_tokens == 4  # only a's head block survived


# ----- stop conditions -----


def test_eos_stops_and_is_kept_unless_ignore_eos():
    scheduler, executor = make()
    prompt = tokens(10)
    first = fake_next_token(prompt)
    stopped = Request("eos", prompt, max_tokens=10, eos_token_ids={first})
    ignoring = Request("ignore", prompt, max_tokens=10, eos_token_ids={first}, ignore_eos=True)
    scheduler.add_request(stopped)
    scheduler.add_request(ignoring)
    run_until_done(scheduler, executor)
    assert stopped.output_token_ids == [first] and stopped.finish_reason == "stop"
    assert len(ignoring.output_token_ids) == 10 and ignoring.finish_reason == "length"


def test_stop_token_ids_apply_even_with_ignore_eos():
    scheduler, executor = make()
    prompt = tokens(10)
    second = fake_next_token(prompt + [fake_next_token(prompt)])
    req = Request("s", prompt, max_tokens=10, stop_token_ids={second}, ignore_eos=True)
    scheduler.add_request(req)
    outputs = []
    while scheduler.has_work():
        outputs += run_step(scheduler, executor)[1]
    assert req.output_token_ids[-1] == second and req.finish_reason == "stop"
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop"
    assert [o.num_output_tokens for o in outputs] == list(range(1, len(outputs) + 1))
    assert all(o.num_prompt_tokens == 10 for o in outputs)


def test_outputs_carry_the_executors_sampled_entries():
    scheduler, _ = make()
    scheduler.add_request(Request("a", [1, 2, 3], max_tokens=2))
    plan = scheduler.schedule()
    token = SampledToken("a", 42, logprob=-0.5, top_logprobs=[(42, -0.5), (7, -1.5)])
    (output,) = scheduler.update(plan, StepResult(plan.step_id, [token]))
    assert output.new_token_ids == [42] and output.new_logprobs == [token] and not output.finished


# ----- stats -----


def test_stats_counters_and_block_gauges():
    scheduler, executor = make(budget=64)
    scheduler.add_request(Request("a", tokens(100), max_tokens=5))
    scheduler.add_request(Request("b", tokens(100), max_tokens=5))
    run_until_done(scheduler, executor)
    stats = scheduler.stats()
    assert stats.kv_blocks_free + stats.kv_blocks_used == stats.kv_blocks_total == 64
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_cached == scheduler.block_pool.num_indexed_blocks
    # b arrives while a is prefilling in 64-token chunks, so b is admitted only once a's prompt is
    # done... or in the same step; either way computed + cached covers both prompts exactly.
    assert stats.prefill_tokens + stats.prefix_cache_hits == 200
    assert stats.decode_tokens == 2 * 4
    assert stats.requests_finished == {"stop": 0, "length": 2, "abort": 0}
    assert stats.num_requests_finished == 2
    assert stats.steps == executor.num_steps
    assert set(stats.as_dict()) >= {"prefill_tokens", "kv_blocks_cached", "prefix_cache_hits"}


def test_core_imports_neither_torch_nor_grpc():
    code = (
        "import sys, scheduler_svc.core; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'grpc')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
