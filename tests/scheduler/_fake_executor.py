"""Test helpers: a fake executor that checks every plan against a model of the KV cache, a fake
deterministic "model", and the pool/scheduler invariant checker.

The fake executor keeps what a real one would (per-request tokens and block tables, built from the
incremental plans) plus, for every KV slot, which (token, position) was written there and in which
step. That lets it check what the real attention would silently get wrong:
- a chunk's cached prefix really is in the KV, written by an earlier step (not by a chunk of the same
  step, and not never), which is what a block registered at schedule time would break;
- per request and per incarnation (admission or resume), computed positions are contiguous, never
  repeated and never skipped: a coverage bitmap, the check that would have caught the seed's bug;
- KV is only ever written into blocks no other request holds, and never into an indexed block.

With async scheduling the scheduler builds plan n+1 before n is executed; `Pipeline` drives that
the way the engine does (schedule ahead, then execute and update the oldest), and the fake checks
that a plan runs right after the step it follows and that `append_sampled` names a token that
step really sampled.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from chunkwise.plan import SampledToken, StepPlan, StepResult, validate_chunk_geometry
from scheduler_svc.core import Request, Scheduler

VOCAB_SIZE = 32


def fake_next_token(tokens: list[int], vocab_size: int = VOCAB_SIZE) -> int:
    """A deterministic stand-in for greedy decoding: a function of the whole known sequence."""
    return (tokens[-1] * 1103515245 + len(tokens) * 12345 + tokens[0] * 7) % vocab_size


class ExecutorCheckFailed(AssertionError):
    pass


@dataclass
class _RequestState:
    tokens: list[int]
    block_ids: list[int]
    incarnation: int
    next_position: int | None = None  # where the next chunk must start; None before the first chunk
    covered: bytearray = field(default_factory=bytearray)  # 1 = cached or computed in this incarnation
    last_sampled: tuple[int, int] | None = None  # (token, step id) of its last sample


@dataclass
class Incarnation:
    """One admission (or resume) of a request, as the executor saw it."""

    cached: int  # positions served from the prefix cache at the start
    computed: int = 0  # positions computed since
    end: int = 0  # positions with KV when it ended (or now)


class FakeExecutor:
    def __init__(self, num_blocks: int, block_size: int, scheduler: Scheduler | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scheduler = scheduler  # when given, writes into indexed blocks are caught too
        self.restart()
        self.total_computed = 0
        self.incarnations: dict[str, list[Incarnation]] = {}
        self.num_steps = 0

    def restart(self) -> None:
        """Lose all state and KV, like a crashed and restarted executor."""
        self.kv: list[list[tuple[int, int] | None]] = [[None] * self.block_size for _ in range(self.num_blocks)]
        self.kv_step: list[list[int]] = [[-1] * self.block_size for _ in range(self.num_blocks)]
        self.requests: dict[str, _RequestState] = {}
        self.block_holders: dict[int, set[str]] = {}
        self.last_step_id: int | None = None
        self.current_step = 0

    def _fail(self, message: str) -> None:
        raise ExecutorCheckFailed(message)

    def _hold(self, req_id: str, block_ids: list[int]) -> None:
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                self._fail(f"{req_id}: block id {b} out of range")
            self.block_holders.setdefault(b, set()).add(req_id)

    def execute(self, plan: StepPlan) -> StepResult:
        if self.last_step_id is not None and plan.step_id <= self.last_step_id:
            self._fail(f"step ids must increase: {plan.step_id} after {self.last_step_id}")
        if plan.follows_step_id is not None and plan.follows_step_id != self.last_step_id:
            self._fail(f"step {plan.step_id} follows {plan.follows_step_id}, but the last step run is {self.last_step_id}")
        previous_step = self.last_step_id
        self.last_step_id = plan.step_id
        self.current_step += 1
        self.num_steps += 1
        step = self.current_step
        bs = self.block_size

        # State changes, in the contract's order: drop, add, extend.
        for req_id in plan.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is None:
                self._fail(f"finished_req_ids names {req_id!r}, which the executor does not hold")
            for b in state.block_ids:
                self.block_holders[b].discard(req_id)
        sent_in_plan: set[str] = set()
        for new in plan.new_requests:
            if new.req_id in self.requests:
                self._fail(f"new request {new.req_id!r} is already held (not dropped first)")
            if not new.token_ids:
                self._fail(f"new request {new.req_id!r} has no tokens")
            self.requests[new.req_id] = _RequestState(
                tokens=list(new.token_ids),
                block_ids=list(new.block_ids),
                incarnation=len(self.incarnations.setdefault(new.req_id, [])),
            )
            self._hold(new.req_id, new.block_ids)
            sent_in_plan.add(new.req_id)
        for delta in plan.running:
            state = self.requests.get(delta.req_id)
            if state is None:
                self._fail(f"delta for {delta.req_id!r}, which the executor does not hold")
            if delta.req_id in sent_in_plan:
                self._fail(f"{delta.req_id!r} sent twice in one plan")
            if delta.append_sampled:
                if delta.new_token_ids:
                    self._fail(f"{delta.req_id!r}: append_sampled with new_token_ids")
                if plan.follows_step_id is None or state.last_sampled is None \
                        or state.last_sampled[1] != previous_step:
                    self._fail(f"{delta.req_id!r}: append_sampled, but it sampled nothing in the previous step "
                               f"(last sample {state.last_sampled}, previous step {previous_step})")
                state.tokens.append(state.last_sampled[0])
            state.tokens.extend(delta.new_token_ids)
            state.block_ids.extend(delta.new_block_ids)
            self._hold(delta.req_id, delta.new_block_ids)
            sent_in_plan.add(delta.req_id)

        seen: set[str] = set()
        sampled: list[SampledToken] = []
        # Snapshot semantics: a chunk may only read KV written by earlier steps (or by itself).
        for chunk in plan.chunks:
            validate_chunk_geometry(chunk)
            rid = chunk.req_id
            if rid in seen:
                self._fail(f"{rid!r} appears twice in the chunks of step {plan.step_id}")
            seen.add(rid)
            if rid not in sent_in_plan:
                self._fail(f"chunk for {rid!r} without a NewRequestData or RunningRequestDelta in the plan")
            state = self.requests[rid]
            start, end = chunk.num_computed_tokens, chunk.end
            if end > len(state.tokens):
                self._fail(f"{rid}: chunk ends at {end} but only {len(state.tokens)} tokens are known")
            if end > len(state.block_ids) * bs:
                self._fail(f"{rid}: chunk ends at {end} but blocks cover {len(state.block_ids) * bs} positions")
            if chunk.sample != (end == len(state.tokens)):
                self._fail(f"{rid}: sample={chunk.sample} but chunk ends at {end} of {len(state.tokens)} tokens")

            if state.next_position is None:
                # First chunk of this incarnation: [0, start) must be cached KV from earlier steps.
                state.covered = bytearray(len(state.tokens) + 1)
                for p in range(start):
                    self._check_kv(state, rid, p, step, "cached prefix")
                    state.covered[p] = 1
                self.incarnations[rid].append(Incarnation(cached=start, end=start))
            elif start != state.next_position:
                kind = "skips" if start > state.next_position else "repeats"
                self._fail(f"{rid}: chunk starts at {start}, {kind} positions after {state.next_position}")
            # Positions below kv_write_start are computed as queries but their KV must already exist.
            for p in range(start, chunk.kv_write_start):
                self._check_kv(state, rid, p, step, "unwritten cached slot")
            if len(state.covered) < end + 1:
                state.covered.extend(bytearray(end + 1 - len(state.covered)))
            for p in range(start, end):
                if state.covered[p]:
                    self._fail(f"{rid}: position {p} computed twice in one incarnation")
                state.covered[p] = 1
            for p in range(chunk.kv_write_start, end):
                self._write_kv(state, rid, p, step)
            # Never skip: everything below the end is covered now.
            if start > 0 and not state.covered[start - 1]:
                self._fail(f"{rid}: position {start - 1} neither cached nor computed")
            state.next_position = end
            incarnation = self.incarnations[rid][-1]
            incarnation.computed += chunk.num_tokens
            incarnation.end = end
            self.total_computed += chunk.num_tokens
            if chunk.sample:
                token = fake_next_token(state.tokens)
                state.last_sampled = (token, plan.step_id)
                sampled.append(SampledToken(rid, token))
        return StepResult(step_id=plan.step_id, sampled=sampled)

    def _check_kv(self, state: _RequestState, rid: str, p: int, step: int, what: str) -> None:
        bs = self.block_size
        block = state.block_ids[p // bs]
        slot = p % bs
        if self.kv[block][slot] != (state.tokens[p], p):
            self._fail(f"{rid}: {what} position {p} (block {block}) holds {self.kv[block][slot]}, "
                       f"expected {(state.tokens[p], p)}")
        if self.kv_step[block][slot] >= step:
            self._fail(f"{rid}: {what} position {p} read in the step that writes it")

    def _write_kv(self, state: _RequestState, rid: str, p: int, step: int) -> None:
        bs = self.block_size
        block = state.block_ids[p // bs]
        holders = self.block_holders.get(block, set())
        if holders != {rid}:
            self._fail(f"{rid}: writes position {p} into block {block}, which is also held by {sorted(holders - {rid})}")
        if self.scheduler is not None and self.scheduler.block_pool.blocks[block].block_hash is not None:
            self._fail(f"{rid}: writes position {p} into block {block}, which is in the prefix index")
        self.kv[block][p % bs] = (state.tokens[p], p)
        self.kv_step[block][p % bs] = step


def run_step(scheduler: Scheduler, executor: FakeExecutor):
    """One schedule / execute / update round. Returns (plan, outputs)."""
    plan = scheduler.schedule()
    if plan.is_empty:
        return plan, []
    result = executor.execute(plan)
    return plan, scheduler.update(plan, result)


class Pipeline:
    """The engine's step loop without the engine: schedule as far ahead as the scheduler allows
    (one plan, or two with async scheduling), then execute and update the oldest plan. With one
    plan in flight this is exactly `run_step`."""

    def __init__(self, scheduler: Scheduler, executor: FakeExecutor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.pending: deque[StepPlan] = deque()  # sent, not yet executed and updated
        # What the last fill() scheduled, each with the number of preemptions its schedule() made.
        self.scheduled: list[tuple[StepPlan, int]] = []

    def fill(self) -> None:
        self.scheduled = []
        while self.scheduler.can_schedule():
            preemptions = self.scheduler.stats().preemptions
            plan = self.scheduler.schedule()
            if plan.is_empty:
                return
            self.scheduled.append((plan, self.scheduler.stats().preemptions - preemptions))
            self.pending.append(plan)

    def step(self):
        """Fill, then run the oldest plan. Returns (plan, outputs); (None, []) when nothing is left."""
        self.fill()
        if not self.pending:
            return None, []
        plan = self.pending.popleft()
        return plan, self.scheduler.update(plan, self.executor.execute(plan))

    def restart(self) -> None:
        """The executor died: plans in flight are lost."""
        self.pending.clear()
        self.executor.restart()
        self.scheduler.handle_executor_restart()


def run_until_done(scheduler: Scheduler, executor: FakeExecutor, max_steps: int = 100_000) -> list:
    plans = []
    for _ in range(max_steps):
        if not scheduler.has_work():
            return plans
        plan, _ = run_step(scheduler, executor)
        if plan.is_empty:
            raise AssertionError("an empty plan with unfinished requests: the scheduler is stuck")
        plans.append(plan)
    raise AssertionError(f"not done after {max_steps} steps")


def expected_outputs_ok(req: Request) -> bool:
    """Outputs equal the fake model's greedy continuation of the prompt."""
    tokens = list(req.prompt_token_ids)
    for out in req.output_token_ids:
        if out != fake_next_token(tokens):
            return False
        tokens.append(out)
    return True


def check_invariants(scheduler: Scheduler, executor: FakeExecutor | None = None) -> None:
    """Every invariant of the pool and the scheduler's tables. O(pool + tokens); for tests only."""
    pool = scheduler.block_pool
    bs = pool.block_size
    requests = list(scheduler._requests.values())
    running = scheduler._running
    waiting = list(scheduler._waiting)
    assert len(running) + len(waiting) == len(requests), "a request is in neither queue, or in both"
    assert {id(r) for r in running} | {id(r) for r in waiting} == {id(r) for r in requests}
    assert len(running) <= scheduler.config.max_num_seqs

    # Ref counts equal block-table membership.
    table_count = [0] * pool.num_blocks
    for req in requests:
        assert len(set(req.block_ids)) == len(req.block_ids), f"{req.req_id}: a block twice in one table"
        for b in req.block_ids:
            table_count[b] += 1
    for block in pool.blocks:
        assert block.ref_count == table_count[block.block_id], (
            f"block {block.block_id}: ref count {block.ref_count}, in {table_count[block.block_id]} tables"
        )

    # Free lists: exactly the unreferenced blocks, each once.
    free = pool.free_block_ids()
    assert len(free) == len(set(free)), "a block is twice in the free lists"
    for b in free:
        assert pool.blocks[b].ref_count == 0, f"block {b} is both free and referenced"
    assert len(free) == sum(1 for c in table_count if c == 0)
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    for b in pool.cached_free_block_ids():
        assert pool.blocks[b].block_hash is not None, f"cached free block {b} has no hash"
    for b in set(free) - set(pool.cached_free_block_ids()):
        assert pool.blocks[b].block_hash is None, f"empty free block {b} still has a hash"

    # The index points only at full, executed blocks whose tokens match.
    num_hashed = sum(1 for block in pool.blocks if block.block_hash is not None)
    assert num_hashed == pool.num_indexed_blocks
    for block_hash, block in pool.index_items():
        assert block.block_hash == block_hash
        assert block.token_ids is not None and len(block.token_ids) == bs
        if executor is not None:
            contents = executor.kv[block.block_id]
            assert all(c is not None for c in contents), f"indexed block {block.block_id} was never fully written"
            assert [c[0] for c in contents] == list(block.token_ids), f"indexed block {block.block_id}: tokens differ from its KV"
            first_pos = contents[0][1]
            assert first_pos % bs == 0 and [c[1] for c in contents] == list(range(first_pos, first_pos + bs))

    for req in running:
        assert req.num_computed_tokens < req.num_tokens
        assert req.num_computed_tokens <= req.num_scheduled_tokens <= req.num_tokens + req.num_output_placeholders
        assert 0 <= req.num_output_placeholders <= scheduler.num_plans_in_flight
        if not scheduler.has_plan_in_flight:
            assert req.num_scheduled_tokens == req.num_computed_tokens and req.num_output_placeholders == 0
        assert len(req.block_ids) * bs >= req.num_scheduled_tokens
        if executor is not None:
            # Whatever the scheduler believes computed has KV in this request's blocks.
            for p in range(req.num_computed_tokens):
                b = req.block_ids[p // bs]
                assert executor.kv[b][p % bs] == (req.all_token_ids[p], p), (
                    f"{req.req_id}: position {p} counted computed but its KV is {executor.kv[b][p % bs]}"
                )
        assert req.num_registered_blocks <= len(req.block_ids)
    for req in waiting:
        assert not req.block_ids and req.num_computed_tokens == 0

    if not requests:
        assert pool.num_used_blocks == 0, f"{pool.num_used_blocks} blocks leaked"
        assert pool.num_free_blocks == pool.num_blocks
