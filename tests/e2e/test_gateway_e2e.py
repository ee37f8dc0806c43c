"""SMG (the gateway) in front of two chunkwise replicas of the embedded model, over real processes:
OpenAI-compatible HTTP gives the same greedy text as the SDK's direct gRPC call, refuses what
chunkwise lacks with a 4xx naming the field, routes a conversation's turns to the replica that
holds their prefix (cache_aware, fed by the replicas' KV events), and a client that disconnects
frees its request's blocks."""

from __future__ import annotations

import json
import time

import pytest

from chunkwise_tools.gateway import smg_binary

pytestmark = [pytest.mark.e2e, pytest.mark.smollm,
              pytest.mark.skipif(smg_binary() is None, reason="SMG is not installed (pip install -e '.[gateway]')")]

httpx = pytest.importorskip("httpx")
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def deployment():
    from chunkwise.model_source import resolve_model
    from chunkwise_tools.gateway import start_gateway
    from chunkwise_tools.serve import start_stack

    model = resolve_model(None)
    flags = ["--stats-interval", "0", "--max-model-len", "1024"]
    stacks = []
    gateway = None
    try:
        for _ in range(2):
            stacks.append(start_stack(None, executor_args=["--dtype", "float32", "--num-kv-blocks", "256"],
                                      scheduler_args=flags, timeout=300))
        gateway = start_gateway([s.address for s in stacks], model, port=0, policy="cache_aware", timeout=180)
        yield gateway, stacks
    finally:
        if gateway is not None:
            gateway.stop()
        for s in stacks:
            s.stop()


@pytest.fixture(scope="module")
def http(deployment):
    gateway, _ = deployment
    with httpx.Client(base_url=gateway.url, timeout=120) as c:
        yield c


def _direct(stacks, **kw) -> str:
    from client import Client

    with Client(stacks[0].address, timeout=120) as c:
        return c.generate(temperature=0, **kw).text


def _sse_text(http, path: str, body: dict) -> tuple[str, str | None]:
    text, finish = [], None
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            for choice in json.loads(line[5:]).get("choices", []):
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                finish = choice.get("finish_reason") or finish
    return "".join(text), finish


def test_completions_equal_the_direct_call(deployment, http):
    gateway, stacks = deployment
    want = _direct(stacks, prompt=PROMPT, max_tokens=12)
    r = http.post("/v1/completions", json={"model": gateway.model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["text"] == want and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 12
    assert _sse_text(http, "/v1/completions",
                     {"model": gateway.model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}) == (want, "length")


def test_chat_completions_equal_the_direct_call(deployment, http):
    gateway, stacks = deployment
    want = _direct(stacks, messages=QUESTION, max_tokens=24)
    body = {"model": gateway.model, "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want
    assert _sse_text(http, "/v1/chat/completions", body)[0] == want


def test_the_openai_sdk_gets_the_direct_answers(deployment):
    # What a user's application would run, unchanged, against the gateway.
    openai = pytest.importorskip("openai")
    gateway, stacks = deployment
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    want_text = _direct(stacks, prompt=PROMPT, max_tokens=12)
    out = client.completions.create(model=gateway.model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == want_text
    streamed_text = client.completions.create(model=gateway.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].text for c in streamed_text if c.choices) == want_text
    want = _direct(stacks, messages=QUESTION, max_tokens=24)
    chat = client.chat.completions.create(model=gateway.model, messages=QUESTION, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == want
    streamed = client.chat.completions.create(model=gateway.model, messages=QUESTION, max_tokens=24,
                                              temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want
    with pytest.raises(openai.BadRequestError, match="sampling_params.n"):
        client.completions.create(model=gateway.model, prompt=PROMPT, max_tokens=4, n=2)


def test_stop_strings(deployment, http):
    gateway, stacks = deployment
    want = _direct(stacks, prompt=PROMPT, max_tokens=12, stop=["answer"])
    r = http.post("/v1/completions", json={"model": gateway.model, "prompt": PROMPT, "max_tokens": 12,
                                           "temperature": 0, "stop": ["answer"]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == want


@pytest.mark.parametrize("extra, field", [({"n": 2}, "sampling_params.n"),
                                          ({"frequency_penalty": 0.5}, "sampling_params.frequency_penalty")])
def test_unsupported_fields_are_a_4xx_naming_the_field(deployment, http, extra, field):
    gateway, _ = deployment
    r = http.post("/v1/completions", json={"model": gateway.model, "prompt": PROMPT, "max_tokens": 4, **extra})
    assert 400 <= r.status_code < 500, r.text
    assert field in r.text


def _stats(stacks):
    from client import Client

    out = []
    for s in stacks:
        with Client(s.address, timeout=30) as c:
            out.append(c.stats())
    return out


def test_cache_aware_routes_a_conversation_to_the_replica_holding_it(deployment, http):
    gateway, stacks = deployment
    system = {"role": "system", "content": "You are a geography tutor. " * 30}  # a few hundred tokens
    turn1 = [system, {"role": "user", "content": "Name a river in France."}]
    from chunkwise_tools.loadtest import scrape_prometheus

    before = _stats(stacks)
    events_before = scrape_prometheus(gateway.metrics_url).get("smg_kv_event_blocks_total", 0)
    r1 = http.post("/v1/chat/completions", json={"model": gateway.model, "messages": turn1, "max_tokens": 8,
                                                 "temperature": 0})
    answer = r1.json()["choices"][0]["message"]["content"]
    mid = _stats(stacks)
    first = [m["prefix_cache_queries"] - b["prefix_cache_queries"] for m, b in zip(mid, before)]
    assert sorted(first)[0] == 0 and sorted(first)[1] > 0  # one replica computed turn 1
    holder = first.index(max(first))
    # The replica's KV events (the blocks turn 1 stored) reach the gateway: waited for, not slept on.
    deadline = time.monotonic() + 30
    while scrape_prometheus(gateway.metrics_url).get("smg_kv_event_blocks_total", 0) <= events_before:
        assert time.monotonic() < deadline, "the gateway received no KV events for turn 1"
        time.sleep(0.05)
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And one in Spain?"}]
    r2 = http.post("/v1/chat/completions", json={"model": gateway.model, "messages": turn2, "max_tokens": 8,
                                                 "temperature": 0})
    assert r2.status_code == 200, r2.text
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    after = _stats(stacks)
    hits = [a["prefix_cache_hits"] - m["prefix_cache_hits"] for a, m in zip(after, mid)]
    assert hits[holder] > 0 and hits[1 - holder] == 0
    # The gateway took the replicas' KV event streams in: the blocks turn 1 stored reached SMG's
    # KV index (its own metrics: blocks received in events, and blocks its index holds).
    metrics = scrape_prometheus(gateway.metrics_url)
    assert metrics.get("smg_kv_event_blocks_total", 0) > 0, metrics
    assert metrics.get("smg_kv_index_blocks", 0) > 0, metrics


def _aborted(stats) -> int:
    return sum(s["requests_finished"].get("abort", 0) for s in stats)


def test_a_client_that_disconnects_aborts_its_request_and_frees_its_blocks(deployment, http):
    gateway, stacks = deployment
    body = {"model": gateway.model, "prompt": PROMPT, "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    aborted_before = _aborted(_stats(stacks))
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # it is running
    deadline = time.monotonic() + 30
    while True:
        stats = _stats(stacks)
        if all(s["num_running"] == 0 and s["kv_blocks_used"] == 0 for s in stats):
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    # Ended by the disconnect (an abort), not by running its 900 tokens to the end.
    assert _aborted(stats) == aborted_before + 1, stats
