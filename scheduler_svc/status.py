"""Where the engine's outcomes meet gRPC status codes, shared by both public services (server.py's
chunkwise.v1, vllm_api.py's VllmEngine): the error kinds' codes, and admitting a request."""

from __future__ import annotations

import logging
from typing import Callable

import grpc

from scheduler_svc.engine import Engine, EngineError, ErrorKind, RequestStream
from scheduler_svc.validation import InvalidRequest, ParsedRequest

log = logging.getLogger("chunkwise.scheduler.api")

STATUS_OF_KIND = {
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


async def admit(engine: Engine, parse: Callable[[], ParsedRequest], context: grpc.aio.ServicerContext,
                describe: Callable[[InvalidRequest], str] = str) -> tuple[ParsedRequest, RequestStream]:
    """Parse and submit a request, or end the call with the status that says why not (`describe`
    words a validation error in the caller's contract's field names)."""
    try:
        parsed = parse()
        return parsed, engine.submit(parsed)
    except InvalidRequest as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, describe(e))
    except EngineError as e:
        await context.abort(STATUS_OF_KIND[e.kind], e.message)
    except Exception:  # a bug (or a tokenizer failing on odd text): say so, keep serving
        log.exception("could not admit a request")
        await context.abort(grpc.StatusCode.INTERNAL, "internal error while admitting the request")
    raise AssertionError("context.abort returned")  # it raises; this line is for the type checker
