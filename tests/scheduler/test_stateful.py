"""Property tests: random admit / schedule / execute / cancel / finish / restart sequences keep every
invariant, and every request finishes in bounded steps whenever one max_model_len request fits.

Both with one plan in flight and with async scheduling (the next plan built before the one in flight
is executed, as the engine's pipeline does it): the draw of the config picks one."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from chunkwise.plan import StepResult
from scheduler_svc.core import Request, Scheduler, SchedulerConfig

from ._fake_executor import VOCAB_SIZE, FakeExecutor, Pipeline, check_invariants, expected_outputs_ok

# A few base sequences; prompts take a prefix of one and add a random tail, so prefixes are shared.
BASES = [[(b * 37 + i * 11 + 3) % VOCAB_SIZE for i in range(64)] for b in range(3)]


@st.composite
def configs(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 48))
    chunked = draw(st.booleans())
    caching = draw(st.booleans())
    if chunked:
        budget = draw(st.integers(block_size, max(block_size, 40)))
    else:
        budget = draw(st.integers(max_model_len, max_model_len + 16))
    config = SchedulerConfig(
        max_model_len=max_model_len,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, 5)),
        enable_prefix_caching=caching,
        enable_chunked_prefill=chunked,
        async_scheduling=draw(st.booleans()),
    )
    min_blocks = -(-max_model_len // block_size)
    # Often exactly one max_model_len request's worth: the tightest pool the scheduler must live with.
    num_blocks = draw(st.one_of(st.just(min_blocks), st.integers(min_blocks, min_blocks * 2)))
    return config, num_blocks


@st.composite
def request_specs(draw, max_model_len, with_stops=True):
    base = draw(st.sampled_from(BASES))
    shared = draw(st.integers(0, max_model_len - 1))
    tail = draw(st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=6))
    prompt = (base[:shared] + tail)[: max_model_len - 1] or [1]
    max_tokens = draw(st.integers(1, max_model_len - len(prompt)))
    if with_stops:
        eos = draw(st.sets(st.integers(0, VOCAB_SIZE - 1), max_size=2))
        stop = draw(st.sets(st.integers(0, VOCAB_SIZE - 1), max_size=1))
    else:  # requests run to max_tokens: the most KV pressure
        eos, stop = set(), set()
    ignore_eos = draw(st.booleans())
    salt = draw(st.sampled_from([None, None, "t1"]))
    return prompt, max_tokens, eos, stop, ignore_eos, salt


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.scheduler: Scheduler | None = None
        self.all_requests: list[Request] = []
        self.next_id = 0

    @initialize(setup=configs())
    def setup(self, setup):
        config, num_blocks = setup
        self.scheduler = Scheduler(config, num_blocks)
        self.executor = FakeExecutor(num_blocks, config.block_size, self.scheduler)
        self.pipeline = Pipeline(self.scheduler, self.executor)

    @rule(data=st.data(), count=st.integers(1, 3))
    def add_requests(self, data, count):
        for _ in range(count):
            self._add_one(data)

    def _add_one(self, data):
        prompt, max_tokens, eos, stop, ignore_eos, salt = data.draw(request_specs(self.scheduler.config.max_model_len))
        req = Request(
            f"r{self.next_id}",
            prompt,
            max_tokens=max_tokens,
            eos_token_ids=eos,
            stop_token_ids=stop,
            ignore_eos=ignore_eos,
            cache_salt=salt,
        )
        self.next_id += 1
        self.scheduler.add_request(req)
        self.all_requests.append(req)

    def _live(self):
        return [r for r in self.all_requests if not r.is_finished]

    def _step(self):
        had_work = self.scheduler.has_unfinished_requests()
        plan, outputs = self.pipeline.step()
        if had_work:
            assert plan is not None, "nothing scheduled while requests were unfinished"
            if not self.scheduler.config.async_scheduling:
                # (With a plan in flight, the next may hold only drops: e.g. every running
                # request's last token is in flight.)
                assert plan.chunks, "a step scheduled nothing while requests were unfinished"
        for scheduled, preempted in self.pipeline.scheduled:
            if preempted:
                assert not scheduled.new_requests, "admitted a waiting request in a step that preempted"
        for out in outputs:
            assert len(out.new_token_ids) == 1
        return plan, outputs

    @rule(num_steps=st.integers(1, 8))
    def steps(self, num_steps):
        for _ in range(num_steps):
            self._step()
            check_invariants(self.scheduler, self.executor)

    @rule(data=st.data())
    def step_with_cancel_in_flight(self, data):
        self.pipeline.fill()
        in_flight = list(self.pipeline.pending)
        if not in_flight:
            return
        victim = data.draw(st.sampled_from(sorted({c.req_id for p in in_flight for c in p.chunks}) or [None]))
        how = data.draw(st.sampled_from(["abort", "stop"]))
        victim_req = self.scheduler.get_request(victim) if victim else None
        computed_before = victim_req.num_computed_tokens if victim_req else 0
        if victim_req is not None:
            assert self.scheduler.finish_request(victim, how)
            assert not victim_req.block_ids
        outputs = []
        for plan in in_flight:  # the plans in flight at the cancel, and only them
            assert self.pipeline.pending.popleft() is plan
            outputs += self.scheduler.update(plan, self.executor.execute(plan))
        if victim_req is not None:
            # Its results were ignored: no output, no progress, nothing registered for it.
            assert victim not in {o.req_id for o in outputs}
            assert victim_req.num_computed_tokens == computed_before

    @precondition(lambda self: self.scheduler is not None and self.scheduler.has_unfinished_requests())
    @rule(data=st.data(), reason=st.sampled_from(["abort", "stop"]))
    def cancel(self, data, reason):
        live = self._live()
        req = data.draw(st.sampled_from(live))
        assert self.scheduler.finish_request(req.req_id, reason)
        assert req.finish_reason == reason and not req.block_ids

    # Restarts and cache resets wipe the cache; drawn rarely, so most runs build up shared prefixes.
    @rule(event=st.sampled_from(["nothing"] * 6 + ["restart", "restart_with_plan_in_flight", "reset_prefix_cache"]))
    def maintenance(self, event):
        if event == "reset_prefix_cache":
            assert self.scheduler.reset_prefix_cache()
            assert self.scheduler.stats().kv_blocks_cached == 0
        elif event.startswith("restart"):
            if event == "restart_with_plan_in_flight":
                self.pipeline.fill()
            in_flight = list(self.pipeline.pending)
            self.pipeline.restart()
            assert self.scheduler.block_pool.num_indexed_blocks == 0
            assert self.scheduler.num_running == 0 and not self.scheduler.has_plan_in_flight
            for plan in in_flight:
                with pytest.raises(RuntimeError):
                    self.scheduler.update(plan, StepResult(plan.step_id))

    @invariant()
    def invariants_hold(self):
        if self.scheduler is None:
            return
        check_invariants(self.scheduler, self.executor)
        stats = self.scheduler.stats()
        assert stats.kv_blocks_free + stats.kv_blocks_used == stats.kv_blocks_total
        assert stats.kv_blocks_cached <= stats.kv_blocks_free

    def teardown(self):
        if self.scheduler is None:
            return
        # Drain: everything finishes, and then nothing leaks.
        for _ in range(5000):
            if not self.scheduler.has_work() and not self.pipeline.pending:
                break
            plan, _ = self.pipeline.step()
            assert plan is not None and not plan.is_empty
        else:
            raise AssertionError("requests did not finish")
        check_invariants(self.scheduler, self.executor)
        pool = self.scheduler.block_pool
        assert pool.num_used_blocks == 0 and pool.num_free_blocks == pool.num_blocks
        for req in self.all_requests:
            assert req.is_finished
            if req.finish_reason != "abort" and req.output_token_ids:
                assert expected_outputs_ok(req)
            if req.finish_reason == "length":
                assert req.num_output_tokens == req.max_tokens


TestSchedulerStateMachine = SchedulerMachine.TestCase
TestSchedulerStateMachine.settings = settings(
    max_examples=250,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=configs(), data=st.data())
def test_every_request_finishes_in_bounded_steps(setup, data):
    """Liveness: whatever the mix, no step is empty while work remains, and all requests finish."""
    config, num_blocks = setup
    scheduler = Scheduler(config, num_blocks)
    executor = FakeExecutor(num_blocks, config.block_size, scheduler)
    pipeline = Pipeline(scheduler, executor)
    with_stops = data.draw(st.booleans())
    specs = data.draw(st.lists(request_specs(config.max_model_len, with_stops), min_size=1, max_size=8))
    arrivals = data.draw(st.lists(st.integers(0, 6), min_size=len(specs), max_size=len(specs)))
    reqs = []
    total_tokens = 0
    for i, (prompt, max_tokens, eos, stop, ignore_eos, salt) in enumerate(specs):
        reqs.append(Request(f"r{i}", prompt, max_tokens=max_tokens, eos_token_ids=eos, stop_token_ids=stop,
                            ignore_eos=ignore_eos, cache_salt=salt))
        total_tokens += len(prompt) + max_tokens
    # Generous, but finite: each step computes at least one token; recompute after preemption can
    # redo a request's work once per newer request that outlives it.
    bound = total_tokens * (len(reqs) + 1) + 20
    step = 0
    while step < bound:
        for req, arrival in zip(reqs, arrivals):
            if arrival == step:
                scheduler.add_request(req)
        if step > max(arrivals) and not scheduler.has_work() and not pipeline.pending:
            break
        had_work = scheduler.has_unfinished_requests()
        plan, _ = pipeline.step()
        if had_work:
            assert plan is not None, f"step {step}: nothing scheduled with {scheduler.num_waiting} waiting, {scheduler.num_running} running"
            if not config.async_scheduling:
                assert plan.chunks, f"step {step}: nothing scheduled with {scheduler.num_waiting} waiting"
        for scheduled, preempted in pipeline.scheduled:
            if preempted:
                assert not scheduled.new_requests, "admitted a waiting request in a step that preempted"
        step += 1
    else:
        raise AssertionError(f"not finished after {bound} steps")
    assert all(r.is_finished and expected_outputs_ok(r) for r in reqs)
    check_invariants(scheduler, executor)
