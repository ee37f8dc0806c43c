"""chunkwise's client SDK: `Client` (blocking) and `AsyncClient` (asyncio) over the public API.

    from client import Client
    with Client("127.0.0.1:50051") as c:
        r = c.generate(prompt="The capital of France is", max_tokens=8, temperature=0)
        print(r.text, r.usage.cached_prompt_tokens)
        for chunk in c.stream(prompt_token_ids=[1, 2, 3], max_tokens=4):
            print(chunk.token_ids)

Breaking out of `stream()` cancels the call, and the server frees the request's KV blocks.
Every failure is a `ChunkwiseError` carrying the gRPC status code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import grpc

from chunkwise.auth import bearer_metadata
from chunkwise.v1 import generation_pb2 as gpb
from chunkwise.v1 import generation_pb2_grpc as gpb_grpc

_FINISH = {
    gpb.FINISH_REASON_STOP: "stop",
    gpb.FINISH_REASON_LENGTH: "length",
    gpb.FINISH_REASON_ABORT: "abort",
}
# Calls that change nothing on the server and so are safe to retry on UNAVAILABLE.
_IDEMPOTENT_RETRIES = 3


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
    req = gpb.GenerateRequest(request_id=request_id, cache_salt=cache_salt)
    if prompt is not None:
        req.text = prompt
    elif prompt_token_ids is not None:
        req.token_ids.ids.extend(prompt_token_ids)
    else:
        for m in messages:
            req.messages.messages.add(role=m["role"], content=m["content"])
    s = req.sampling
    for name, value in (
        ("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
        ("top_k", top_k), ("min_p", min_p), ("seed", seed), ("logprobs", logprobs),
    ):
        if value is not None:
            setattr(s, name, value)
    s.stop.extend(stop)
    s.stop_token_ids.extend(stop_token_ids)
    s.ignore_eos = ignore_eos
    return req


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


def _options():
    return [("grpc.max_receive_message_length", 16 * 1024 * 1024)]


class Client:
    def __init__(self, address: str, api_key: str | None = None, timeout: float | None = None):
        self._channel = grpc.insecure_channel(address, options=_options())
        self._stub = gpb_grpc.GenerationStub(self._channel)
        self._metadata = bearer_metadata(api_key) if api_key else None
        self._timeout = timeout

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
        try:
            return self._stub.Abort(gpb.AbortRequest(request_id=request_id), metadata=self._metadata).aborted
        except grpc.RpcError as e:
            raise ChunkwiseError.from_rpc(e) from None

    def stats(self) -> dict:
        for attempt in range(_IDEMPOTENT_RETRIES):
            try:
                return _stats(self._stub.GetStats(gpb.GetStatsRequest(), metadata=self._metadata, timeout=10))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == _IDEMPOTENT_RETRIES - 1:
                    raise ChunkwiseError.from_rpc(e) from None
                time.sleep(0.2 * 2**attempt)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient:
    def __init__(self, address: str, api_key: str | None = None, timeout: float | None = None):
        self._channel = grpc.aio.insecure_channel(address, options=_options())
        self._stub = gpb_grpc.GenerationStub(self._channel)
        self._metadata = bearer_metadata(api_key) if api_key else None
        self._timeout = timeout

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
        try:
            resp = await self._stub.Abort(gpb.AbortRequest(request_id=request_id), metadata=self._metadata)
            return resp.aborted
        except grpc.RpcError as e:
            raise ChunkwiseError.from_rpc(e) from None

    async def stats(self) -> dict:
        import asyncio

        for attempt in range(_IDEMPOTENT_RETRIES):
            try:
                msg = await self._stub.GetStats(gpb.GetStatsRequest(), metadata=self._metadata, timeout=10)
                return _stats(msg)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == _IDEMPOTENT_RETRIES - 1:
                    raise ChunkwiseError.from_rpc(e) from None
                await asyncio.sleep(0.2 * 2**attempt)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
