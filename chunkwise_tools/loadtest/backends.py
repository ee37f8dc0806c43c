"""What the load tester sends requests to: chunkwise's gRPC API, or an OpenAI-compatible HTTP server."""

from __future__ import annotations

import asyncio
import json

from chunkwise.cliutil import is_loopback
from chunkwise_tools.loadtest.datasets import BenchRequest
from chunkwise_tools.loadtest.metrics import RequestRecord, StreamTimer
from chunkwise_tools.loadtest.prometheus import scrape_prometheus


def check_loopback(host: str) -> None:
    """Refuse a target off this machine unless the user asked (--allow-remote)."""
    if not is_loopback(host):
        raise ValueError(f"{host!r} is not a loopback address; pass --allow-remote to target it")


class ChunkwiseBackend:
    """chunkwise's public gRPC API through the SDK's AsyncClient."""

    name = "chunkwise"

    def __init__(self, address: str, api_key: str | None = None):
        self.address = address
        self.api_key = api_key
        self._client = None

    async def open(self) -> None:
        from client.sdk import AsyncClient

        self._client = AsyncClient(self.address, api_key=self.api_key)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def stats(self) -> dict | None:
        return await self._client.stats()

    async def send(self, req: BenchRequest, record: RequestRecord, *, cache_salt: str, timeout: float) -> None:
        kwargs = dict(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True, cache_salt=cache_salt,
                      timeout=timeout)
        timer = StreamTimer(record)
        last = None
        async for chunk in self._client.stream(req.prompt, req.prompt_token_ids, req.messages, **kwargs):
            timer.tokens(len(chunk.token_ids))
            last = chunk
        timer.done()
        if last is not None and last.usage is not None:
            record.prompt_tokens = last.usage.prompt_tokens
            record.output_tokens = last.usage.completion_tokens
            record.cached_tokens = last.usage.cached_prompt_tokens
            record.finish_reason = last.finish_reason
        record.ok = record.finish_reason in ("length", "stop")
        if not record.ok:
            record.error = f"finish_reason={record.finish_reason}"


class OpenAIBackend:
    """An OpenAI-compatible /v1/completions server (vLLM's), streamed as server-sent events.

    httpx does the HTTP; each `data:` line of the stream is one JSON event. Token-id prompts go
    as a list of ids; `ignore_eos` and `cache_salt` are vLLM's extensions.
    """

    name = "openai"

    def __init__(self, base_url: str, model: str):
        from urllib.parse import urlsplit

        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"--base-url must be http(s)://HOST[:PORT][/PATH], got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._http = None

    async def open(self) -> None:
        try:
            import httpx
        except ImportError:
            raise RuntimeError("the openai backend needs httpx: pip install -e '.[bench]'") from None
        # No pool limit: every request in flight holds its own streaming connection.
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=None,
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def stats(self) -> dict | None:
        """vLLM's prefix-cache counters from its /metrics, named like chunkwise's stats."""
        try:
            m = await asyncio.to_thread(scrape_prometheus, f"{self.base_url}/metrics")
        except OSError:
            return None
        out = {}
        for ours, theirs in (("prefix_cache_queries", "vllm:prefix_cache_queries_total"),
                             ("prefix_cache_hits", "vllm:prefix_cache_hits_total"),
                             ("preemptions", "vllm:num_preemptions_total"),
                             ("prompt_tokens", "vllm:prompt_tokens_total"),
                             ("generation_tokens", "vllm:generation_tokens_total")):
            if theirs in m:
                out[ours] = m[theirs]
        return out or None

    async def _post_stream(self, body: dict):
        async with self._http.stream("POST", "/v1/completions", json=body,
                                     headers={"Accept": "text/event-stream"}) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread())[:500]
                raise RuntimeError(f"HTTP {resp.status_code} {resp.reason_phrase}: {detail!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                yield json.loads(payload)

    async def send(self, req: BenchRequest, record: RequestRecord, *, cache_salt: str, timeout: float) -> None:
        if req.messages is not None:
            raise ValueError("the openai backend sends completions; use prompt or prompt_token_ids")
        body = {
            "model": self.model,
            "prompt": req.prompt_token_ids if req.prompt_token_ids is not None else req.prompt,
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if cache_salt:
            body["cache_salt"] = cache_salt
        timer = StreamTimer(record)
        usage = None

        async def consume():
            nonlocal usage
            async for event in self._post_stream(body):
                choices = event.get("choices") or []
                if choices:
                    c = choices[0]
                    n = len(c.get("token_ids") or []) or (1 if c.get("text") else 0)
                    timer.tokens(n)
                    if c.get("finish_reason"):
                        record.finish_reason = c["finish_reason"]
                if event.get("usage"):
                    usage = event["usage"]

        await asyncio.wait_for(consume(), timeout)
        timer.done()
        if usage:
            record.prompt_tokens = usage.get("prompt_tokens", 0)
            record.output_tokens = usage.get("completion_tokens", record.output_tokens)
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens = details.get("cached_tokens") or 0
        record.ok = record.finish_reason in ("length", "stop")
        if not record.ok:
            record.error = f"finish_reason={record.finish_reason}"
