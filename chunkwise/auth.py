"""Shared-token authentication for gRPC calls (`authorization: Bearer <token>` metadata), and
TLS credentials from PEM files.

The executor is an internal service: every call must carry the token the scheduler was given.
The public API optionally requires one of a set of API keys the same way. Health checks stay
open so that orchestrators (docker-compose, Kubernetes) can probe without a token.

A bearer token on a plaintext connection can be read by anyone on the path, so off loopback
both services should run with TLS (`server_credentials` / `channel_credentials`).
"""

from __future__ import annotations

import hmac

import grpc

AUTH_HEADER = "authorization"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_HEADER, f"Bearer {token}"),)


def _token_ok(metadata, accepted: tuple[bytes, ...]) -> bool:
    for key, value in metadata or ():
        if key == AUTH_HEADER and isinstance(value, str) and value.startswith("Bearer "):
            offered = value[len("Bearer ") :].encode()
            # compare against every accepted token in constant time, without short-circuiting
            return any([hmac.compare_digest(offered, t) for t in accepted])
    return False


def _unauthenticated_handler(handler: grpc.RpcMethodHandler | None, message: str):
    def deny(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return _same_kind(handler, deny)


def _same_kind(handler: grpc.RpcMethodHandler | None, deny) -> grpc.RpcMethodHandler:
    """A handler of the refused method's kind (unary or streaming each way) that runs `deny`: of
    another kind gRPC would read the call's messages wrongly before refusing it."""
    requests = handler is not None and handler.request_streaming
    responses = handler is not None and handler.response_streaming
    if requests and responses:
        return grpc.stream_stream_rpc_method_handler(deny)
    if requests:
        return grpc.stream_unary_rpc_method_handler(deny)
    if responses:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Sync-server interceptor refusing calls without one of the accepted bearer tokens."""

    def __init__(self, tokens: list[str] | tuple[str, ...]):
        if not tokens or any(not t for t in tokens):
            raise ValueError("at least one non-empty token is required")
        self._accepted = tuple(t.encode() for t in tokens)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(_OPEN_PREFIXES):
            return continuation(handler_call_details)
        if _token_ok(handler_call_details.invocation_metadata, self._accepted):
            return continuation(handler_call_details)
        return _unauthenticated_handler(
            continuation(handler_call_details), "missing or wrong bearer token"
        )


class AsyncTokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """The same check for grpc.aio servers (the scheduler's optional API keys)."""

    def __init__(self, tokens: list[str] | tuple[str, ...]):
        if not tokens or any(not t for t in tokens):
            raise ValueError("at least one non-empty token is required")
        self._accepted = tuple(t.encode() for t in tokens)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        handler = await continuation(handler_call_details)
        if method.startswith(_OPEN_PREFIXES):
            return handler
        if _token_ok(handler_call_details.invocation_metadata, self._accepted):
            return handler
        return _async_unauthenticated_handler(handler, "missing or wrong API key")


def _async_unauthenticated_handler(handler, message: str):
    async def deny_unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    return _same_kind(handler, deny_stream if handler is not None and handler.response_streaming else deny_unary)


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path!r}: {e.strerror}") from None


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """TLS credentials for a server from a PEM certificate chain and its private key."""
    return grpc.ssl_server_credentials([(_read(key_file, "TLS key"), _read(cert_file, "TLS certificate"))])


def channel_credentials(ca_file: str | None = None) -> grpc.ChannelCredentials:
    """TLS credentials for a client: trust the CA certificates in `ca_file`, or the system's."""
    return grpc.ssl_channel_credentials(_read(ca_file, "CA file") if ca_file else None)
