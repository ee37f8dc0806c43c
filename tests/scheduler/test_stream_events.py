"""Fewer, larger stream messages: a stream's events reach its handler merged when several are queued
(RequestStream.next_event: nothing lost, an error on its own), and --stream-interval N sends the
first token at once, then every N tokens."""

from __future__ import annotations

import asyncio

import pytest

from chunkwise.plan import SampledToken
from scheduler_svc.config import ServiceConfig
from scheduler_svc.engine import EngineError, ErrorKind, RequestStream, StreamEvent

from ._engine_harness import serve_one


def _event(token: int, n: int, finish: str | None = None) -> StreamEvent:
    return StreamEvent(token_ids=[token], text=f"<{token}>", logprobs=[SampledToken("r", token, -0.5 * token)],
                       finish_reason=finish, prompt_tokens=9, completion_tokens=n, cached_prompt_tokens=4)


def _drain(events: list[StreamEvent], reads: int) -> list[StreamEvent]:
    async def go():
        stream = RequestStream("r", asyncio.Queue(), None, True)
        for e in events:
            stream.queue.put_nowait(e)
        # A bounded wait: an event lost by the merging must fail the test, not hang it.
        return [await asyncio.wait_for(stream.next_event(), timeout=5) for _ in range(reads)]

    return asyncio.run(go())


def test_queued_events_merge_into_one():
    (merged,) = _drain([_event(5, 1), _event(6, 2), _event(7, 3)], 1)
    assert merged.token_ids == [5, 6, 7] and merged.text == "<5><6><7>"
    assert [lp.token_id for lp in merged.logprobs] == [5, 6, 7]
    assert (merged.completion_tokens, merged.prompt_tokens, merged.cached_prompt_tokens) == (3, 9, 4)
    assert merged.finish_reason is None


def test_merging_stops_at_the_last_event():
    first, second = _drain([_event(5, 1), _event(6, 2, "length"), _event(99, 3)], 2)
    assert first.token_ids == [5, 6] and first.finish_reason == "length"
    assert second.token_ids == [99]  # after a finish (never sent in practice): not folded in


def test_an_error_comes_on_its_own_after_what_came_before():
    error = StreamEvent(error=EngineError(ErrorKind.INTERNAL, "boom"))
    first, second = _drain([_event(5, 1), _event(6, 2), error, _event(7, 3)], 2)
    assert first.token_ids == [5, 6] and first.error is None
    assert second is error


def test_one_event_is_passed_through():
    (only,) = _drain([_event(5, 1)], 1)
    assert only.token_ids == [5] and only.completion_tokens == 1


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_stream_interval_sends_the_first_token_then_every_n(async_scheduling):
    baseline, tokens = asyncio.run(serve_one(10, async_scheduling=async_scheduling))
    queue, interval_tokens = asyncio.run(serve_one(10, async_scheduling=async_scheduling, stream_interval=4))
    assert interval_tokens == tokens and len(tokens) == 10  # the same tokens, in fewer messages
    assert [len(e.token_ids) for e in baseline.events] == [1] * 10
    assert [len(e.token_ids) for e in queue.events] == [1, 4, 4, 1]
    assert [e.completion_tokens for e in queue.events] == [1, 5, 9, 10]
    assert [e.finish_reason for e in queue.events] == [None, None, None, "length"]


def test_stream_interval_is_validated():
    with pytest.raises(ValueError, match="--stream-interval must be in"):
        ServiceConfig(token="t", stream_interval=0).validate()
    assert ServiceConfig.from_args(["--token", "t", "--stream-interval", "8"]).stream_interval == 8
