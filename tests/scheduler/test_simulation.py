"""Simulated serving runs: many requests with shared prefixes, under all four combinations of chunked
prefill and prefix caching, against the checking fake executor."""

import random

import pytest

from scheduler_svc.core import Request, Scheduler, SchedulerConfig

from ._fake_executor import VOCAB_SIZE, FakeExecutor, check_invariants, expected_outputs_ok, run_step

BLOCK = 16
MAX_MODEL_LEN = 512
COMBOS = [
    pytest.param(chunked, caching, id=f"{'cp' if chunked else 'no-cp'}-{'pc' if caching else 'no-pc'}")
    for chunked in (True, False)
    for caching in (True, False)
]


def make_requests(num_requests: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    system_prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(20, 200))] for _ in range(8)]
    requests = []
    for i in range(num_requests):
        prefix = system_prompts[rng.randrange(len(system_prompts))]
        prompt = prefix + [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(1, 80))]
        requests.append(
            Request(
                f"req-{i}",
                prompt,
                max_tokens=rng.randrange(1, 17),
                eos_token_ids={VOCAB_SIZE - 1} if i % 3 == 0 else (),
                cache_salt=None,
            )
        )
    return requests


def simulate(requests, chunked, caching, num_blocks, arrivals_per_step=20, max_num_seqs=64, check_every=25):
    config = SchedulerConfig(
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK,
        max_num_batched_tokens=256 if chunked else MAX_MODEL_LEN,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=caching,
        enable_chunked_prefill=chunked,
    )
    scheduler = Scheduler(config, num_blocks)
    executor = FakeExecutor(num_blocks, BLOCK, scheduler)
    pending = list(requests)
    step = 0
    while pending or scheduler.has_work():
        for req in pending[:arrivals_per_step]:
            scheduler.add_request(req)
        del pending[:arrivals_per_step]
        had_work = scheduler.has_unfinished_requests()
        plan, _ = run_step(scheduler, executor)
        assert plan.chunks or not had_work, "stuck: nothing scheduled"
        assert plan.num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(plan.chunks) <= max_num_seqs
        new_ids = {n.req_id for n in plan.new_requests}
        for chunk in plan.chunks:
            known = scheduler.get_request(chunk.req_id)
            known_tokens = known.num_tokens if known is not None else None
            if chunk.kv_write_start != chunk.num_computed_tokens:
                # Only a full prompt-cache hit skips writing, and only its one cached last token.
                assert caching and chunk.req_id in new_ids and chunk.num_tokens == 1
                assert chunk.kv_write_start == chunk.end
            if chunked and caching and not chunk.sample:
                assert chunk.end % BLOCK == 0, f"non-final chunk ends at {chunk.end}"
            if not chunked and known_tokens is not None:
                assert chunk.num_computed_tokens + chunk.num_tokens <= known_tokens
        step += 1
        if step % check_every == 0:
            check_invariants(scheduler, executor)
    check_invariants(scheduler, executor)
    return scheduler, executor


def check_accounting(requests, executor):
    for req in requests:
        assert req.is_finished and req.finish_reason in ("stop", "length"), req
        assert expected_outputs_ok(req), f"{req.req_id}: outputs differ from the fake model"
        incarnations = executor.incarnations[req.req_id]
        for inc in incarnations:
            # Within one admission: cached prefix, then every position computed exactly once.
            assert inc.cached + inc.computed == inc.end
        assert incarnations[0].cached == req.num_cached_tokens
        # The last incarnation covered every prompt token and every output but the last sampled one.
        assert incarnations[-1].end == req.num_prompt_tokens + req.num_output_tokens - 1


@pytest.mark.parametrize("chunked, caching", COMBOS)
def test_thousand_requests_every_prompt_token_computed_or_cached(chunked, caching):
    requests = make_requests(1000, seed=1)
    scheduler, executor = simulate(requests, chunked, caching, num_blocks=1600)
    check_accounting(requests, executor)
    stats = scheduler.stats()
    assert stats.preemptions == 0  # the pool is ample here, so the counts below are exact
    total_prompt = sum(r.num_prompt_tokens for r in requests)
    total_cached = sum(r.num_cached_tokens for r in requests)
    assert stats.prefill_tokens + total_cached == total_prompt
    assert stats.decode_tokens == sum(r.num_output_tokens - 1 for r in requests)
    assert stats.prefill_tokens + stats.decode_tokens == executor.total_computed
    assert stats.recomputed_tokens == 0
    assert stats.steps == executor.num_steps
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.num_requests_finished == 1000
    if caching:
        assert stats.prefix_cache_hits == total_cached and stats.prefix_cache_queries == total_prompt
        assert total_cached > total_prompt // 3, "shared prefixes should mostly hit"
        for req in requests:
            cached = req.num_cached_tokens
            assert cached % BLOCK == 0 or cached == req.num_prompt_tokens - 1
    else:
        assert total_cached == 0 and stats.prefix_cache_queries == 0 and stats.kv_blocks_cached == 0


@pytest.mark.parametrize("chunked, caching", COMBOS)
def test_tight_pool_preempts_and_still_accounts_for_every_token(chunked, caching):
    requests = make_requests(300, seed=2)
    # 40 blocks of 16: one max_model_len request (32 blocks) and a little more.
    scheduler, executor = simulate(requests, chunked, caching, num_blocks=40, arrivals_per_step=5, check_every=1)
    check_accounting(requests, executor)
    stats = scheduler.stats()
    assert stats.preemptions > 0
    assert stats.prefill_tokens + stats.decode_tokens == executor.total_computed
    assert 0 < stats.recomputed_tokens < executor.total_computed
    assert stats.kv_blocks_used == 0
    # Preemptions do not move the hit rate: each request is one query of its prompt, and its hits
    # are exactly the cached tokens its usage reports (resumes are counted apart).
    if caching:
        assert stats.prefix_cache_queries == sum(r.num_prompt_tokens for r in requests)
        assert stats.prefix_cache_hits == sum(r.num_cached_tokens for r in requests)
        assert stats.resumed_cached_tokens > 0
    else:
        assert stats.prefix_cache_queries == stats.prefix_cache_hits == stats.resumed_cached_tokens == 0
