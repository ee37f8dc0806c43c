"""The public gRPC API: a thin shell over the Engine.

Every way a request can be wrong ends in a status the client can act on, and never in the
server's state: INVALID_ARGUMENT naming the field (validation.py; also for bytes that are not a
valid message at all, which grpc itself would answer with INTERNAL), RESOURCE_EXHAUSTED for a
full queue and for a message over MAX_MESSAGE_BYTES (grpc refuses to receive it, before any of
our code runs), UNAVAILABLE while the executor is gone or the server is shutting down,
UNAUTHENTICATED without a valid API key.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import common_pb2 as smg_common_pb

from chunkwise.auth import AsyncTokenAuthInterceptor, server_credentials
from chunkwise.v1 import generation_pb2 as gpb
from chunkwise.v1 import generation_pb2_grpc as gpb_grpc
from scheduler_svc.engine import Engine, StreamEvent
from scheduler_svc.status import STATUS_OF_KIND as _STATUS
from scheduler_svc.status import admit
from scheduler_svc.validation import parse_generate_request
from scheduler_svc.vllm_api import SERVICE_NAME as VLLM_SERVICE_NAME
from scheduler_svc.vllm_api import VllmEngineServicer

log = logging.getLogger("chunkwise.scheduler.api")


MAX_MESSAGE_BYTES = 16 * 1024 * 1024
SERVICE_NAME = "chunkwise.v1.Generation"

FINISH_REASONS = {
    "stop": gpb.FINISH_REASON_STOP,
    "length": gpb.FINISH_REASON_LENGTH,
    "abort": gpb.FINISH_REASON_ABORT,
}


def _event_to_proto(request_id: str, ev: StreamEvent) -> gpb.GenerateResponse:
    msg = gpb.GenerateResponse(request_id=request_id, token_ids=ev.token_ids, text=ev.text)
    for s in ev.logprobs:
        lp = msg.logprobs.add()
        lp.sampled.token_id = s.token_id
        lp.sampled.logprob = s.logprob if s.logprob is not None else 0.0
        for tid, tlp in s.top_logprobs:
            lp.top.add(token_id=tid, logprob=tlp)
    if ev.finish_reason is not None:
        msg.finish_reason = FINISH_REASONS[ev.finish_reason]
        msg.usage.prompt_tokens = ev.prompt_tokens
        msg.usage.completion_tokens = ev.completion_tokens
        msg.usage.cached_prompt_tokens = ev.cached_prompt_tokens
    return msg


class _Malformed:
    """Stands in for a request whose bytes did not parse, so that the handler can answer
    INVALID_ARGUMENT (a failing deserializer makes grpc answer INTERNAL, which says "our bug")."""

    def __init__(self, error: str):
        self.error = error


def _lenient(message_cls):
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except Exception as e:  # DecodeError, or invalid UTF-8 in a string field
            return _Malformed(f"not a valid {message_cls.DESCRIPTOR.full_name} message ({e})")

    return parse


async def _refuse_malformed(request, context) -> None:
    if isinstance(request, _Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {request.error}")


class GenerationServicer(gpb_grpc.GenerationServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    async def Generate(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext):
        engine = self.engine
        await _refuse_malformed(request, context)
        parsed, stream = await admit(engine, lambda: parse_generate_request(
            request, engine.tokenizer, engine.info.vocab_size, engine.max_model_len), context)
        rid = parsed.request_id
        log.debug("request %s: %d prompt tokens", rid, len(parsed.prompt_token_ids))
        try:
            while True:
                ev = await stream.next_event()
                if ev.error is not None:
                    await context.abort(_STATUS[ev.error.kind], ev.error.message)
                yield _event_to_proto(rid, ev)
                if ev.finish_reason is not None:
                    return
        finally:
            # Reached on normal completion, on client cancellation (CancelledError) and on
            # deadline expiry: in the last two the request is still live and is aborted here.
            engine.release(rid)

    async def Abort(self, request: gpb.AbortRequest, context) -> gpb.AbortResponse:
        await _refuse_malformed(request, context)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: required")
        return gpb.AbortResponse(aborted=self.engine.abort(request.request_id))

    async def GetStats(self, request: gpb.GetStatsRequest, context) -> gpb.Stats:
        await _refuse_malformed(request, context)
        return stats_to_proto(self.engine)


def add_generation_service(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Like the generated add_GenerationServicer_to_server, with lenient request parsing."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_lenient(gpb.GenerateRequest),
            response_serializer=gpb.GenerateResponse.SerializeToString,
        ),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=_lenient(gpb.AbortRequest),
            response_serializer=gpb.AbortResponse.SerializeToString,
        ),
        "GetStats": grpc.unary_unary_rpc_method_handler(
            servicer.GetStats, request_deserializer=_lenient(gpb.GetStatsRequest),
            response_serializer=gpb.Stats.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


# The VllmEngine methods: (request type, response type, streams its response).
_VLLM_METHODS = {
    "Generate": (vpb.GenerateRequest, vpb.GenerateResponse, True),
    "Embed": (vpb.EmbedRequest, vpb.EmbedResponse, False),
    "HealthCheck": (vpb.HealthCheckRequest, vpb.HealthCheckResponse, False),
    "FlushCache": (smg_common_pb.FlushCacheRequest, smg_common_pb.FlushCacheResponse, False),
    "StartProfile": (smg_common_pb.StartProfileRequest, smg_common_pb.ProfileResponse, False),
    "StopProfile": (smg_common_pb.StopProfileRequest, smg_common_pb.ProfileResponse, False),
    "Abort": (vpb.AbortRequest, vpb.AbortResponse, False),
    "GetModelInfo": (vpb.GetModelInfoRequest, vpb.GetModelInfoResponse, False),
    "GetServerInfo": (vpb.GetServerInfoRequest, vpb.GetServerInfoResponse, False),
    "GetLoads": (vpb.GetLoadsRequest, vpb.GetLoadsResponse, False),
    "GetTokenizer": (smg_common_pb.GetTokenizerRequest, smg_common_pb.GetTokenizerChunk, True),
    "SubscribeKvEvents": (smg_common_pb.SubscribeKvEventsRequest, smg_common_pb.KvEventBatch, True),
}


def _guarded(method, streaming: bool):
    """`method` behind the malformed-bytes check (INVALID_ARGUMENT, not grpc's INTERNAL)."""
    if streaming:
        async def stream(request, context):
            await _refuse_malformed(request, context)
            async for item in method(request, context):
                yield item

        return stream

    async def unary(request, context):
        await _refuse_malformed(request, context)
        return await method(request, context)

    return unary


def add_vllm_engine_service(servicer: VllmEngineServicer, server: grpc.aio.Server) -> None:
    """Like smg_grpc_proto's add_VllmEngineServicer_to_server, with lenient request parsing."""
    handlers = {}
    for name, (request_cls, response_cls, streaming) in _VLLM_METHODS.items():
        make = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(_guarded(getattr(servicer, name), streaming),
                              request_deserializer=_lenient(request_cls),
                              response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(VLLM_SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(VLLM_SERVICE_NAME, handlers)


def stats_to_proto(engine: Engine) -> gpb.Stats:
    st = engine.scheduler.stats()
    return gpb.Stats(
        steps=st.steps,
        prefix_cache_queries=st.prefix_cache_queries,
        prefix_cache_hits=st.prefix_cache_hits,
        prefill_tokens=st.prefill_tokens,
        decode_tokens=st.decode_tokens,
        preemptions=st.preemptions,
        recomputed_tokens=st.recomputed_tokens,
        prefix_holds=st.prefix_holds,
        resumed_cached_tokens=st.resumed_cached_tokens,
        num_running=st.num_running,
        num_waiting=st.num_waiting,
        kv_blocks_total=st.kv_blocks_total,
        kv_blocks_free=st.kv_blocks_free,
        kv_blocks_used=st.kv_blocks_used,
        kv_blocks_cached=st.kv_blocks_cached,
        requests_finished=dict(st.requests_finished),
        block_size=engine.scheduler.config.block_size,
        executor_epoch=engine.info.epoch,
        attention_backend=engine.info.attention_backend,
        decode_attention=engine.info.decode_attention,
        prefill_attention=engine.info.prefill_attention,
        layer_ops=engine.info.layer_ops,
        dtype=engine.info.dtype,
        executor_restarts=engine.executor_restarts,
    )


async def build_server(
    engine: Engine, host: str, port: int, api_keys=(), tls_cert_file: str | None = None,
    tls_key_file: str | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Create (not start) the server; TLS when both files are given. Returns it and its port."""
    interceptors = [AsyncTokenAuthInterceptor(list(api_keys))] if api_keys else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    add_generation_service(GenerationServicer(engine), server)
    # The same engine, keys and limits behind SMG's vLLM engine protocol (vllm_api.py).
    add_vllm_engine_service(VllmEngineServicer(engine, engine.config.served_model_name), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    async def set_health(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME, VLLM_SERVICE_NAME):
            await health_servicer.set(name, status)

    await set_health(True)
    # NOT_SERVING while the executor is gone or the server drains, so balancers route elsewhere.
    engine.on_serving_change = lambda serving: asyncio.ensure_future(set_health(serving))
    service_names = (
        gpb.DESCRIPTOR.services_by_name["Generation"].full_name,
        VLLM_SERVICE_NAME,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(service_names, server)
    if tls_cert_file and tls_key_file:
        bound = server.add_secure_port(f"{host}:{port}", server_credentials(tls_cert_file, tls_key_file))
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    return server, bound
