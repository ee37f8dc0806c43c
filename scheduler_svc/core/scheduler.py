"""The step scheduler: packs decodes and chunked prefills into one token budget, over a paged KV pool
with automatic prefix caching.

One step is `plan = schedule()`, the executor runs it, then `update(plan, result)`. Request state
(`num_computed_tokens`, the prefix index) advances only in `update`, from what the executor reported
as executed; `schedule` only decides and allocates. That ordering is what makes the seed's bug
(blocks marked computed when scheduled, so the second chunk of a prompt skipped tokens 64..96)
impossible here.

Async scheduling (`SchedulerConfig.async_scheduling`, vLLM V1's idea): `schedule()` may build step
n+1 while step n is in flight, so the executor never waits for the scheduler; plans are then
`update()`d in order, oldest first, and at most two are in flight. Step n+1 assumes every request
that samples in n gets exactly one token: its next chunk starts where n's chunk ends
(`num_scheduled_tokens`), and its input at that position is the token n samples, which the plan
names (`append_sampled`) for the executor to fill in from its own state. How each hazard is handled:
- Prefix cache: unchanged. A block is registered in `update(n)`, after n ran; plans already built
  never hit it, later ones do. A request whose next block is being written by a step in flight is
  held like any other pending block (its hash is pending until that update).
- A request that finishes in `update(n)` (EOS, stop token, or a stop string the service finds)
  may have a chunk in n+1: that chunk is computed and its token discarded (`update` skips finished
  requests), so at most one extra token is computed and none is ever returned. Requests that will
  finish by length are known in advance and get no chunk after their last one.
- Freed blocks (finish, abort, preemption) may be handed out by the next `schedule()` while the old
  owner's chunk is still in flight. That is safe because the executor runs steps strictly in order
  (a plan says which step it follows), so the new owner's writes come after the old owner's last
  use, and a chunk in flight never writes a block that is in the prefix index (it writes only
  positions past the request's registered blocks).
- Preemption may pick a request with a chunk in flight: it is reset as usual, and its results from
  that step are ignored (each scheduled chunk remembers the request's incarnation, its
  `num_preemptions`). Aborts while steps are in flight are the same as before: results ignored.
- New arrivals are admitted in the plan being built as usual; their prefix lookup sees only
  blocks registered by steps already updated, so a hit is always KV that exists.
- Deadlines end a request through the same path as an abort (`finish_request`).
- Executor restart: `handle_executor_restart()` drops every plan in flight (the service cancels
  their calls), and the next plan re-sends every request in full under the new epoch.

Order within a step:
1. running requests that decode (one token left to compute), oldest first;
2. running requests part way through their prompt (or through a recompute), oldest first;
3. waiting requests, first come first served, while budget, `max_num_seqs` and KV blocks allow,
   stopping at the first that does not fit (so the cost never depends on the queue's length).
Waiting requests are not admitted in a step that preempted, or that left a running request without
a chunk: newer requests must not take KV or budget ahead of older ones, which is what keeps every
request finishing (see `_schedule_running`). With prefix caching, a waiting request whose next
uncached full block is being computed by a running request (same hash, not yet registered) is
held at the head of the queue and skipped for this step: it will hit that block once the step that
writes it is reported, instead of computing the same prefix again. The others behind it go on.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

from chunkwise.plan import (
    NewRequestData,
    RunningRequestDelta,
    ScheduledChunk,
    StepPlan,
    StepResult,
)

from .block_pool import BlockHash, BlockPool, KVBlock, KVEvent, hash_block_tokens
from .config import SchedulerConfig
from .request import FINISH_REASONS, FinishReason, Request, RequestOutput, RequestStatus


@dataclass(slots=True)
class SchedulerStats:
    """Counters since start (monotonic) and gauges of now. Token counts are in tokens."""

    steps: int = 0  # plans executed and reported back through update()
    # Prefix-cache accounting is committed in update(), once the step that used the lookup has run:
    # a lookup whose step never ran (the executor died, or restarted while the scheduler was idle,
    # so the plan was refused) counts nothing, since that KV was not reused.
    prefix_cache_queries: int = 0  # prompt tokens of requests' first admissions, looked up in the cache
    prefix_cache_hits: int = 0  # of those, tokens whose KV was reused from the cache
    # Tokens a preempted request got back from the cache when it resumed (usually its own blocks):
    # real reuse, but kept out of the hit rate, which would otherwise grow with preemptions.
    resumed_cached_tokens: int = 0
    prefill_tokens: int = 0  # prompt positions computed by the executor (never counts cached ones)
    decode_tokens: int = 0  # output positions computed (fed back after sampling)
    recomputed_tokens: int = 0  # positions computed again after a preemption or executor restart
    preemptions: int = 0  # requests preempted for KV space
    # Admissions put off because the request's next prefix block was being computed by another
    # request (it then gets the block as a cache hit instead); counted per request and step.
    prefix_holds: int = 0
    executor_restarts: int = 0  # handle_executor_restart() calls
    # Requests finished, by reason: always the keys 'stop', 'length' and 'abort'.
    requests_finished: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0  # allocatable now: empty plus cached-but-free; free + used == total
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0  # free blocks still holding a cached prefix (a subset of free)

    @property
    def num_requests_finished(self) -> int:
        return sum(self.requests_finished.values())

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def as_dict(self) -> dict[str, int | dict[str, int]]:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class _InFlightStep:
    plan: StepPlan
    # The Request objects, not ids: an id aborted and re-added while the step runs must not receive
    # the old request's results. With each, its num_preemptions when scheduled: a request preempted
    # while the step ran (async scheduling) must not receive them either.
    scheduled: list[tuple[Request, ScheduledChunk, int]]


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_kv_blocks: int) -> None:
        config.validate()
        config.validate_capacity(num_kv_blocks)
        self.config = config
        self.block_size = config.block_size
        self.block_pool = BlockPool(num_kv_blocks, config.block_size)
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._waiting: deque[Request] = deque()  # preempted requests go back to the front
        self._running: list[Request] = []  # oldest admission first; preemption takes from the end
        self._finished_ids_to_send: list[str] = []  # executor state to drop with the next plan
        self._in_flight: deque[_InFlightStep] = deque()  # oldest first
        self._next_step_id = 0
        self._counters = SchedulerStats()

    # ----- requests -----

    def add_request(self, req: Request) -> None:
        """Queue a request. ValueError (naming the problem) if it can never be served."""
        if req.req_id in self._requests:
            raise ValueError(f"duplicate request id {req.req_id!r}: a request with this id is still unfinished")
        if req.status is not RequestStatus.WAITING or req.ever_admitted or req.output_token_ids:
            raise ValueError(f"request {req.req_id!r} has already been scheduled once; add a fresh Request")
        if not req.prompt_token_ids:
            raise ValueError(f"request {req.req_id!r}: prompt_token_ids must not be empty")
        if min(req.prompt_token_ids) < 0:
            raise ValueError(f"request {req.req_id!r}: token ids must be >= 0")
        if req.max_tokens < 1:
            raise ValueError(f"request {req.req_id!r}: max_tokens must be >= 1, got {req.max_tokens}")
        if req.num_prompt_tokens + req.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {req.req_id!r}: prompt ({req.num_prompt_tokens} tokens) + max_tokens "
                f"({req.max_tokens}) exceeds max_model_len ({self.config.max_model_len})"
            )
        self._requests[req.req_id] = req
        self._waiting.append(req)

    def get_request(self, req_id: str) -> Request | None:
        return self._requests.get(req_id)

    def abort_request(self, req_id: str) -> bool:
        """Finish a request with reason 'abort'. False if no unfinished request has this id."""
        return self.finish_request(req_id, "abort")

    def finish_request(self, req_id: str, reason: FinishReason = "stop") -> bool:
        """End a request now (the service uses this for stop strings, and for aborts).

        Allowed while a plan is in flight: the request's results in that plan are then ignored, and
        blocks it allocated for that plan were never registered, so freeing them now is safe (they
        are handed out again only by the next schedule(), after the executor finished the step).
        """
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        req = self._requests.get(req_id)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        self._finish(req, reason)
        return True

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting)

    def has_work(self) -> bool:
        """Unfinished requests: a step to plan. (Executor state of finished requests is dropped
        with the next plan that computes something, never by a plan of its own: a step that only
        drops would keep the loop busy after the last request, and fail if the executor just died.)"""
        return self.has_unfinished_requests()

    @property
    def has_plan_in_flight(self) -> bool:
        return bool(self._in_flight)

    @property
    def num_plans_in_flight(self) -> int:
        return len(self._in_flight)

    def can_schedule(self) -> bool:
        """Whether schedule() may be called now (fewer plans in flight than the config allows)."""
        return len(self._in_flight) < self.config.max_plans_in_flight

    # ----- scheduling -----

    def schedule(self) -> StepPlan:
        """Decide the next step. Raises RuntimeError if as many plans as allowed (one, or two with
        async scheduling) are in flight.

        A plan that `is_empty` is not in flight: there is nothing to execute, and update() with it is
        optional. Any other plan must be executed and then passed to update() with its result.
        """
        if not self.can_schedule():
            raise RuntimeError(
                f"step {self._in_flight[0].plan.step_id} is still in flight: call update() with its result "
                f"(or handle_executor_restart()) before scheduling another"
            )
        step_id = self._next_step_id
        plan = StepPlan(step_id=step_id)
        if self._in_flight:
            plan.follows_step_id = self._in_flight[-1].plan.step_id
        scheduled: list[tuple[Request, ScheduledChunk]] = []
        budget = self.config.max_num_batched_tokens
        num_preempted_before = self._counters.preemptions
        # Set when a running request gets no chunk this step; newer (waiting) requests then wait too.
        running_left_out = False

        def schedule_running(req: Request) -> bool:
            """Give a running request its chunk if it fits; False once the budget is spent."""
            nonlocal budget, running_left_out
            if budget == 0:
                running_left_out = True
                return False
            chunk = self._schedule_running(req, budget, step_id)
            if chunk is None:
                running_left_out = True
                return True
            budget -= chunk.num_tokens
            scheduled.append((req, chunk))
            return True

        # 1. Decodes, oldest first. Prefill work is collected for the second pass.
        partial_prefills: list[Request] = []
        running = self._running
        index = 0
        while index < len(running):  # the list shrinks from the end when we preempt
            req = running[index]
            index += 1
            if req.num_output_placeholders and self._finishes_by_length(req):
                continue  # its token in flight is its last: nothing more to compute
            if req.num_tokens + req.num_output_placeholders - req.num_scheduled_tokens > 1:
                partial_prefills.append(req)
                continue
            if not schedule_running(req):
                break

        # 2. Running prefills (chunks of a long prompt, or of a recompute), oldest first.
        for req in partial_prefills:
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted in this step by an older request
            if not schedule_running(req):
                break

        # Deltas for the running requests scheduled so far (new ones are sent whole below). A
        # request whose chunk in the step in flight samples builds on that unknown token: the
        # executor appends it itself (and so will know one token more than we do until update).
        for req, chunk in scheduled:
            delta = RunningRequestDelta(
                req_id=req.req_id,
                new_token_ids=req.all_token_ids[req.num_tokens_sent :],
                new_block_ids=req.block_ids[req.num_blocks_sent :],
            )
            req.num_tokens_sent = req.num_tokens
            if req.num_output_placeholders > int(chunk.sample):
                assert not delta.new_token_ids, "a token in flight after one not yet sent"
                delta.append_sampled = True
                req.num_tokens_sent += 1
            plan.running.append(delta)
            req.num_blocks_sent = len(req.block_ids)

        # 3. Waiting requests, FCFS, stopping at the first that does not fit.
        preempted_this_step = self._counters.preemptions != num_preempted_before
        if not preempted_this_step and not running_left_out:
            max_num_seqs = self.config.max_num_seqs
            waiting = self._waiting
            # Full blocks some running request is computing but has not yet reported (so not yet
            # in the prefix index). A waiting request whose next uncached block is one of them is
            # held, not admitted: admitting it now would compute the same prefix a second time,
            # since it can share the block only once the step that writes it has been executed.
            pending = self._pending_block_hashes() if self.config.enable_prefix_caching else set()
            held: list[Request] = []
            while waiting and budget > 0 and len(running) < max_num_seqs:
                req = waiting[0]
                if pending and self._next_block_is_pending(req, pending):
                    held.append(waiting.popleft())
                    continue
                admitted = self._admit(req, budget, step_id)
                if admitted is None:
                    break
                waiting.popleft()
                if self.config.enable_prefix_caching:
                    pending.update(self._uncomputed_full_block_hashes(req))
                running.append(req)
                budget -= admitted.num_tokens
                scheduled.append((req, admitted))
                plan.new_requests.append(
                    NewRequestData(
                        req_id=req.req_id,
                        token_ids=list(req.all_token_ids),
                        block_ids=list(req.block_ids),
                        sampling=req.sampling,
                    )
                )
                req.executor_has_state = True
                req.num_tokens_sent = req.num_tokens
                req.num_blocks_sent = len(req.block_ids)
            waiting.extendleft(reversed(held))  # back at the head, in their order
            self._counters.prefix_holds += len(held)

        plan.chunks = [chunk for _, chunk in scheduled]
        if scheduled:  # else the drops wait for the next plan with work (see has_work)
            plan.finished_req_ids = self._finished_ids_to_send
            self._finished_ids_to_send = []
        if not plan.is_empty:
            self._next_step_id += 1
            self._in_flight.append(_InFlightStep(
                plan=plan, scheduled=[(req, chunk, req.num_preemptions) for req, chunk in scheduled]))
        return plan

    def _finishes_by_length(self, req: Request) -> bool:
        """Whether the request ends by length once the tokens in flight are in (async scheduling)."""
        pending = req.num_output_placeholders
        return (req.num_output_tokens + pending >= req.max_tokens
                or req.num_tokens + pending >= self.config.max_model_len)

    def _chunk_length(self, start: int, remaining: int, budget: int) -> int:
        """Tokens to compute from position `start`, given `remaining` uncomputed known tokens. 0: none."""
        if remaining <= budget:
            return remaining  # the last chunk: any length
        if not self.config.enable_chunked_prefill:
            return 0  # a prompt is scheduled whole or not at all
        if not self.config.enable_prefix_caching:
            return budget
        # A non-final chunk ends on a block boundary, so every block it touches is full once written
        # and can be registered right after this step (budget 133, block 16: 133 // 16 * 16 = 128 tokens).
        end = (start + budget) // self.block_size * self.block_size
        return max(0, end - start)

    def _blocks_for(self, num_tokens: int) -> int:
        return self.config.blocks_for_tokens(num_tokens)

    def _schedule_running(self, req: Request, budget: int, step_id: int) -> ScheduledChunk | None:
        """A chunk for a running request, preempting newer unscheduled requests if KV is short.

        Liveness: a request only ever preempts requests admitted after it, and only ones with no
        chunk in this step; if no such victim is left it keeps its blocks and waits. So the oldest
        running request is never preempted, and since the pool holds one max_model_len request
        (checked at construction), it always gets its blocks once every newer request is preempted.
        In a step where nothing else was scheduled, that is exactly what happens, so no step of a
        non-empty scheduler is empty and there is no deadlock.
        """
        start = req.num_scheduled_tokens  # past any chunk of the step in flight
        num_known = req.num_tokens + req.num_output_placeholders
        num_tokens = self._chunk_length(start, num_known - start, budget)
        if num_tokens == 0:
            return None
        end = start + num_tokens
        num_new_blocks = self._blocks_for(end) - len(req.block_ids)
        if num_new_blocks > 0:
            pool = self.block_pool
            while num_new_blocks > pool.num_free_blocks:
                victim_index = self._newest_preemptible_index(req, step_id)
                if victim_index is None:
                    return None
                self._preempt(victim_index)
            req.block_ids.extend(pool.allocate(num_new_blocks))
        req.scheduled_in_step = step_id
        req.num_scheduled_tokens = end
        sample = end == num_known
        req.num_output_placeholders += sample
        return ScheduledChunk(
            req_id=req.req_id,
            num_computed_tokens=start,
            num_tokens=num_tokens,
            kv_write_start=start,
            sample=sample,
        )

    def _newest_preemptible_index(self, req: Request, step_id: int) -> int | None:
        """Index in running of the newest request admitted after `req` that has no chunk this step."""
        running = self._running
        for index in range(len(running) - 1, -1, -1):
            candidate = running[index]
            if candidate is req:
                return None
            if candidate.scheduled_in_step != step_id:
                return index
        return None

    def _preempt(self, running_index: int) -> None:
        """Preempt by recompute: free the blocks, requeue at the front of the waiting queue.

        Its full blocks were registered as they were computed, so on resume the normal prefix lookup
        usually finds them again (unless evicted meanwhile); tail blocks are evicted first.
        """
        req = self._running.pop(running_index)
        self._reset_for_recompute(req)
        self._counters.preemptions += 1
        self._waiting.appendleft(req)

    def _reset_for_recompute(self, req: Request) -> None:
        self.block_pool.release(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = req.num_scheduled_tokens = req.num_output_placeholders = 0
        req.num_registered_blocks = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        req.admission_pending = False  # its admission step never ran (restart): nothing was reused
        self._drop_executor_state(req)

    def _drop_executor_state(self, req: Request) -> None:
        if req.executor_has_state:
            self._finished_ids_to_send.append(req.req_id)
            req.executor_has_state = False
        req.num_tokens_sent = 0
        req.num_blocks_sent = 0

    def _uncomputed_full_block_hashes(self, req: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks that are not registered yet (being computed)."""
        num_full = req.num_tokens // self.block_size
        return [self._block_hash(req, i) for i in range(req.num_registered_blocks, num_full)]

    def _pending_block_hashes(self) -> set[BlockHash]:
        pending: set[BlockHash] = set()
        size = self.block_size
        for req in self._running:
            if req.num_registered_blocks < req.num_tokens // size:
                pending.update(self._uncomputed_full_block_hashes(req))
        return pending

    def _next_block_is_pending(self, req: Request, pending: set[BlockHash]) -> bool:
        """Whether the first full block of `req` that the prefix index lacks is being computed by
        a running request: then `req` gets it as a cache hit by waiting for that step to land."""
        size = self.block_size
        tokens = req.all_token_ids
        for i in range(len(tokens) // size):
            block_hash = self._block_hash(req, i)
            if self.block_pool.lookup(block_hash, tokens[i * size : (i + 1) * size]) is None:
                return block_hash in pending
        return False

    def _admit(self, req: Request, budget: int, step_id: int) -> ScheduledChunk | None:
        """Give a waiting request its block table and first chunk, or None if it does not fit now."""
        pool = self.block_pool
        num_tokens_known = req.num_tokens
        cached_blocks = self._find_cached_prefix(req) if self.config.enable_prefix_caching else []
        num_cached = len(cached_blocks) * self.block_size
        if num_cached == num_tokens_known:
            # Every token's KV is cached. The executor still has to compute the last token's query
            # to sample from it, but its KV slot lies in a shared cached block: write nothing.
            start = num_tokens_known - 1
            kv_write_start = num_tokens_known
        else:
            start = kv_write_start = num_cached
        num_tokens = self._chunk_length(start, num_tokens_known - start, budget)
        if num_tokens == 0:
            return None
        end = start + num_tokens
        num_new_blocks = self._blocks_for(end) - len(cached_blocks)
        # A hit on a free cached block takes that block out of the free pool as well.
        num_hits_on_free = sum(1 for block in cached_blocks if block.ref_count == 0)
        if num_new_blocks + num_hits_on_free > pool.num_free_blocks:
            return None
        # Acquire the hits before allocating, so the allocation cannot evict them.
        pool.acquire(block.block_id for block in cached_blocks)
        req.block_ids = [block.block_id for block in cached_blocks] + pool.allocate(num_new_blocks)
        req.num_computed_tokens = start
        req.num_registered_blocks = len(cached_blocks)
        req.ever_admitted = True
        # The hit is only a candidate until this step is reported executed (see _commit_admission).
        req.admission_pending = True
        req.status = RequestStatus.RUNNING
        req.scheduled_in_step = step_id
        req.num_scheduled_tokens = end
        req.num_output_placeholders = int(end == num_tokens_known)
        return ScheduledChunk(
            req_id=req.req_id,
            num_computed_tokens=start,
            num_tokens=num_tokens,
            kv_write_start=kv_write_start,
            sample=end == num_tokens_known,
        )

    def _block_hash(self, req: Request, block_index: int) -> BlockHash:
        """The prefix hash of the request's block `block_index` (which must be full of known tokens)."""
        hashes = req.block_hashes
        size = self.block_size
        tokens = req.all_token_ids
        while len(hashes) <= block_index:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[i * size : (i + 1) * size], req.cache_salt))
        return hashes[block_index]

    def _find_cached_prefix(self, req: Request) -> list[KVBlock]:
        """The longest run of cached full blocks from the start of the request's tokens."""
        size = self.block_size
        tokens = req.all_token_ids
        hits: list[KVBlock] = []
        for i in range(len(tokens) // size):
            block = self.block_pool.lookup(self._block_hash(req, i), tokens[i * size : (i + 1) * size])
            if block is None:
                break
            hits.append(block)
        return hits

    # ----- results -----

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Apply an executed step: advance computed tokens, register newly full blocks, append
        sampled tokens, apply stop conditions, free finished requests. Returns one RequestOutput per
        request that got a token.

        RuntimeError if `plan` is not the oldest plan in flight (updated twice, out of order, or made
        stale by handle_executor_restart). ValueError if the result misses a token the plan asked for;
        state is then unchanged and the plan stays in flight.
        """
        in_flight = self._in_flight[0] if self._in_flight else None
        if in_flight is None or plan is not in_flight.plan:
            if in_flight is None and plan.is_empty:
                return []
            raise RuntimeError(
                f"plan {plan.step_id} is not the oldest plan in flight "
                f"({'none' if in_flight is None else in_flight.plan.step_id}): updated twice, out of "
                f"order, or stale after handle_executor_restart()"
            )
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} given for plan {plan.step_id}")
        sampled = result.by_request()
        live = [(req, chunk) for req, chunk, incarnation in in_flight.scheduled
                # Aborted or finished by the service, or preempted, while the step ran: its results
                # are ignored (and nothing is registered for it).
                if not req.is_finished and req.num_preemptions == incarnation]
        for _, chunk in live:
            if chunk.sample and chunk.req_id not in sampled:
                raise ValueError(f"step {plan.step_id}: no sampled token for {chunk.req_id!r}, whose chunk asked for one")

        self._in_flight.popleft()
        self._counters.steps += 1
        caching = self.config.enable_prefix_caching
        outputs: list[RequestOutput] = []
        any_finished = False
        for req, chunk in live:
            if req.admission_pending:
                self._commit_admission(req, chunk)
            self._count_computed(req, chunk)
            req.num_computed_tokens = chunk.end
            if caching:
                self._register_computed_blocks(req)
            if not chunk.sample:
                continue
            req.num_output_placeholders -= 1
            token = sampled[req.req_id]
            req.append_output_token(token.token_id)
            reason = self._stop_reason(req, token.token_id)
            if reason is not None:
                self._finish(req, reason)
                any_finished = True
            outputs.append(
                RequestOutput(
                    req_id=req.req_id,
                    new_token_ids=[token.token_id],
                    new_logprobs=[token],
                    finished=reason is not None,
                    finish_reason=reason,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_output_tokens=req.num_output_tokens,
                    num_cached_tokens=req.num_cached_tokens,
                )
            )
        if any_finished:
            self._running = [req for req in self._running if not req.is_finished]
        return outputs

    def _commit_admission(self, req: Request, chunk: ScheduledChunk) -> None:
        """The step holding the request's admission chunk ran: the cached prefix it started from
        (positions [0, chunk start)) was really reused, so count it now and not at admission."""
        req.admission_pending = False
        cached = chunk.num_computed_tokens
        if not req.first_admission_committed:
            req.first_admission_committed = True
            req.num_cached_tokens = cached
            if self.config.enable_prefix_caching:
                self._counters.prefix_cache_queries += req.num_prompt_tokens
                self._counters.prefix_cache_hits += cached
        else:
            self._counters.resumed_cached_tokens += cached
        req.num_computed_high_water = max(req.num_computed_high_water, cached)

    def _count_computed(self, req: Request, chunk: ScheduledChunk) -> None:
        start, end = chunk.num_computed_tokens, chunk.end
        prefill = max(0, min(end, req.num_prompt_tokens) - start)
        self._counters.prefill_tokens += prefill
        self._counters.decode_tokens += chunk.num_tokens - prefill
        high_water = req.num_computed_high_water
        if start < high_water:
            self._counters.recomputed_tokens += min(end, high_water) - start
        if end > high_water:
            req.num_computed_high_water = end

    def _register_computed_blocks(self, req: Request) -> None:
        # INVARIANT (the seed's bug is a violation of it): a block enters the prefix index only here,
        # in update(), once the executor has reported the step that wrote the block's last token,
        # i.e. when num_computed_tokens, advanced from the executed chunk, covers the whole block.
        # Never in schedule(): a block allocated for a chunk that has not run holds no KV yet, and a
        # request that hit it would skip computing tokens nobody computed.
        size = self.block_size
        num_full = req.num_computed_tokens // size
        tokens = req.all_token_ids
        for i in range(req.num_registered_blocks, num_full):
            parent = self._block_hash(req, i - 1) if i > 0 else None
            self.block_pool.register(req.block_ids[i], self._block_hash(req, i), tokens[i * size : (i + 1) * size],
                                     parent, req.cache_salt)
        if num_full > req.num_registered_blocks:
            req.num_registered_blocks = num_full

    def _stop_reason(self, req: Request, token_id: int) -> FinishReason | None:
        if not req.ignore_eos and token_id in req.eos_token_ids:
            return "stop"
        if token_id in req.stop_token_ids:
            return "stop"
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Free a request that has left the queues (the caller removed it from running/waiting)."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.block_pool.release(req.block_ids)
        req.block_ids = []
        self._drop_executor_state(req)
        del self._requests[req.req_id]
        self._counters.requests_finished[reason] += 1

    # ----- recovery and maintenance -----

    def handle_executor_restart(self) -> None:
        """The executor lost all KV and request state (it crashed or restarted).

        The plan in flight, if any, is dropped (its result will never be applied; update() with it
        raises). Every running request is preempted for recompute, keeping its order at the front of
        the waiting queue, and the prefix cache is reset, since the KV it indexes is gone. The next
        plan re-sends every resumed request in full and drops nothing.
        """
        self._in_flight.clear()
        for req in reversed(self._running):
            self._reset_for_recompute(req)
            self._waiting.appendleft(req)
        self._running = []
        self._finished_ids_to_send = []
        for req in self._waiting:
            req.executor_has_state = False
        self.block_pool.reset_prefix_cache()
        self._counters.executor_restarts += 1

    def record_kv_events(self) -> None:
        """Log prefix-index changes from now on (see BlockPool); `take_kv_events` drains them."""
        self.block_pool.record_events()

    def take_kv_events(self) -> list[KVEvent]:
        return self.block_pool.take_events()

    def kv_snapshot_events(self) -> list[KVEvent]:
        """The prefix index as it is now, as events (a reset, then every indexed block)."""
        return self.block_pool.snapshot_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Returns True (it always succeeds here).

        Blocks in use keep their KV for the requests holding them and simply leave the index, so this
        is safe with requests running and with a plan in flight. If the executor's KV itself was lost,
        use handle_executor_restart() instead, which also recomputes the running requests.
        """
        self.block_pool.reset_prefix_cache()
        return True

    def stats(self) -> SchedulerStats:
        pool = self.block_pool
        return dataclasses.replace(
            self._counters,
            requests_finished=dict(self._counters.requests_finished),
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_blocks_total=pool.num_blocks,
            kv_blocks_free=pool.num_free_blocks,
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_cached=pool.num_cached_free_blocks,
        )
