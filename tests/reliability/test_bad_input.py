"""Every class of bad input gets a clear status naming the field, and the server keeps serving:
after each one a normal request still equals transformers' greedy output and no block is held.

Status decisions: a field that is wrong is INVALID_ARGUMENT with the field's name first in the
message ("sampling.top_p: must be in (0, 1], got 1.5"). A message over the server's receive limit
(16 MiB) is refused by grpc itself before any of our code sees it, with RESOURCE_EXHAUSTED; one
under the limit that is still too long for the model is INVALID_ARGUMENT like any other field.
Bytes that are not a valid message at all are INVALID_ARGUMENT too ("request: ...").
"""

from __future__ import annotations

import math
import random

import grpc
import pytest

from chunkwise.v1 import generation_pb2 as gpb
from client import ChunkwiseError
from client.sdk import build_request
from reliability_helpers import MAX_MODEL_LEN, paused, wait_idle

INVALID = grpc.StatusCode.INVALID_ARGUMENT
VOCAB = 384
OK_PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]

# (id, request kwargs for client.sdk.build_request, expected field named in the message)
CASES = [
    ("empty-text", dict(prompt=""), "prompt.text"),
    ("empty-token-ids", dict(prompt_token_ids=[]), "prompt.token_ids"),
    ("empty-messages", dict(messages=[]), "prompt.messages"),
    ("prompt-plus-max-tokens-over-max-model-len", dict(prompt_token_ids=[5] * 200, max_tokens=100),
     "sampling.max_tokens"),
    ("prompt-alone-fills-max-model-len", dict(prompt_token_ids=[5] * MAX_MODEL_LEN), "prompt.token_ids"),
    ("million-token-prompt", dict(prompt_token_ids=[5] * 1_000_000), "prompt.token_ids"),
    ("text-far-too-long", dict(prompt="word " * 10_000), "prompt.text"),
    ("token-id-at-vocab-size", dict(prompt_token_ids=[5, VOCAB, 6]), "prompt.token_ids"),
    ("token-id-max-uint32", dict(prompt_token_ids=[2**32 - 1]), "prompt.token_ids"),
    ("max-tokens-zero", dict(prompt_token_ids=OK_PROMPT, max_tokens=0), "sampling.max_tokens"),
    ("temperature-negative", dict(prompt_token_ids=OK_PROMPT, temperature=-0.5), "sampling.temperature"),
    ("temperature-nan", dict(prompt_token_ids=OK_PROMPT, temperature=math.nan), "sampling.temperature"),
    ("temperature-inf", dict(prompt_token_ids=OK_PROMPT, temperature=math.inf), "sampling.temperature"),
    ("temperature-minus-inf", dict(prompt_token_ids=OK_PROMPT, temperature=-math.inf), "sampling.temperature"),
    ("top-p-zero", dict(prompt_token_ids=OK_PROMPT, top_p=0.0), "sampling.top_p"),
    ("top-p-above-one", dict(prompt_token_ids=OK_PROMPT, top_p=1.5), "sampling.top_p"),
    ("top-p-nan", dict(prompt_token_ids=OK_PROMPT, top_p=math.nan), "sampling.top_p"),
    ("top-k-minus-two", dict(prompt_token_ids=OK_PROMPT, top_k=-2), "sampling.top_k"),
    ("min-p-above-one", dict(prompt_token_ids=OK_PROMPT, min_p=1.5), "sampling.min_p"),
    ("logprobs-too-many", dict(prompt_token_ids=OK_PROMPT, logprobs=21), "sampling.logprobs"),
    ("stop-strings-too-many", dict(prompt_token_ids=OK_PROMPT, stop=[f"s{i}" for i in range(17)]), "sampling.stop"),
    ("stop-string-too-long", dict(prompt_token_ids=OK_PROMPT, stop=["x" * 257]), "sampling.stop"),
    ("stop-string-empty", dict(prompt_token_ids=OK_PROMPT, stop=[""]), "sampling.stop"),
    ("stop-token-ids-too-many", dict(prompt_token_ids=OK_PROMPT, stop_token_ids=list(range(65))),
     "sampling.stop_token_ids"),
    ("stop-token-id-outside-vocab", dict(prompt_token_ids=OK_PROMPT, stop_token_ids=[VOCAB]),
     "sampling.stop_token_ids"),
    ("request-id-too-long", dict(prompt_token_ids=OK_PROMPT, request_id="r" * 129), "request_id"),
    ("request-id-not-printable", dict(prompt_token_ids=OK_PROMPT, request_id="a\nb"), "request_id"),
    ("cache-salt-too-long", dict(prompt_token_ids=OK_PROMPT, cache_salt="s" * 257), "cache_salt"),
]

# Raw request bytes, sent past the SDK (which could not produce them).
RAW_CASES = [
    ("truncated-message", b"\x1a\xff"),  # field 3 (token_ids), length varint cut short
    ("invalid-utf8-text", b"\x12\x02\xff\xfe"),  # field 2 (text) = bytes that are not UTF-8
]


def expect_error(fn, code: grpc.StatusCode, needle: str) -> ChunkwiseError:
    with pytest.raises(ChunkwiseError) as info:
        fn()
    err = info.value
    assert err.code == code, f"expected {code.name}, got {err}"
    assert needle in err.message, f"{needle!r} not named in {err.message!r}"
    return err


def still_serving(shared, reference) -> None:
    """A normal greedy request matches transformers, and the server holds no block."""
    with shared.client(timeout=60) as c:
        r = c.generate(prompt_token_ids=OK_PROMPT, max_tokens=8, temperature=0)
        reference.check(OK_PROMPT, 8, r.token_ids)
        wait_idle(c)


@pytest.mark.parametrize("kwargs,field", [pytest.param(kw, f, id=i) for i, kw, f in CASES])
def test_bad_request_names_the_field(shared, reference, kwargs, field):
    with shared.client(timeout=60) as c:
        err = expect_error(lambda: c.generate(**kwargs), INVALID, field)
        assert err.message.startswith(field + ":"), err.message
    still_serving(shared, reference)


@pytest.mark.parametrize("raw", [pytest.param(b, id=i) for i, b in RAW_CASES])
def test_malformed_bytes_are_invalid_argument(shared, reference, raw):
    with grpc.insecure_channel(shared.address) as ch:
        generate = ch.unary_stream("/chunkwise.v1.Generation/Generate", request_serializer=None,
                                   response_deserializer=gpb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            list(generate(raw, timeout=30))
    assert info.value.code() == INVALID, info.value
    assert info.value.details().startswith("request:"), info.value.details()
    still_serving(shared, reference)


def test_oversized_message_is_resource_exhausted(shared, reference):
    # 17 MiB of text: over the 16 MiB receive limit, so grpc refuses it before parsing.
    with shared.client(timeout=60) as c:
        expect_error(lambda: c.generate(prompt="a" * (17 * 1024 * 1024)), grpc.StatusCode.RESOURCE_EXHAUSTED, "")
    still_serving(shared, reference)


def test_abort_without_id_is_invalid(shared, reference):
    with shared.client(timeout=60) as c:
        expect_error(lambda: c.abort(""), INVALID, "request_id")
        assert c.abort("no-such-request") is False
    still_serving(shared, reference)


def test_duplicate_id_of_a_live_request(shared, reference):
    # A prompt whose greedy continuation runs 200 tokens without EOS, so the request cannot finish
    # between its first token and the pause even on a loaded machine.
    rng = random.Random(16)
    prompt = [rng.randrange(3, VOCAB) for _ in range(40)]
    with shared.client(timeout=60) as a, shared.client(timeout=60) as b:
        stream = a.stream(prompt_token_ids=prompt, max_tokens=200, temperature=0, request_id="dup-1")
        got = list(next(stream).token_ids)
        # With the executor stopped the first request cannot finish, so it is certainly live.
        with paused(shared.executor):
            expect_error(lambda: b.generate(prompt_token_ids=OK_PROMPT, request_id="dup-1"), INVALID, "request_id")
        for chunk in stream:
            got += chunk.token_ids
        # The refused duplicate did not disturb the original.
        reference.check(prompt, 200, got)
        # Once it has finished, the id is free again.
        r = b.generate(prompt_token_ids=OK_PROMPT, max_tokens=8, temperature=0, request_id="dup-1")
        reference.check(OK_PROMPT, 8, r.token_ids)
    still_serving(shared, reference)


def test_text_prompts_still_work(shared):
    """The tokenizer paths that the bad-text cases went through also serve good text."""
    with shared.client(timeout=60) as c:
        r = c.generate(prompt="hello world", max_tokens=6, temperature=0)
        assert r.usage.prompt_tokens > 0 and r.finish_reason in ("length", "stop")
        m = c.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
        assert m.usage.prompt_tokens > 0
        wait_idle(c)


def test_build_request_sends_empty_token_ids_as_a_prompt():
    # The SDK marks an empty id list as a token-ids prompt, so the server can say which is empty.
    assert build_request(prompt_token_ids=[]).WhichOneof("prompt") == "token_ids"


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"top_k": 2**40}, "top_k"),
    ({"temperature": "hot"}, "temperature"),
    ({"prompt_token_ids": [1, -2, 3]}, "prompt_token_ids"),
    ({"stop_token_ids": [-5]}, "stop_token_ids"),
    ({"logprobs": -1}, "logprobs"),
])
def test_sdk_refuses_values_the_wire_cannot_hold_as_invalid_argument(kwargs, field):
    # Issue 17: these raised protobuf's ValueError/TypeError from the SDK, not ChunkwiseError.
    args = {"prompt_token_ids": [1, 2, 3]} | kwargs
    with pytest.raises(ChunkwiseError) as info:
        build_request(**args)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith(f"{field}:"), info.value.message
