"""Async scheduling in the scheduler core: step n+1 is planned while step n is in flight.

The fake executor runs each plan when the pipeline takes it, after the next one was already
scheduled, which is the order the engine produces; it checks that a plan runs right after the step
it follows and that every `append_sampled` names a token that step sampled.
"""

import pytest

from chunkwise.plan import StepResult
from scheduler_svc.core import Request, Scheduler, SchedulerConfig

from ._fake_executor import FakeExecutor, Pipeline, check_invariants, expected_outputs_ok, fake_next_token


def make(async_scheduling=True, budget=64, block_size=16, num_blocks=64, max_model_len=256, caching=True,
         chunked=True, max_num_seqs=64):
    config = SchedulerConfig(max_model_len=max_model_len, block_size=block_size, max_num_batched_tokens=budget,
                             max_num_seqs=max_num_seqs, enable_prefix_caching=caching,
                             enable_chunked_prefill=chunked, async_scheduling=async_scheduling)
    scheduler = Scheduler(config, num_blocks)
    executor = FakeExecutor(num_blocks, block_size, scheduler)
    return scheduler, executor, Pipeline(scheduler, executor)


def tokens(n, seed=0):
    return [(seed * 131 + i * 17 + 1) % 1000 for i in range(n)]


def drain(pipeline, max_steps=10_000):
    outputs = []
    for _ in range(max_steps):
        plan, outs = pipeline.step()
        if plan is None:
            return outputs
        outputs += outs
        check_invariants(pipeline.scheduler, pipeline.executor)
    raise AssertionError("not done")


def test_the_next_plan_is_built_while_one_is_in_flight_and_names_the_unknown_token():
    scheduler, executor, _ = make()
    req = Request("a", tokens(10), max_tokens=4)
    scheduler.add_request(req)
    p0 = scheduler.schedule()
    assert p0.follows_step_id is None and p0.chunks[0].sample
    p1 = scheduler.schedule()  # p0 still in flight: its sampled token is unknown here
    assert p1.follows_step_id == p0.step_id
    assert [(d.req_id, d.new_token_ids, d.append_sampled) for d in p1.running] == [("a", [], True)]
    (chunk,) = p1.chunks
    assert (chunk.num_computed_tokens, chunk.num_tokens, chunk.sample) == (10, 1, True)
    assert req.num_computed_tokens == 0  # nothing advances before an update
    with pytest.raises(RuntimeError, match="still in flight"):
        scheduler.schedule()  # two plans in flight at most
    with pytest.raises(RuntimeError, match="not the oldest plan in flight"):
        scheduler.update(p1, StepResult(p1.step_id))
    r0 = executor.execute(p0)
    assert [o.new_token_ids for o in scheduler.update(p0, r0)] == [[fake_next_token(tokens(10))]]
    assert req.num_computed_tokens == 10 and req.num_output_placeholders == 1
    p2 = scheduler.schedule()
    assert p2.follows_step_id == p1.step_id and p2.running[0].append_sampled
    scheduler.update(p1, executor.execute(p1))
    p3 = scheduler.schedule()
    scheduler.update(p2, executor.execute(p2))
    # p3 samples the fourth and last token: no plan after it computes anything for the request.
    assert scheduler.schedule().is_empty
    (out,) = scheduler.update(p3, executor.execute(p3))
    assert out.finished and out.finish_reason == "length"
    assert req.num_output_tokens == 4 and expected_outputs_ok(req)
    assert executor.total_computed == 10 + 3  # no position computed that a sync run would not
    check_invariants(scheduler, executor)


def test_a_request_that_stops_in_step_n_gets_nothing_from_its_chunk_in_n_plus_1():
    scheduler, executor, _ = make()
    prompt = tokens(20)
    eos = fake_next_token(prompt)  # its first token ends it
    req = Request("a", prompt, max_tokens=50, eos_token_ids={eos})
    other = Request("b", tokens(20, seed=3), max_tokens=3)
    scheduler.add_request(req)
    scheduler.add_request(other)
    p0 = scheduler.schedule()
    p1 = scheduler.schedule()
    assert {c.req_id for c in p1.chunks} == {"a", "b"}  # 'a' is computed once more, blind
    outs = scheduler.update(p0, executor.execute(p0))
    assert {o.req_id: o.finish_reason for o in outs} == {"a": "stop", "b": None}
    assert req.is_finished and not req.block_ids  # freed now, though p1 still uses them
    p2 = scheduler.schedule()
    assert "a" in p2.finished_req_ids
    outs = scheduler.update(p1, executor.execute(p1))
    assert [o.req_id for o in outs] == ["b"]  # the extra token of 'a' is discarded
    assert req.output_token_ids == [eos]
    scheduler.update(p2, executor.execute(p2))
    assert not executor.requests.get("a")
    check_invariants(scheduler, executor)


def test_a_request_preempted_while_its_chunk_is_in_flight_ignores_that_chunk_and_recomputes():
    # Two requests that cannot both grow in a pool of 4 blocks of 4 tokens: the newer is preempted
    # in a step planned while its last chunk is still in flight.
    scheduler, executor, pipeline = make(budget=16, block_size=4, num_blocks=4, max_model_len=16)
    a, b = Request("a", tokens(6), max_tokens=9), Request("b", tokens(5, seed=1), max_tokens=9)
    scheduler.add_request(a)
    scheduler.add_request(b)
    drain(pipeline)
    assert scheduler.stats().preemptions >= 1
    assert a.num_output_tokens == b.num_output_tokens == 9
    assert expected_outputs_ok(a) and expected_outputs_ok(b)
    assert scheduler.block_pool.num_used_blocks == 0


def run_workload(async_scheduling, num_blocks, caching, chunked, seed):
    scheduler, executor, pipeline = make(async_scheduling, budget=48 if chunked else 128, block_size=4,
                                         num_blocks=num_blocks, max_model_len=128, caching=caching,
                                         chunked=chunked, max_num_seqs=8)
    shared = tokens(24, seed=seed)
    reqs = []
    for i in range(12):
        prompt = shared[: 8 + (i * 5) % 17] + tokens(3 + i % 4, seed=100 + i)
        eos = {fake_next_token(prompt)} if i % 5 == 4 else set()  # some stop on their first token
        stop = {i % 32} if i % 4 == 3 else set()
        req = Request(f"r{i}", prompt, max_tokens=10 + (i * 7) % 20, eos_token_ids=eos, stop_token_ids=stop)
        reqs.append(req)
    for i, req in enumerate(reqs):
        scheduler.add_request(req)
        if i % 3 == 2:
            pipeline.step()  # arrivals spread over steps
    drain(pipeline)
    assert scheduler.block_pool.num_used_blocks == 0
    return {r.req_id: (r.output_token_ids, r.finish_reason) for r in reqs}, scheduler.stats(), executor


@pytest.mark.parametrize("caching", [True, False], ids=["PC", "no-PC"])
@pytest.mark.parametrize("chunked", [True, False], ids=["CP", "no-CP"])
@pytest.mark.parametrize("num_blocks", [32, 200], ids=["tight-pool", "roomy-pool"])
def test_async_outputs_equal_sync_outputs(caching, chunked, num_blocks):
    for seed in range(3):
        sync, sync_stats, _ = run_workload(False, num_blocks, caching, chunked, seed)
        async_, async_stats, executor = run_workload(True, num_blocks, caching, chunked, seed)
        assert async_ == sync
        if num_blocks == 32:
            assert sync_stats.preemptions > 0  # the tight pool really preempts
        # A request that stops (rather than ends by length) costs at most one extra position.
        stopped = sum(1 for _, reason in async_.values() if reason == "stop")
        extra = async_stats.decode_tokens - sync_stats.decode_tokens
        assert extra <= stopped + async_stats.recomputed_tokens
