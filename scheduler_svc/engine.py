"""The step loop: queue -> plan -> execute -> update -> stream.

One asyncio task runs `Engine._run`. Each turn it asks the pure scheduler core for a `StepPlan`,
sends it to the executor over gRPC (the event loop keeps serving clients meanwhile), awaits the
oldest step's `StepResult`, feeds it back to the core, and pushes each request's new tokens and
text to that request's stream queue, which its `Generate` handler drains. All scheduler-core calls
happen on the event loop thread, so the core needs no locks.

With async scheduling (the default; `--no-async-scheduling` turns it off) the loop keeps two steps
at the executor: step n+1 is planned and sent while n runs, so the executor starts n+1 as soon as
n is done instead of waiting for the scheduler, and the update, detokenising and streaming of n
happen while n+1 runs. The order each turn is: update(n), detokenize n's outputs (a stop string
found here ends the request before anything more is planned for it), plan and send n+2, then hand
n's outputs to the streams, then await n+1. Streaming comes after the send because the streams'
gRPC writes cost more than a fast step. Without async scheduling the turn is the same with n+1 in
place of n+2. The core's docstring says how preemption, aborts, finishes and the prefix cache stay
correct with a step in flight; a failed step drops every step behind it (`_recover`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from chunkwise.logging_setup import RepeatedLog
from chunkwise.plan import ExecutorInfo, SampledToken, StepPlan, StepResult
from scheduler_svc.config import ServiceConfig
from scheduler_svc.core import KVEvent, Request, RequestOutput, Scheduler, SchedulerConfig
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.executor_client import ExecutorClient, ExecutorError, ExecutorRejected
from scheduler_svc.metrics import Metrics
from scheduler_svc.validation import InvalidRequest, ParsedRequest

log = logging.getLogger("chunkwise.scheduler")


class ErrorKind(enum.Enum):
    """What went wrong for a request, in the engine's terms; server.py maps each to a status."""

    UNAVAILABLE = "unavailable"  # shutting down, or the executor is gone: retry later
    RESOURCE_EXHAUSTED = "resource_exhausted"  # the waiting queue is full: retry later
    INTERNAL = "internal"  # our bug, or the executor refused a step we built


class EngineError(Exception):
    """A request-level failure: its kind and a message for the client."""

    def __init__(self, kind: ErrorKind, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass
class StreamEvent:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort' on the last event
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    error: EngineError | None = None

    def then(self, later: StreamEvent) -> StreamEvent:
        """This event and the one after it as one: what both added, and the later one's counts."""
        return StreamEvent(
            token_ids=self.token_ids + later.token_ids, text=self.text + later.text,
            logprobs=self.logprobs + later.logprobs, finish_reason=later.finish_reason,
            prompt_tokens=later.prompt_tokens, completion_tokens=later.completion_tokens,
            cached_prompt_tokens=later.cached_prompt_tokens,
        )


@dataclass
class _SentStep:
    plan: StepPlan
    call: asyncio.Future[StepResult]  # ExecutorClient.execute: its result, or an ExecutorError
    sent_at: float  # time.perf_counter() when sent


@dataclass
class RequestStream:
    request_id: str
    queue: asyncio.Queue
    detokenizer: IncrementalDetokenizer | None
    wants_logprobs: bool
    arrival: float = 0.0  # time.monotonic() at admission, for latency metrics
    first_token_at: float | None = None
    finished: bool = False
    # --stream-interval: the output held back since the last event handed out, and the
    # completion-token count at that event.
    unsent: StreamEvent | None = None
    sent_tokens: int = 0
    _held: StreamEvent | None = None  # an error that arrived behind events being merged

    async def next_event(self) -> StreamEvent:
        """The next event, merged with every event already queued behind it.

        A client that reads slower than steps come (or a handler that missed a turn of the event
        loop) then gets one larger message instead of a backlog of small ones, each of which
        costs a gRPC write. An error is never merged: it comes on its own, after what came before.
        """
        if self._held is not None:
            event, self._held = self._held, None
            return event
        event = await self.queue.get()
        while event.error is None and event.finish_reason is None and not self.queue.empty():
            later = self.queue.get_nowait()
            if later.error is not None:
                self._held = later
                break
            event = event.then(later)
        return event


class Engine:
    """The step loop over one executor whose handshake is done: `await Engine.connect(...)`
    builds one, `start()` runs it."""

    def __init__(self, config: ServiceConfig, executor: ExecutorClient, info: ExecutorInfo):
        self.config = config
        self.executor = executor
        self.info = info  # the last handshake's answer; replaced when the executor comes back
        # ValueError if this executor cannot serve the configuration (too little KV, context).
        self.scheduler = Scheduler(self._core_config(info), info.num_kv_blocks)
        self.tokenizer = self._load_tokenizer()
        self.executor_restarts = 0
        self._streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._status_task: asyncio.Task | None = None
        self._executor_lost_at: float | None = None  # monotonic time the executor went away
        self._closing = False
        self._hurry = asyncio.Event()  # set: end the shutdown grace period now
        # Called with False while the engine cannot serve (executor lost, shutting down) and with
        # True when it can again; the server points it at the health service.
        self.on_serving_change: Callable[[bool], object] | None = None
        self._unusable_log = RepeatedLog(log)
        self.metrics = Metrics(lambda: self.scheduler.stats())
        # Who hears of prefix-index changes (the vLLM-protocol service's KV event streams).
        self._kv_event_sinks: list[Callable[[list[KVEvent]], object]] = []
        self._sent: deque[_SentStep] = deque()  # steps at the executor, oldest first
        self._last_result_at = 0.0  # perf_counter() when the last step's result came in

    @classmethod
    async def connect(cls, config: ServiceConfig, executor: ExecutorClient) -> Engine:
        """Handshake with the executor (ExecutorError if it does not answer in time), then build
        the engine for what it reported (ValueError if it cannot serve this configuration)."""
        info = await executor.initialize(config.block_size, config.executor_connect_timeout)
        return cls(config, executor, info)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the step loop (and the periodic status line) on the running event loop."""
        log.info(
            "executor %s: %s, vocab %d, max_model_len %d, %d KV blocks of %d tokens, %s/%s, attention %s (decode: %s, "
            "prefill: %s), element-wise ops %s, async scheduling %s",
            self.executor.address, self.info.architecture, self.info.vocab_size, self.max_model_len,
            self.info.num_kv_blocks, self.info.block_size, self.info.dtype, self.info.device,
            self.info.attention_backend, self.info.decode_attention or "unreported",
            self.info.prefill_attention or "unreported", self.info.layer_ops or "unreported",
            "on" if self.config.async_scheduling else "off",
        )
        self._task = asyncio.create_task(self._run(), name="step-loop")
        if self.config.stats_interval > 0:
            self._status_task = asyncio.create_task(self._log_status(), name="status-log")

    def _core_config(self, info: ExecutorInfo) -> SchedulerConfig:
        c = self.config
        if c.max_model_len is not None and c.max_model_len > info.max_model_len:
            raise ValueError(
                f"--max-model-len {c.max_model_len} is above the model's context length {info.max_model_len}"
            )
        core = SchedulerConfig(
            block_size=c.block_size,
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_num_seqs=c.max_num_seqs,
            max_model_len=c.max_model_len or info.max_model_len,
            enable_prefix_caching=c.enable_prefix_caching,
            enable_chunked_prefill=c.enable_chunked_prefill,
            async_scheduling=c.async_scheduling,
        )
        core.validate()  # checked here too because _adopt needs the answer before building a Scheduler
        core.validate_capacity(info.num_kv_blocks)
        return core

    def _load_tokenizer(self):
        # The one place the scheduler reads the executor's filesystem: without --tokenizer it
        # assumes the model directory the handshake names is readable here too (one host, or a
        # shared volume). Say which source it used, so a split deployment sees why text fails.
        if self.config.tokenizer:
            path, source = self.config.tokenizer, "--tokenizer"
        else:
            path, source = self.info.model_path, "the executor's model directory (no --tokenizer given)"
        try:
            from chunkwise.model_source import load_tokenizer

            tokenizer = load_tokenizer(path)
        except Exception as e:  # token-id prompts still work without one
            log.warning("no tokenizer from %s, %s (%s): text prompts will be refused; pass --tokenizer DIR "
                        "if the executor's files are not on this host", path, source, e)
            return None
        log.info("tokenizer from %s, %s", path, source)
        return tokenizer

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    @property
    def serving(self) -> bool:
        """Whether new requests can be served now (the executor is there, no shutdown begun)."""
        return not self._closing and self._executor_lost_at is None

    def _set_serving(self, serving: bool) -> None:
        if self.on_serving_change is not None:
            self.on_serving_change(serving and not self._closing)

    def hurry(self) -> None:
        """End a shutdown's grace period now (a second SIGTERM/SIGINT)."""
        self._hurry.set()

    async def stop(self, grace: float = 0.0) -> None:
        """Stop admitting; let running requests finish for up to `grace` seconds; abort the rest."""
        self._closing = True
        self._set_serving(False)
        deadline = time.monotonic() + grace
        while self.scheduler.has_unfinished_requests():
            if time.monotonic() >= deadline or self._hurry.is_set():
                break
            await asyncio.sleep(0.05)
        for rid in list(self._streams):
            self._fail(rid, EngineError(ErrorKind.UNAVAILABLE, "server is shutting down"))
        for task in (self._task, self._status_task):
            if task is not None:
                task.cancel()
        for task in (self._task, self._status_task):
            if task is not None:
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        await self._drop_sent()

    # ---- KV events ---------------------------------------------------------------------------
    def add_kv_event_sink(self, sink: Callable[[list[KVEvent]], object]) -> None:
        """Call `sink` with every batch of prefix-index changes from now on."""
        self._kv_event_sinks.append(sink)
        self.scheduler.record_kv_events()

    def publish_kv_events(self) -> None:
        """Hand what the prefix index gained and lost since the last call to every sink."""
        events = self.scheduler.take_kv_events()
        if events:
            for sink in list(self._kv_event_sinks):
                sink(events)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (running requests keep their blocks' KV)."""
        self.scheduler.reset_prefix_cache()
        self.publish_kv_events()

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, parsed: ParsedRequest) -> RequestStream:
        if self._closing:
            raise EngineError(ErrorKind.UNAVAILABLE, "server is shutting down")
        if (
            self._executor_lost_at is not None
            and time.monotonic() - self._executor_lost_at > self.config.executor_wait_timeout
        ):
            raise EngineError(ErrorKind.UNAVAILABLE, "executor unavailable")
        if self.scheduler.num_waiting >= self.config.max_waiting_requests:
            raise EngineError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"{self.scheduler.num_waiting} requests are waiting (--max-waiting-requests); retry later",
            )
        if parsed.request_id in self._streams:
            raise InvalidRequest("request_id", f"{parsed.request_id!r} is already in use")
        request = Request(
            req_id=parsed.request_id,
            prompt_token_ids=parsed.prompt_token_ids,
            sampling=parsed.sampling,
            max_tokens=parsed.max_tokens,
            eos_token_ids=frozenset(self.info.eos_token_ids),
            stop_token_ids=frozenset(parsed.stop_token_ids),
            ignore_eos=parsed.ignore_eos,
            cache_salt=parsed.cache_salt,
            arrival_time=parsed.arrival_time,
        )
        try:
            self.scheduler.add_request(request)
        except ValueError as e:
            raise InvalidRequest("request", str(e)) from None
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, parsed.prompt_token_ids, parsed.stop)
        stream = RequestStream(
            parsed.request_id, asyncio.Queue(), detok, parsed.sampling.num_logprobs is not None,
            arrival=parsed.arrival_time,
        )
        self._streams[parsed.request_id] = stream
        log.debug("request admitted", extra={"request_id": parsed.request_id,
                                             "prompt_tokens": len(parsed.prompt_token_ids)})
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> bool:
        """Abort a request (client cancelled, deadline passed, or an Abort call). Frees its blocks."""
        found = self.scheduler.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            stream.finished = True
            stream.queue.put_nowait(StreamEvent(finish_reason="abort"))
        self._wake.set()
        return found or stream is not None

    def release(self, request_id: str) -> None:
        """The Generate handler is done with this stream (normally or not)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self.scheduler.abort_request(request_id)
            self._wake.set()

    # ---- the step loop -------------------------------------------------------------------------
    async def _run(self) -> None:
        """Run the step loop; if it dies of an unexpected error (a bug), fail what was in flight,
        resynchronise with the executor and carry on, rather than leave every client waiting on a
        dead task."""
        while True:
            try:
                await self._run_steps()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("step loop failed; failing every request in flight and resynchronising")
                for rid in list(self._streams):
                    try:
                        self._fail(rid, EngineError(ErrorKind.INTERNAL, "internal error in the scheduler"))
                    except Exception:  # the core may be inconsistent; the reset below clears it
                        self._streams.pop(rid, None)
                # The executor may hold state of requests we just dropped: a new epoch clears it.
                await self._drop_sent()
                self.scheduler.handle_executor_restart()
                await self._reconnect()

    async def _run_steps(self) -> None:
        was_idle = False
        sent = self._sent
        while True:
            self.publish_kv_events()  # e.g. the reset of a restart handled in the last iteration
            if not sent:
                if not self.scheduler.has_work():
                    self._wake.clear()
                    await self._wake.wait()
                    was_idle = True
                    continue
                if was_idle:
                    was_idle = False
                    if not await self._executor_unchanged():
                        # It restarted (or went away) while nothing ran: drop the prefix index
                        # before any request is matched against KV that died with the old process.
                        self.scheduler.handle_executor_restart()
                        await self._reconnect()
                        continue
            self._plan_ahead()
            if not sent:
                # Nothing fits this step (e.g. every waiting request needs blocks nobody frees
                # until a stream is released); wait for a change rather than spin. An empty plan is
                # not in flight, so there is nothing to update.
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.05)
                except asyncio.TimeoutError:
                    pass
                continue
            step = sent[0]
            try:
                result = await step.call
            except ExecutorError as e:
                sent.popleft()
                await self._drop_sent()  # every later step builds on this one
                await self._recover(step.plan, e)
                continue
            sent.popleft()
            now = time.perf_counter()
            # A step sent behind another starts when that one's result is in.
            self.metrics.observe_step(now - max(step.sent_at, self._last_result_at), result.execute_seconds)
            self._last_result_at = now
            events = self._dispatch(self.scheduler.update(step.plan, result))
            self.publish_kv_events()  # blocks registered now that the step that wrote them ran
            # The next plan goes out before the streams are served: 32 streams' writes take
            # longer than a fast step, and the executor would wait for them. One yield lets the
            # call start (ExecutorClient.execute), then the streams' handlers wake.
            if self._plan_ahead():
                await asyncio.sleep(0)
            for queue, event in events:
                queue.put_nowait(event)
            # Yield once per step so handlers can enqueue and streams can flush.
            await asyncio.sleep(0)

    def _plan_ahead(self) -> bool:
        """Plan and send as many steps as the core allows (two with async scheduling); whether
        any was sent."""
        sent_any = False
        while self.scheduler.can_schedule() and self.scheduler.has_work():
            plan = self.scheduler.schedule()
            if plan.is_empty:
                break
            self._sent.append(self._send(plan))
            sent_any = True
        return sent_any

    def _send(self, plan: StepPlan) -> _SentStep:
        # A step queued behind another waits for it at the executor: its deadline covers both.
        timeout = self.executor.step_timeout
        if timeout is not None and plan.follows_step_id is not None:
            timeout *= 2
        return _SentStep(plan, self.executor.execute(plan, self.info.epoch, timeout=timeout), time.perf_counter())

    async def _drop_sent(self) -> None:
        """Cancel the calls of every step still at the executor and forget them."""
        steps = list(self._sent)
        self._sent.clear()
        for step in steps:
            step.call.cancel()
        for step in steps:
            try:
                await step.call
            except (asyncio.CancelledError, ExecutorError):
                pass

    async def _executor_unchanged(self) -> bool:
        """Whether the executor still has the epoch of our handshake (one loopback call, made
        only after an idle spell; under load the failed step itself tells of a restart). A step
        refused for a restart that happens after this check leaves no trace either: hits are
        counted only when their step ran (Scheduler.update)."""
        try:
            epoch = await self.executor.epoch()
        except ExecutorError as e:
            log.warning("executor at %s did not answer after an idle spell (%s); resynchronising",
                        self.executor.address, e.code)
            return False
        if epoch != self.info.epoch:
            log.warning("executor at %s restarted while idle (epoch %s, ours %s); resynchronising",
                        self.executor.address, epoch or "none", self.info.epoch)
            return False
        return True

    def _dispatch(self, outputs: list[RequestOutput]) -> list[tuple[asyncio.Queue, StreamEvent]]:
        """Detokenize a step's outputs, end the requests a stop string ends, and return the event
        for each stream (the caller delivers them once the next plan is on its way)."""
        now = time.monotonic()
        interval = self.config.stream_interval
        events = []
        for out in outputs:
            stream = self._streams.get(out.req_id)
            if stream is None or stream.finished:
                continue
            if out.new_token_ids and stream.first_token_at is None:
                stream.first_token_at = now
                self.metrics.ttft.observe(now - stream.arrival)
            finish_reason = out.finish_reason if out.finished else None
            text = ""
            if stream.detokenizer is not None:
                try:
                    text = stream.detokenizer.push(out.new_token_ids, final=out.finished)
                except Exception:  # a tokenizer failing on odd ids must cost this request only
                    log.exception("detokenizing failed", extra={"request_id": out.req_id})
                    self._fail(out.req_id, EngineError(ErrorKind.INTERNAL, "detokenization failed"))
                    continue
                if stream.detokenizer.stopped and not out.finished:
                    self.scheduler.finish_request(out.req_id, "stop")
                    finish_reason = "stop"
            event = StreamEvent(
                token_ids=list(out.new_token_ids),
                text=text,
                logprobs=list(out.new_logprobs) if stream.wants_logprobs else [],
                finish_reason=finish_reason,
                prompt_tokens=out.num_prompt_tokens,
                completion_tokens=out.num_output_tokens,
                cached_prompt_tokens=out.num_cached_tokens,
            )
            if stream.unsent is not None:
                event, stream.unsent = stream.unsent.then(event), None
            if finish_reason is None and stream.sent_tokens and event.completion_tokens - stream.sent_tokens < interval:
                stream.unsent = event  # --stream-interval: not yet
                continue
            stream.sent_tokens = event.completion_tokens
            if finish_reason is not None:
                stream.finished = True
                self.metrics.observe_finished(stream.arrival, stream.first_token_at, now, out.num_output_tokens)
                log.info(
                    "request finished",
                    extra={
                        "request_id": out.req_id,
                        "reason": finish_reason,
                        "prompt_tokens": out.num_prompt_tokens,
                        "cached_tokens": out.num_cached_tokens,
                        "completion_tokens": out.num_output_tokens,
                        "ttft_s": round(stream.first_token_at - stream.arrival, 4) if stream.first_token_at else None,
                        "e2e_s": round(now - stream.arrival, 4),
                    },
                )
            events.append((stream.queue, event))
        return events

    def _fail(self, request_id: str, error: EngineError) -> None:
        self.scheduler.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            stream.finished = True
            stream.queue.put_nowait(StreamEvent(error=error))

    async def _recover(self, plan, error: ExecutorError) -> None:
        """The executor failed a step: resynchronise from scratch, since its KV is suspect.

        Every running request is preempted for recompute (it keeps its output so far, and its
        stream stays open) and the prefix cache is reset; the new handshake gives a new epoch, so
        nothing of the old state can be half-applied. On the next steps the resumed requests are
        sent to the executor in full and their KV is computed again.
        """
        log.warning("step %d failed (%s); resynchronising with the executor", plan.step_id, error)
        self.scheduler.handle_executor_restart()
        if isinstance(error, ExecutorRejected):
            # The executor refused the plan itself: retrying it would fail again, so the
            # requests in it fail (INTERNAL: this is our bug, not the client's).
            for chunk in plan.chunks:
                self._fail(chunk.req_id, EngineError(ErrorKind.INTERNAL, f"executor rejected the step: {error.detail}"))
        await self._reconnect()

    async def _reconnect(self) -> None:
        """Handshake until the executor answers with a state this scheduler can use.

        Meanwhile requests queue (bounded by --max-waiting-requests). Once the executor has been
        gone for --executor-wait-timeout, every request is failed with UNAVAILABLE, and `submit`
        refuses new ones, until it is back.
        """
        self._executor_lost_at = lost_at = time.monotonic()
        self._set_serving(False)
        next_log = lost_at + 10.0
        while True:
            problem = None
            try:
                info = await self.executor.initialize(self.config.block_size, timeout=1.0)
                problem = self._adopt(info)
                if problem is None:
                    break
            except ExecutorError as e:
                problem = str(e)
            now = time.monotonic()
            if now - lost_at > self.config.executor_wait_timeout:
                for rid in list(self._streams):
                    self._fail(rid, EngineError(ErrorKind.UNAVAILABLE, f"executor unavailable ({problem})"))
            if now >= next_log:
                log.warning("still waiting for the executor at %s (%s)", self.executor.address, problem)
                next_log = now + 10.0
            await asyncio.sleep(0.2)
        self._executor_lost_at = None
        self._set_serving(True)
        log.info("executor back after %.1f s: epoch %s", time.monotonic() - lost_at, self.info.epoch)

    def _adopt(self, info: ExecutorInfo) -> str | None:
        """Take a new handshake's answer; a reason string if this scheduler cannot use it.

        An executor that came back with the same model and capacity (the usual restart) needs
        nothing more: handle_executor_restart() already requeued every request for recompute.
        One with a different geometry gets a fresh scheduler core (block ids and limits of the
        old one mean nothing to it), and the requests that were queued fail with UNAVAILABLE.
        """
        try:
            core = self._core_config(info)
        except ValueError as e:  # e.g. its KV cache can no longer hold one max_model_len request
            # _reconnect retries every 0.2 s: one line, then a summary now and then.
            self._unusable_log.log(logging.ERROR, str(e), "executor at %s came back unusable: %s",
                                   self.executor.address, e)
            return str(e)
        self._unusable_log.reset()
        old = self.info
        same = (
            core == self.scheduler.config
            and info.num_kv_blocks == old.num_kv_blocks
            and info.vocab_size == old.vocab_size
            and info.eos_token_ids == old.eos_token_ids
        )
        if not same:
            log.error(
                "executor came back with a different model or capacity (%d KV blocks, vocab %d; was %d, %d); "
                "restarting the scheduler core", info.num_kv_blocks, info.vocab_size, old.num_kv_blocks, old.vocab_size,
            )
            for rid in list(self._streams):
                self._fail(rid, EngineError(ErrorKind.UNAVAILABLE, "executor changed; retry the request"))
            self.publish_kv_events()  # the old core's last events (its reset among them)
            self.scheduler = Scheduler(core, info.num_kv_blocks)
            if self._kv_event_sinks:
                self.scheduler.record_kv_events()
        if info.epoch != old.epoch:
            self.executor_restarts += 1
        self.info = info
        if info.model_path != old.model_path and not self.config.tokenizer:
            self.tokenizer = self._load_tokenizer()
        return None

    async def _log_status(self) -> None:
        last = self.scheduler.stats()
        last_t = time.monotonic()
        while True:
            await asyncio.sleep(self.config.stats_interval)
            now, st = time.monotonic(), self.scheduler.stats()
            dt = max(now - last_t, 1e-9)
            queries = st.prefix_cache_queries - last.prefix_cache_queries
            hits = st.prefix_cache_hits - last.prefix_cache_hits
            log.info(
                "prefill %.1f tok/s, decode %.1f tok/s, running %d, waiting %d, KV used %.1f%%, "
                "prefix cache hit rate %.1f%%",
                (st.prefill_tokens - last.prefill_tokens) / dt,
                (st.decode_tokens - last.decode_tokens) / dt,
                st.num_running, st.num_waiting,
                100.0 * st.kv_blocks_used / max(st.kv_blocks_total, 1),
                100.0 * hits / queries if queries else 0.0,
            )
            last, last_t = st, now
