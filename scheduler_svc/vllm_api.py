"""SMG's `vllm.grpc.engine.VllmEngine` service, served beside `chunkwise.v1.Generation`.

SMG (the Shepherd Model Gateway) talks to engines over this service with token ids only: it
tokenises, applies chat templates, detokenises and matches stop strings itself, and routes by
each replica's load and cache. Serving the same contract as vLLM's own gRPC servicer lets SMG
put chunkwise replicas behind its OpenAI-compatible HTTP front door unchanged.

A request goes through the same path as a chunkwise.v1 one: it is translated into a
`chunkwise.v1.GenerateRequest`, checked by `validation.parse_generate_request` (errors renamed to
this contract's field names) and submitted to the same Engine, under the same API keys. A
sampling feature chunkwise lacks (n > 1, penalties, structured output, prompt logprobs, logit
bias, multimodal input, KV transfer, ...) is refused with INVALID_ARGUMENT naming the field,
never ignored. Fields that only shape detokenised text (skip_special_tokens,
spaces_between_special_tokens) are accepted: this service returns token ids, never text.

Streaming follows vLLM's servicer, which SMG is built against: each chunk carries the new
tokens (and their count, not a running total); the last is followed by a `complete` message
with the finish reason and the last chunk's tokens. Without streaming there is one `complete`
with every token.

SubscribeKvEvents streams what the prefix index gains and loses (`KvEventStreams`): a first
batch that clears the subscriber's view and lists every indexed block, then one batch per step
that changed the index. A block is announced only from `Scheduler.update`, after the step that
wrote its KV, so the gateway never routes to KV that does not exist yet; an eviction, a
FlushCache and an executor restart (which drops the whole index) are announced too.

Not served: Embed, GetTokenizer and the profiler calls answer UNIMPLEMENTED, saying so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timezone
from pathlib import Path

import grpc
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from chunkwise.plan import SampledToken
from chunkwise.v1 import generation_pb2 as gpb
from scheduler_svc.core import BlockRemoved, BlockStored, CacheCleared, KVEvent
from scheduler_svc.engine import Engine, StreamEvent
from scheduler_svc.status import STATUS_OF_KIND as _STATUS
from scheduler_svc.status import admit
from scheduler_svc.validation import MAX_LOGPROBS, InvalidRequest, parse_generate_request

log = logging.getLogger("chunkwise.scheduler.vllm_api")

SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
# What GetServerInfo calls this server: the gateway tells engines apart by protocol, and this is
# vLLM's protocol (chunkwise names itself in GetLoads' `version`).
SERVER_TYPE = "vllm-grpc"

# chunkwise.v1 field names as validation reports them -> this contract's names.
_FIELD_NAMES = (
    ("prompt.token_ids", "tokenized.input_ids"),
    ("prompt.text", "text"),
    ("prompt", "input"),
    ("sampling.", "sampling_params."),
)


def _rename(e: InvalidRequest) -> InvalidRequest:
    for ours, theirs in _FIELD_NAMES:
        if e.field.startswith(ours):
            field = theirs + e.field[len(ours):]
            return InvalidRequest(field, str(e).split(": ", 1)[1])
    return e


def _refuse_unsupported(req: vpb.GenerateRequest) -> None:
    """INVALID_ARGUMENT for every field that asks for something chunkwise does not do."""
    sp = req.sampling_params

    def refuse(field: str, what: str) -> None:
        raise InvalidRequest(field, f"{what} is not supported by chunkwise")

    if sp.n > 1:
        refuse("sampling_params.n", f"n = {sp.n} (parallel samples)")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(sp, name) != 0:
            refuse(f"sampling_params.{name}", name.replace("_", " "))
    if sp.repetition_penalty not in (0.0, 1.0):  # 0: unset on the wire; 1: no penalty
        refuse("sampling_params.repetition_penalty", "repetition penalty")
    if sp.min_tokens > 0:
        refuse("sampling_params.min_tokens", "min_tokens")
    if sp.HasField("prompt_logprobs"):
        refuse("sampling_params.prompt_logprobs", "prompt logprobs")
    if sp.logit_bias:
        refuse("sampling_params.logit_bias", "logit bias")
    if sp.HasField("truncate_prompt_tokens"):
        refuse("sampling_params.truncate_prompt_tokens", "prompt truncation")
    constraint = sp.WhichOneof("constraint")
    if constraint is not None:
        refuse(f"sampling_params.{constraint}", "structured output")
    if sp.include_stop_str_in_output and sp.stop:
        refuse("sampling_params.include_stop_str_in_output", "including the stop string in the output")
    if sp.HasField("logprobs") and sp.logprobs < 0:
        refuse("sampling_params.logprobs", "logprobs = -1 (the whole vocabulary)")
    if sp.HasField("seed") and sp.seed < 0:
        raise InvalidRequest("sampling_params.seed", f"must be >= 0, got {sp.seed}")
    if req.HasField("mm_inputs") or req.extra_mm_inputs or req.HasField("media_refs"):
        refuse("mm_inputs", "multimodal input")
    if req.HasField("kv_transfer_params") or req.HasField("kv_transfer_params_json"):
        refuse("kv_transfer_params", "KV transfer (prefill/decode disaggregation)")
    if req.HasField("data_parallel_rank") and req.data_parallel_rank != 0:
        refuse("data_parallel_rank", f"data-parallel rank {req.data_parallel_rank} (one rank per replica)")


def to_generation_request(req: vpb.GenerateRequest, max_model_len: int) -> gpb.GenerateRequest:
    """The chunkwise.v1 request this one asks for, or InvalidRequest naming this contract's field."""
    _refuse_unsupported(req)
    out = gpb.GenerateRequest(request_id=req.request_id)
    kind = req.WhichOneof("input")
    if kind == "tokenized":
        out.token_ids.ids.extend(req.tokenized.input_ids)
        prompt_len = len(req.tokenized.input_ids)
    elif kind == "text":
        out.text = req.text
        prompt_len = None
    else:
        raise InvalidRequest("input", "one of tokenized or text is required")
    sp, s = req.sampling_params, out.sampling
    # Plain proto3 scalars here (top_p, top_k, min_p) read 0 when unset, which is also their
    # "off" value (top_p 0 would be meaningless), so 0 leaves chunkwise's default.
    if sp.HasField("temperature"):
        s.temperature = sp.temperature
    if sp.top_p != 0:
        s.top_p = sp.top_p
    if sp.top_k != 0:
        s.top_k = sp.top_k
    if sp.min_p != 0:
        s.min_p = sp.min_p
    if sp.HasField("seed"):
        s.seed = sp.seed
    if sp.HasField("max_tokens"):
        s.max_tokens = sp.max_tokens
    elif prompt_len is not None:
        s.max_tokens = max(1, max_model_len - prompt_len)  # vLLM's default: the rest of the context
    s.stop.extend(sp.stop)
    s.stop_token_ids.extend(sp.stop_token_ids)
    s.ignore_eos = sp.ignore_eos
    if sp.HasField("logprobs"):
        if sp.logprobs > MAX_LOGPROBS:
            raise InvalidRequest("sampling_params.logprobs", f"must be at most {MAX_LOGPROBS}, got {sp.logprobs}")
        s.logprobs = sp.logprobs
    return out


def _logprobs(tokens: list[SampledToken]) -> vpb.OutputLogProbs:
    out = vpb.OutputLogProbs()
    for t in tokens:
        out.token_ids.append(t.token_id)
        out.token_logprobs.append(t.logprob if t.logprob is not None else 0.0)
        top = out.top_logprobs.add()
        for tid, lp in t.top_logprobs:
            top.token_ids.append(tid)
            top.values.append(lp)
    return out


def _chunk(ev: StreamEvent, wants_logprobs: bool) -> vpb.GenerateResponse:
    chunk = vpb.GenerateStreamChunk(token_ids=ev.token_ids, prompt_tokens=ev.prompt_tokens,
                                    completion_tokens=len(ev.token_ids), cached_tokens=ev.cached_prompt_tokens)
    if wants_logprobs:
        chunk.output_logprobs.CopyFrom(_logprobs(ev.logprobs))
    return vpb.GenerateResponse(chunk=chunk)


def _complete(token_ids: list[int], logprobs: list[SampledToken], ev: StreamEvent,
              wants_logprobs: bool) -> vpb.GenerateResponse:
    done = vpb.GenerateComplete(output_ids=token_ids, finish_reason=ev.finish_reason or "stop",
                                prompt_tokens=ev.prompt_tokens, completion_tokens=len(token_ids),
                                cached_tokens=ev.cached_prompt_tokens)
    if wants_logprobs:
        done.output_logprobs.CopyFrom(_logprobs(logprobs))
    return vpb.GenerateResponse(complete=done)


# A subscriber this many batches behind is dropped (its stream ends UNAVAILABLE and it
# subscribes again, getting a fresh snapshot) rather than buffered without bound.
MAX_PENDING_KV_BATCHES = 1024


def block_hash_id(block_hash: bytes) -> int:
    """A block's SHA-256 as the protocol's int64: its first 8 bytes, signed. For routing only; the
    cache itself matches full digests and tokens."""
    return int.from_bytes(block_hash[:8], "big", signed=True)


def kv_events_to_proto(events: list[KVEvent], block_size: int, first_event_id: int) -> list[cpb.KvCacheEvent]:
    out: list[cpb.KvCacheEvent] = []
    for i, ev in enumerate(events, first_event_id):
        if isinstance(ev, BlockStored):
            stored = cpb.KvBlocksStored(
                blocks=[cpb.KvBlock(block_hash=block_hash_id(ev.block_hash), token_ids=ev.token_ids,
                                    block_size=block_size)],
                tier=cpb.KV_CACHE_TIER_DEVICE, locality=cpb.KV_CACHE_LOCALITY_LOCAL,
            )
            if ev.parent_hash is not None:
                stored.parent_block_hash = block_hash_id(ev.parent_hash)
            if isinstance(ev.extra_key, str):
                stored.cache_salt = ev.extra_key
            out.append(cpb.KvCacheEvent(event_id=i, stored=stored))
        elif isinstance(ev, BlockRemoved):
            out.append(cpb.KvCacheEvent(event_id=i, removed=cpb.KvBlocksRemoved(
                block_hashes=[block_hash_id(ev.block_hash)], tier=cpb.KV_CACHE_TIER_DEVICE,
                locality=cpb.KV_CACHE_LOCALITY_LOCAL)))
        elif isinstance(ev, CacheCleared):
            out.append(cpb.KvCacheEvent(event_id=i, cleared=cpb.KvCacheCleared()))
    return out


class _Subscriber:
    def __init__(self) -> None:
        # None is the last item of a subscriber that fell behind: its stream ends.
        self.queue: asyncio.Queue[cpb.KvEventBatch | None] = asyncio.Queue()


class KvEventStreams:
    """Fans the engine's KV events out to SubscribeKvEvents streams, numbering the batches."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.sequence = 0  # the number of the last batch published
        self.next_event_id = 0
        self.subscribers: set[_Subscriber] = set()
        self._hooked = False

    def _batch(self, events: list[KVEvent], sequence: int) -> cpb.KvEventBatch:
        protos = kv_events_to_proto(events, self.engine.scheduler.config.block_size, self.next_event_id)
        self.next_event_id += len(protos)
        return cpb.KvEventBatch(sequence_number=sequence, timestamp=time.time(), events=protos)

    def publish(self, events: list[KVEvent]) -> None:
        if not self.subscribers:
            return
        self.sequence += 1
        batch = self._batch(events, self.sequence)
        for sub in list(self.subscribers):
            if sub.queue.qsize() >= MAX_PENDING_KV_BATCHES:
                self.subscribers.discard(sub)
                sub.queue.put_nowait(None)
            else:
                sub.queue.put_nowait(batch)

    def subscribe(self) -> tuple[_Subscriber, cpb.KvEventBatch]:
        """A new subscriber and its first batch: the whole index as it is now."""
        if not self._hooked:
            self.engine.add_kv_event_sink(self.publish)  # from now on the core records events
            self._hooked = True
        self.engine.publish_kv_events()  # what is pending belongs to the earlier subscribers
        sub = _Subscriber()
        self.subscribers.add(sub)
        return sub, self._batch(self.engine.scheduler.kv_snapshot_events(), self.sequence)

    def unsubscribe(self, sub: _Subscriber) -> None:
        self.subscribers.discard(sub)


class VllmEngineServicer(vpb_grpc.VllmEngineServicer):
    def __init__(self, engine: Engine, served_model_name: str | None = None):
        self.engine = engine
        self.served_model_name = served_model_name
        self.started = time.time()
        self.kv_streams = KvEventStreams(engine)

    async def Generate(self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext):
        engine = self.engine
        parsed, stream = await admit(engine, lambda: parse_generate_request(
            to_generation_request(request, engine.max_model_len), engine.tokenizer, engine.info.vocab_size,
            engine.max_model_len), context, describe=lambda e: str(_rename(e)))
        rid = parsed.request_id
        wants_logprobs = stream.wants_logprobs
        token_ids: list[int] = []
        logprobs: list[SampledToken] = []
        try:
            while True:
                ev = await stream.next_event()
                if ev.error is not None:
                    await context.abort(_STATUS[ev.error.kind], ev.error.message)
                if request.stream:
                    if ev.token_ids:
                        yield _chunk(ev, wants_logprobs)
                    if ev.finish_reason is not None:
                        yield _complete(ev.token_ids, ev.logprobs, ev, wants_logprobs)
                else:
                    token_ids.extend(ev.token_ids)
                    logprobs.extend(ev.logprobs)
                    if ev.finish_reason is not None:
                        yield _complete(token_ids, logprobs, ev, wants_logprobs)
                if ev.finish_reason is not None:
                    return
        finally:
            engine.release(rid)

    async def HealthCheck(self, request: vpb.HealthCheckRequest, context) -> vpb.HealthCheckResponse:
        healthy = self.engine.serving
        return vpb.HealthCheckResponse(healthy=healthy, message="serving" if healthy else
                                       "not serving: the executor is unavailable or the server is stopping")

    async def Abort(self, request: vpb.AbortRequest, context) -> vpb.AbortResponse:
        for rid in request.request_ids:
            self.engine.abort(rid)
        return vpb.AbortResponse()

    async def GetModelInfo(self, request: vpb.GetModelInfoRequest, context) -> vpb.GetModelInfoResponse:
        engine, info = self.engine, self.engine.info
        tok = engine.tokenizer
        return vpb.GetModelInfoResponse(
            model_path=info.model_path,
            is_generation=True,
            max_context_length=engine.max_model_len,
            vocab_size=info.vocab_size,
            supports_vision=False,
            served_model_name=self.served_model_name or Path(info.model_path).name,
            tokenizer_path=engine.config.tokenizer or info.model_path,
            architectures=[info.architecture],
            eos_token_ids=list(info.eos_token_ids),
            # -1 where the tokenizer has none (0 is a real token id).
            pad_token_id=_token_id(tok, "pad_token_id"),
            bos_token_id=_token_id(tok, "bos_token_id"),
            max_req_input_len=engine.max_model_len - 1,
        )

    async def GetServerInfo(self, request: vpb.GetServerInfoRequest, context) -> vpb.GetServerInfoResponse:
        st = self.engine.scheduler.stats()
        return vpb.GetServerInfoResponse(
            active_requests=st.num_running + st.num_waiting,
            is_paused=False,
            uptime_seconds=time.time() - self.started,
            server_type=SERVER_TYPE,
            data_parallel_size=1,
            block_size=self.engine.scheduler.config.block_size,
            attention_backend=self.engine.info.attention_backend,
            model_dtype=self.engine.info.dtype,
            max_num_seqs=self.engine.scheduler.config.max_num_seqs,
        )

    async def GetLoads(self, request: vpb.GetLoadsRequest, context) -> vpb.GetLoadsResponse:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dp_rank: this replica has one rank (0), not {request.dp_rank}")
        st = self.engine.scheduler.stats()
        block = self.engine.scheduler.config.block_size
        load = vpb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=st.num_running,
            num_waiting_reqs=st.num_waiting,
            num_total_reqs=st.num_running + st.num_waiting,
            num_used_tokens=st.kv_blocks_used * block,
            max_total_num_tokens=st.kv_blocks_total * block,
            token_usage=st.kv_blocks_used / st.kv_blocks_total if st.kv_blocks_total else 0.0,
            cache_hit_rate=st.prefix_cache_hits / st.prefix_cache_queries if st.prefix_cache_queries else 0.0,
            max_running_requests=self.engine.scheduler.config.max_num_seqs,
        )
        return vpb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version=_version(),
                                    dp_rank_count=1, loads=[load])

    async def FlushCache(self, request: cpb.FlushCacheRequest, context) -> cpb.FlushCacheResponse:
        # Every block leaves the prefix index; blocks that running requests hold keep their KV
        # for them, so nothing in flight is disturbed and the call never has to wait.
        self.engine.reset_prefix_cache()
        return cpb.FlushCacheResponse(success=True, message="prefix cache cleared")

    async def _unimplemented(self, what: str, context) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{what} is not implemented by chunkwise")

    async def Embed(self, request, context):
        await self._unimplemented("Embed (embeddings)", context)

    async def StartProfile(self, request, context):
        await self._unimplemented("StartProfile", context)

    async def StopProfile(self, request, context):
        await self._unimplemented("StopProfile", context)

    async def GetTokenizer(self, request, context):
        await self._unimplemented("GetTokenizer (start the gateway with --tokenizer-path)", context)
        yield  # an async generator, as the streaming method requires

    async def SubscribeKvEvents(self, request: cpb.SubscribeKvEventsRequest, context):
        # No history is kept, so a resume (start_sequence_number > 0) gets the same fresh snapshot
        # as a new subscriber: its first batch clears the view and lists the index.
        sub, snapshot = self.kv_streams.subscribe()
        try:
            yield snapshot
            while True:
                batch = await sub.queue.get()
                if batch is None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        "KV event stream fell behind; subscribe again for a fresh snapshot")
                yield batch
        finally:
            self.kv_streams.unsubscribe(sub)


def _token_id(tokenizer, name: str) -> int:
    value = getattr(tokenizer, name, None) if tokenizer is not None else None
    return int(value) if isinstance(value, int) else -1


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"chunkwise {version('chunkwise')}"
    except PackageNotFoundError:
        return "chunkwise"
