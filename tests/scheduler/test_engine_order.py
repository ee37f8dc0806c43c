"""The step loop's order within a turn: the next plan is sent before a step's outputs reach the
streams, so the executor does not wait for the streams' writes (scheduler_svc/engine.py). The
engine runs in-process (_engine_harness.py)."""

from __future__ import annotations

import asyncio

import pytest

from ._engine_harness import serve_one

MAX_TOKENS = 6


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_next_plan_is_sent_before_outputs_are_streamed(async_scheduling):
    queue, tokens = asyncio.run(serve_one(MAX_TOKENS, async_scheduling=async_scheduling))
    assert len(tokens) == MAX_TOKENS
    # One request whose prompt fits one step: its k-th token comes from its k-th step. When that
    # token is handed to its stream, the plans of the steps in flight behind it (one more with
    # async scheduling: k+2 in all; k+1 without) must already have been sent, up to the step of its
    # last token (the core plans no step beyond max_tokens).
    in_flight = 2 if async_scheduling else 1
    puts = queue.plans_sent_at_put
    assert [k for k, _, _ in puts] == list(range(1, MAX_TOKENS + 1))
    for k, plans_sent, finish in puts:
        if finish is None:
            assert plans_sent >= min(k + in_flight, MAX_TOKENS), f"token {k} was streamed with only {plans_sent} plans sent"
