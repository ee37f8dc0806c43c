"""Hypothesis-generated requests against a live server: random values for every field (valid,
borderline and absurd), several at once, with random cancellation (breaking out of the stream,
an Abort by id, a short deadline).

For a bounded time (FUZZ_SECONDS, env CHUNKWISE_FUZZ_SECONDS): every call ends with OK,
INVALID_ARGUMENT or (only where a deadline was set) DEADLINE_EXCEEDED, and nothing else;
successful outputs are well-formed; afterwards neither process crashed, no block leaked, and a
normal request still equals the reference.
"""

from __future__ import annotations

import asyncio
import os
import time

import grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from chunkwise.v1 import generation_pb2 as gpb
from client import AsyncClient
from client.sdk import _chunk, _collect
from reliability_helpers import MAX_MODEL_LEN, assert_no_leak, wait_idle

FUZZ_SECONDS = float(os.environ.get("CHUNKWISE_FUZZ_SECONDS", "20"))
VOCAB = 384
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}

u32 = st.integers(0, 2**32 - 1)
f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
small_tokens = st.integers(0, VOCAB - 1)
short_text = st.text(min_size=1, max_size=40)


def maybe(strategy):
    return st.one_of(st.none(), strategy)


# Per field: (values a valid request may have, absurd ones). A "wild" request draws each field
# from either; a tame one only from the first, so most calls get past validation and exercise
# scheduling, cancellation and detokenization, while the wild ones exercise validation.
FIELDS = {
    "request_id": (st.one_of(st.just(""), st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=12)),
                   st.text(max_size=140)),
    "prompt": (
        st.one_of(
            st.tuples(st.just("token_ids"), st.lists(small_tokens, min_size=1, max_size=120)),
            st.tuples(st.just("text"), st.text(min_size=1, max_size=200)),
            st.tuples(st.just("messages"), st.lists(st.tuples(short_text, st.text(max_size=60)), min_size=1, max_size=3)),
        ),
        st.one_of(
            st.tuples(st.just("token_ids"), st.lists(st.one_of(small_tokens, u32), max_size=300)),
            st.tuples(st.just("text"), st.one_of(st.just(""), st.text(min_size=2000, max_size=3000))),
            st.tuples(st.just("messages"), st.just([])),
            st.tuples(st.just("none"), st.none()),
        ),
    ),
    "max_tokens": (maybe(st.integers(1, 40)), maybe(st.one_of(st.just(0), u32))),
    "temperature": (maybe(st.one_of(st.just(0.0), st.floats(0, 2, width=32))), maybe(f32)),
    "top_p": (maybe(st.floats(0.0625, 1, width=32)), maybe(f32)),
    "top_k": (maybe(st.integers(-1, 500)), maybe(st.integers(-(2**31), 2**31 - 1))),
    "min_p": (maybe(st.floats(0, 1, width=32)), maybe(f32)),
    "seed": (maybe(st.integers(0, 2**64 - 1)), maybe(st.integers(0, 2**64 - 1))),
    "logprobs": (maybe(st.integers(0, 20)), maybe(u32)),
    "stop": (st.lists(st.text(min_size=1, max_size=6), max_size=3), st.lists(st.text(max_size=300), max_size=20)),
    "stop_token_ids": (st.lists(small_tokens, max_size=5), st.lists(st.one_of(small_tokens, u32), max_size=70)),
    "ignore_eos": (st.booleans(), st.booleans()),
    "cache_salt": (st.one_of(st.just(""), st.text(max_size=10)), st.text(min_size=250, max_size=270)),
}


@st.composite
def requests(draw):
    wild = draw(st.sampled_from([False, False, True]))
    r = {name: draw(st.one_of(tame, absurd) if wild else tame) for name, (tame, absurd) in FIELDS.items()}
    r["action"] = draw(st.sampled_from(["read", "read", "break", "abort", "deadline"]))
    r["cancel_after"] = draw(st.integers(0, 5))
    return r


def to_proto(r: dict) -> gpb.GenerateRequest:
    msg = gpb.GenerateRequest(request_id=r["request_id"], cache_salt=r["cache_salt"])
    kind, value = r["prompt"]
    if kind == "token_ids":
        msg.token_ids.SetInParent()
        msg.token_ids.ids.extend(value)
    elif kind == "text":
        msg.text = value
    elif kind == "messages":
        msg.messages.SetInParent()
        for role, content in value:
            msg.messages.messages.add(role=role, content=content)
    s = msg.sampling
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs"):
        if r[name] is not None:
            setattr(s, name, r[name])
    s.stop.extend(r["stop"])
    s.stop_token_ids.extend(r["stop_token_ids"])
    s.ignore_eos = r["ignore_eos"]
    return msg


async def run_one(client: AsyncClient, r: dict) -> tuple[grpc.StatusCode, object]:
    """Send one fuzzed request through the SDK's stub; its final status and collected result."""
    msg = to_proto(r)
    timeout = 0.05 + 0.05 * r["cancel_after"] if r["action"] == "deadline" else 60
    call = client._stub.Generate(msg, metadata=client._metadata, timeout=timeout)
    chunks = []
    aborted = False
    try:
        async for resp in call:
            chunks.append(_chunk(resp))
            if len(chunks) > r["cancel_after"]:
                if r["action"] == "break":
                    call.cancel()
                    return grpc.StatusCode.OK, None
                if r["action"] == "abort" and not aborted:
                    aborted = True
                    await client.abort(chunks[0].request_id)
    except grpc.RpcError as e:
        return e.code(), e.details()
    except asyncio.CancelledError:  # our own call.cancel() surfacing
        return grpc.StatusCode.OK, None
    return grpc.StatusCode.OK, _collect(chunks)


def check_result(r: dict, result) -> None:
    if result is None:
        return
    assert result.finish_reason in ("stop", "length", "abort"), result
    assert all(0 <= t < VOCAB for t in result.token_ids)
    u = result.usage
    assert u.completion_tokens >= len(result.token_ids) or result.finish_reason == "abort"
    assert u.prompt_tokens + u.completion_tokens <= MAX_MODEL_LEN
    max_tokens = r["max_tokens"] if r["max_tokens"] is not None else 16
    assert len(result.token_ids) <= max_tokens
    assert 0 <= u.cached_prompt_tokens <= u.prompt_tokens


def test_fuzzed_requests_keep_the_server_healthy(shared, reference):
    loop = asyncio.new_event_loop()

    async def make_client():  # a grpc.aio channel belongs to the loop it was made in
        return AsyncClient(shared.address)

    client = loop.run_until_complete(make_client())
    stop_at = time.monotonic() + FUZZ_SECONDS
    seen = {"examples": 0, "statuses": {}}

    @settings(max_examples=400, deadline=None, database=None, derandomize=False,
              phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(requests(), min_size=1, max_size=6))
    def fuzz(batch):
        if time.monotonic() > stop_at:
            return  # time is up: the remaining examples pass without a call
        seen["examples"] += 1

        async def run_batch():
            return await asyncio.wait_for(asyncio.gather(*(run_one(client, r) for r in batch)), timeout=120)

        outcomes = loop.run_until_complete(run_batch())
        for r, (code, detail) in zip(batch, outcomes):
            seen["statuses"][code.name] = seen["statuses"].get(code.name, 0) + 1
            allowed = ALLOWED | ({grpc.StatusCode.DEADLINE_EXCEEDED} if r["action"] == "deadline" else set())
            assert code in allowed, f"{code.name}: {detail} for {r}"
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                assert ":" in detail, detail  # names a field
            else:
                check_result(r, detail if not isinstance(detail, str) else None)

    try:
        fuzz()
    finally:
        loop.run_until_complete(client.close())
        loop.close()
    print(f"fuzz: {seen['examples']} batches, statuses {seen['statuses']}")
    assert seen["examples"] > 0
    assert shared.executor.alive() and shared.scheduler.alive()
    with shared.client(timeout=60) as c:
        assert_no_leak(wait_idle(c, timeout=60))
        prompt = [5, 6, 7, 8, 9, 10, 11, 12]
        r = c.generate(prompt_token_ids=prompt, max_tokens=8, temperature=0)
        reference.check(prompt, 8, r.token_ids)
        assert_no_leak(wait_idle(c))

