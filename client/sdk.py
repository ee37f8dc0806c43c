"""chunkwise's client SDK: `Client` (blocking) and `AsyncClient` (asyncio) over the public API.

    from client import Client
    with Client("127.0.0.1:50051") as c:
        r = c.generate(prompt="The capital of France is", max_tokens=8, temperature=0)
        print(r.text, r.usage.cached_prompt_tokens)
        for chunk in c.stream(prompt_token_ids=[1, 2, 3], max_tokens=4):
            print(chunk.token_ids)

Breaking out of `stream()` cancels the call, and the server frees the request's KV blocks.
Every failure is a `ChunkwiseError` carrying the gRPC status code.

Options: `api_key=` (sent as `authorization: Bearer KEY`), `tls=True` / `tls_ca_file=` (TLS,
trusting the system's CAs or the given PEM file), `timeout=` (a default deadline per call, after
which the server aborts the request and frees its blocks), `retry_timeout=` (how long `stats()`
and `abort()` keep retrying while the server is UNAVAILABLE, e.g. restarting).

Generation calls are never retried by the SDK: once a request may have reached the server,
sending it again could run it twice (and sampled output would differ), so an UNAVAILABLE there
is the caller's to handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import grpc

from chunkwise.auth import bearer_metadata, channel_credentials
from chunkwise.v1 import generation_pb2 as gpb
from chunkwise.v1 import generation_pb2_grpc as gpb_grpc

_FINISH = {
    gpb.FINISH_REASON_STOP: "stop",
    gpb.FINISH_REASON_LENGTH: "length",
    gpb.FINISH_REASON_ABORT: "abort",
}
# GetStats changes nothing and Abort is idempotent, so both are retried on UNAVAILABLE.
DEFAULT_RETRY_TIMEOUT = 10.0
_PER_ATTEMPT_TIMEOUT = 10.0


class ChunkwiseError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> "ChunkwiseError":
        return cls(e.code(), e.details() or "")


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Chunk:
    """One streamed response: the tokens and text produced since the previous chunk."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    usage: Usage | None


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage
    logprobs: list[TokenLogprob]


def build_request(
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Sequence[dict] | None = None,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    logprobs: int | None = None,
    request_id: str = "",
    cache_salt: str = "",
) -> gpb.GenerateRequest:
    given = sum(x is not None for x in (prompt, prompt_token_ids, messages))
    if given != 1:
        raise ValueError("pass exactly one of prompt, prompt_token_ids, messages")
    with _field("request_id"):
        req = gpb.GenerateRequest(request_id=request_id)
    with _field("cache_salt"):
        req.cache_salt = cache_salt
    if prompt is not None:
        with _field("prompt"):
            req.text = prompt
    elif prompt_token_ids is not None:
        req.token_ids.SetInParent()  # an empty list is still a token-ids prompt (and refused as empty)
        with _field("prompt_token_ids"):
            req.token_ids.ids.extend(prompt_token_ids)
    else:
        req.messages.SetInParent()
        for m in messages:
            with _field("messages"):
                req.messages.messages.add(role=m["role"], content=m["content"])
    s = req.sampling
    for name, value in (
        ("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
        ("top_k", top_k), ("min_p", min_p), ("seed", seed), ("logprobs", logprobs),
    ):
        if value is not None:
            with _field(name):
                setattr(s, name, value)
    with _field("stop"):
        s.stop.extend(stop)
    with _field("stop_token_ids"):
        s.stop_token_ids.extend(stop_token_ids)
    with _field("ignore_eos"):
        s.ignore_eos = ignore_eos
    return req


@contextlib.contextmanager
def _field(name: str):
    """A value the wire type cannot hold (max_tokens=-1 in a uint32, a str for an int) is the
    caller's bad input: INVALID_ARGUMENT naming the field, as the server would answer, rather
    than protobuf's own ValueError/TypeError."""
    try:
        yield
    except (ValueError, TypeError, KeyError) as e:
        raise ChunkwiseError(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {e}") from None


def _chunk(msg: gpb.GenerateResponse) -> Chunk:
    finish = _FINISH.get(msg.finish_reason)
    usage = None
    if finish is not None:
        u = msg.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
    logprobs = [
        TokenLogprob(lp.sampled.token_id, lp.sampled.logprob, [(t.token_id, t.logprob) for t in lp.top])
        for lp in msg.logprobs
    ]
    return Chunk(msg.request_id, list(msg.token_ids), msg.text, logprobs, finish, usage)


def _collect(chunks) -> GenerationResult:
    ids, text, lps, rid, finish, usage = [], [], [], "", None, Usage()
    for c in chunks:
        rid = c.request_id
        ids += c.token_ids
        text.append(c.text)
        lps += c.logprobs
        if c.finish_reason is not None:
            finish, usage = c.finish_reason, c.usage
    return GenerationResult(rid, ids, "".join(text), finish, usage, lps)


def _stats(msg: gpb.Stats) -> dict:
    out = {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}
    out["requests_finished"] = dict(msg.requests_finished)
    return out


def _options(tls_server_name: str | None = None):
    options = [
        ("grpc.max_receive_message_length", 16 * 1024 * 1024),
        # Reconnect to a restarted server within a second or so, not after gRPC's default backoff
        # (which grows to two minutes).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return options


def _credentials(tls: bool, tls_ca_file: str | None):
    return channel_credentials(tls_ca_file) if (tls or tls_ca_file) else None


def _retry_delays(retry_timeout: float):
    """Sleep lengths between attempts: 0.1 s doubling to 1 s, while `retry_timeout` lasts."""
    deadline = time.monotonic() + retry_timeout
    delay = 0.1
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        yield min(delay, left)
        delay = min(delay * 2, 1.0)


class Client:
    def __init__(self, address: str, api_key: str | None = None, timeout: float | None = None, *,
                 tls: bool = False, tls_ca_file: str | None = None, tls_server_name: str | None = None,
                 retry_timeout: float = DEFAULT_RETRY_TIMEOUT):
        creds = _credentials(tls, tls_ca_file)
        options = _options(tls_server_name)
        if creds is not None:
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = gpb_grpc.GenerationStub(self._channel)
        self._metadata = bearer_metadata(api_key) if api_key else None
        self._timeout = timeout
        self._retry_timeout = retry_timeout

    def _retrying(self, call):
        """`call()` until it succeeds, fails with anything but UNAVAILABLE, or retry time is up."""
        delays = _retry_delays(self._retry_timeout)
        while True:
            try:
                return call()
            except grpc.RpcError as e:
                delay = next(delays, None) if e.code() == grpc.StatusCode.UNAVAILABLE else None
                if delay is None:
                    raise ChunkwiseError.from_rpc(e) from None
            time.sleep(delay)

    def stream(self, prompt=None, prompt_token_ids=None, messages=None, *, timeout=None, **kw) -> Iterator[Chunk]:
        call = self._stub.Generate(
            build_request(prompt, prompt_token_ids, messages, **kw),
            metadata=self._metadata,
            timeout=timeout or self._timeout,
        )
        try:
            for msg in call:
                yield _chunk(msg)
        except grpc.RpcError as e:
            raise ChunkwiseError.from_rpc(e) from None
        finally:
            call.cancel()  # no-op when finished; frees the request when the caller broke out early

    def generate(self, prompt=None, prompt_token_ids=None, messages=None, **kw) -> GenerationResult:
        return _collect(self.stream(prompt, prompt_token_ids, messages, **kw))

    def abort(self, request_id: str) -> bool:
        """Abort a request by id; False if the server knows no such live request."""
        msg = gpb.AbortRequest(request_id=request_id)
        return self._retrying(
            lambda: self._stub.Abort(msg, metadata=self._metadata, timeout=_PER_ATTEMPT_TIMEOUT).aborted
        )

    def stats(self) -> dict:
        return _stats(self._retrying(
            lambda: self._stub.GetStats(gpb.GetStatsRequest(), metadata=self._metadata, timeout=_PER_ATTEMPT_TIMEOUT)
        ))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient:
    def __init__(self, address: str, api_key: str | None = None, timeout: float | None = None, *,
                 tls: bool = False, tls_ca_file: str | None = None, tls_server_name: str | None = None,
                 retry_timeout: float = DEFAULT_RETRY_TIMEOUT):
        creds = _credentials(tls, tls_ca_file)
        options = _options(tls_server_name)
        if creds is not None:
            self._channel = grpc.aio.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        self._stub = gpb_grpc.GenerationStub(self._channel)
        self._metadata = bearer_metadata(api_key) if api_key else None
        self._timeout = timeout
        self._retry_timeout = retry_timeout

    async def _retrying(self, call):
        delays = _retry_delays(self._retry_timeout)
        while True:
            try:
                return await call()
            except grpc.RpcError as e:
                delay = next(delays, None) if e.code() == grpc.StatusCode.UNAVAILABLE else None
                if delay is None:
                    raise ChunkwiseError.from_rpc(e) from None
            await asyncio.sleep(delay)

    async def stream(self, prompt=None, prompt_token_ids=None, messages=None, *, timeout=None, **kw) -> AsyncIterator[Chunk]:
        call = self._stub.Generate(
            build_request(prompt, prompt_token_ids, messages, **kw),
            metadata=self._metadata,
            timeout=timeout or self._timeout,
        )
        try:
            async for msg in call:
                yield _chunk(msg)
        except grpc.RpcError as e:
            raise ChunkwiseError.from_rpc(e) from None
        finally:
            call.cancel()

    async def generate(self, prompt=None, prompt_token_ids=None, messages=None, **kw) -> GenerationResult:
        return _collect([c async for c in self.stream(prompt, prompt_token_ids, messages, **kw)])

    async def abort(self, request_id: str) -> bool:
        msg = gpb.AbortRequest(request_id=request_id)
        resp = await self._retrying(
            lambda: self._stub.Abort(msg, metadata=self._metadata, timeout=_PER_ATTEMPT_TIMEOUT)
        )
        return resp.aborted

    async def stats(self) -> dict:
        return _stats(await self._retrying(
            lambda: self._stub.GetStats(gpb.GetStatsRequest(), metadata=self._metadata, timeout=_PER_ATTEMPT_TIMEOUT)
        ))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
