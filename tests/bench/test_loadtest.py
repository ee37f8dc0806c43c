"""The load-test tool: datasets, arrivals, metric math, result schema, backends.

Everything here is deterministic and needs no server except the last two tests, which run a
tiny bounded load against real stacks on the tiny random checkpoint. No test asserts on timing.
"""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from chunkwise_tools import loadtest as lt
from chunkwise_tools.loadtest.datasets import _token_range as token_range


# ---- datasets ----------------------------------------------------------------------------------


def test_random_dataset_shape_and_prefix_groups():
    reqs = lt.random_dataset(40, input_len=120, output_len=7, prefix_len=48, num_prefix_groups=4,
                             vocab_size=384, seed=3)
    assert len(reqs) == 40
    assert all(len(r.prompt_token_ids) == 120 and r.max_tokens == 7 for r in reqs)
    assert [r.group for r in reqs[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]  # groups interleave in arrival order
    lo, hi = token_range(384)
    assert all(lo <= t <= hi for r in reqs for t in r.prompt_token_ids)
    by_group = {}
    for r in reqs:
        by_group.setdefault(r.group, []).append(r.prompt_token_ids)
    prefixes = {g: ps[0][:48] for g, ps in by_group.items()}
    for g, ps in by_group.items():
        assert all(p[:48] == prefixes[g] for p in ps)
        assert len({tuple(p[48:]) for p in ps}) == len(ps)  # suffixes differ
    assert len({tuple(p) for p in prefixes.values()}) == 4
    # same seed, same dataset; another seed, another
    again = lt.random_dataset(40, input_len=120, output_len=7, prefix_len=48, num_prefix_groups=4,
                              vocab_size=384, seed=3)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    other = lt.random_dataset(40, input_len=120, output_len=7, prefix_len=48, num_prefix_groups=4,
                              vocab_size=384, seed=4)
    assert other[0].prompt_token_ids != reqs[0].prompt_token_ids


def test_random_dataset_default_is_the_seed_shape():
    reqs = lt.random_dataset(32, vocab_size=49152)
    s = lt.dataset_summary(reqs)
    assert s == {"num_requests": 32, "mean_prompt_len": 637.0, "mean_max_tokens": 200.0, "num_groups": 8}
    # the fraction of prompt tokens a perfect block-16 prefix cache can serve: ~20%, like the seed's
    hittable = (32 - 8) * (180 // 16 * 16) / (32 * 637)
    assert 0.18 < hittable < 0.23


def test_random_dataset_length_spread_and_errors():
    reqs = lt.random_dataset(200, input_len=100, prefix_len=10, range_ratio=0.5, output_len=20,
                             output_range_ratio=0.5, vocab_size=384, seed=0)
    lens = [len(r.prompt_token_ids) for r in reqs]
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 20
    assert all(10 <= r.max_tokens <= 30 for r in reqs)
    with pytest.raises(ValueError):
        lt.random_dataset(2, input_len=10, prefix_len=20)
    with pytest.raises(ValueError):
        lt.random_dataset(2, num_prefix_groups=0)


def test_multi_turn_dataset_repeats_the_previous_turn_as_prefix():
    reqs = lt.multi_turn_dataset(3, turns=4, system_len=20, user_len=5, answer_len=7, output_len=9,
                                 vocab_size=384, seed=1)
    assert len(reqs) == 12
    assert [r.group for r in reqs] == [0, 1, 2] * 4  # turn by turn across conversations
    for c in range(3):
        turns = [r.prompt_token_ids for r in reqs if r.group == c]
        assert [len(t) for t in turns] == [20 + 5 + k * 12 for k in range(4)]
        for prev, cur in zip(turns, turns[1:]):
            assert cur[: len(prev)] == prev
    assert reqs[0].prompt_token_ids[:20] != reqs[1].prompt_token_ids[:20]  # own system prompt each


def test_jsonl_dataset(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join([
        json.dumps({"prompt": "hello", "max_tokens": 3}),
        json.dumps({"prompt_token_ids": [5, 6, 7]}),
        "",
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "output_len": 4}),
    ]))
    reqs = lt.jsonl_dataset(p, default_output_len=11)
    assert [(r.prompt, r.prompt_token_ids, r.max_tokens) for r in reqs[:2]] == [("hello", None, 3), (None, [5, 6, 7], 11)]
    assert reqs[2].messages == [{"role": "user", "content": "hi"}] and reqs[2].max_tokens == 4
    assert len(lt.jsonl_dataset(p, limit=2)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "prompt_token_ids": [1]}))
    with pytest.raises(ValueError, match="exactly one"):
        lt.jsonl_dataset(bad)


# ---- arrivals ----------------------------------------------------------------------------------


def test_poisson_arrivals_counts():
    rate, n = 4.0, 20000
    t = lt.arrival_offsets(n, rate, seed=7)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    gaps = np.diff(t)
    assert abs(gaps.mean() - 1 / rate) < 0.02 / rate * 5  # ~1% standard error, 5 sigma
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential: coefficient of variation 1
    # counts per one-second window: Poisson, so mean ~= variance ~= rate
    counts = np.bincount(np.floor(t).astype(int))[:-1]
    assert abs(counts.mean() - rate) < 0.15
    assert abs(counts.var() / counts.mean() - 1) < 0.15
    assert lt.arrival_offsets(5, 4.0, seed=7) == t[:5]  # deterministic from the seed


def test_infinite_rate_and_bad_rate():
    assert lt.arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        lt.arrival_offsets(3, 0)


# ---- metric math -------------------------------------------------------------------------------


@pytest.mark.parametrize("q", [0, 1, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 101):
        xs = rng.exponential(size=n).tolist()
        assert lt.percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert math.isnan(lt.percentile([], 50))


def test_summarize():
    s = lt.summarize([1.0, 2.0, 3.0, 4.0])
    assert s["mean"] == 2.5 and s["median"] == 2.5 and s["min"] == 1 and s["max"] == 4
    assert s["p90"] == pytest.approx(3.7) and s["std"] == pytest.approx(np.std([1, 2, 3, 4]))
    assert all(v is None for v in lt.summarize([]).values())


def test_compute_metrics_by_the_definitions():
    # request 0: first token at 0.5 s, then 3 more in 2 chunks (gaps 0.2, 0.3); ends at 1.0 s
    r0 = lt.RequestRecord(0, ok=True, prompt_tokens=100, output_tokens=4, cached_tokens=32, ttft=0.5, e2el=1.0,
                          itl=[0.2, 0.3])
    r1 = lt.RequestRecord(1, ok=True, prompt_tokens=50, output_tokens=1, ttft=0.25, e2el=0.25)
    r2 = lt.RequestRecord(2, ok=False, error="boom", prompt_tokens=999)
    m = lt.compute_metrics([r0, r1, r2], duration=2.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 150 and m["total_output_tokens"] == 5
    assert m["request_throughput"] == 1.0 and m["input_throughput"] == 75 and m["output_throughput"] == 2.5
    assert m["total_token_throughput"] == 77.5
    assert m["client_cached_token_fraction"] == pytest.approx(32 / 150)
    assert m["ttft_ms"]["mean"] == pytest.approx(375) and m["e2el_ms"]["max"] == pytest.approx(1000)
    # TPOT = (e2e - ttft) / (tokens - 1), only for requests with at least 2 tokens
    assert m["tpot_ms"]["mean"] == pytest.approx(500 / 3) and m["tpot_ms"]["max"] == m["tpot_ms"]["min"]
    assert m["itl_ms"]["median"] == pytest.approx(250)  # pooled gaps


def test_stream_timer_counts_gaps_between_token_chunks():
    rec = lt.RequestRecord(0)
    t = lt.StreamTimer(rec)
    t.tokens(0)  # a chunk without tokens is not a token event
    assert rec.ttft is None
    t.tokens(1)
    t.tokens(2)
    t.tokens(1)
    t.done()
    assert rec.output_tokens == 4 and len(rec.itl) == 2 and rec.ttft is not None
    assert rec.e2el >= rec.ttft


def test_stats_delta_and_prometheus_parsing():
    d = lt.stats_delta(
        {"steps": 10, "prefix_cache_queries": 100, "prefix_cache_hits": 10, "executor_epoch": "a",
         "kv_blocks_total": 64, "block_size": 16, "num_running": 3, "requests_finished": {"stop": 2, "length": 1}},
        {"steps": 25, "prefix_cache_queries": 300, "prefix_cache_hits": 60, "executor_epoch": "a",
         "kv_blocks_total": 64, "block_size": 16, "num_running": 0, "requests_finished": {"stop": 5, "length": 1}},
    )
    # Counters as deltas; gauges (issue 17: kv_blocks_total and block_size came out as 0) as read.
    assert d == {"steps": 15, "prefix_cache_queries": 200, "prefix_cache_hits": 50, "prefix_cache_hit_rate": 0.25,
                 "executor_epoch": "a", "kv_blocks_total": 64, "block_size": 16, "num_running": 0,
                 "requests_finished": {"stop": 3, "length": 0}}
    assert lt.stats_delta(None, {}) is None
    text = (
        "# HELP x y\n# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 12.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 3.0\n'
        "chunkwise:step_duration_seconds_sum 4.5\n"
        "chunkwise:step_duration_seconds_count 9\n"
    )
    m = lt.parse_prometheus(text)
    assert m == {"vllm:prefix_cache_hits_total": 15.0, "chunkwise:step_duration_seconds_sum": 4.5,
                 "chunkwise:step_duration_seconds_count": 9.0}


def test_step_overhead():
    before = {"steps": 0, "step_seconds": 0.0, "executor_seconds": 0.0, "executor_cpu_seconds": 1.0}
    after = {"steps": 100, "step_seconds": 9.0, "executor_seconds": 8.0, "executor_cpu_seconds": 1.0 + 10.0 * 2 * 0.5}
    ov = lt.step_overhead(before, after, duration=10.0)
    assert ov["executor_idle_fraction"] == pytest.approx(0.2)
    assert ov["rpc_fraction"] == pytest.approx(0.1) and ov["outside_rpc_fraction"] == pytest.approx(0.1)
    assert ov["idle_ms_per_step"] == pytest.approx(20.0) and ov["executor_ms_per_step"] == pytest.approx(80.0)
    import os

    assert ov["executor_cpu_utilization"] == pytest.approx(10.0 / (10.0 * (os.cpu_count() or 1)))
    assert lt.step_overhead(None, after, 1.0) is None
    assert "executor_minor_faults" not in ov
    before |= {"executor_minor_faults": 500, "executor_system_seconds": 0.5}
    after |= {"executor_minor_faults": 2500, "executor_system_seconds": 2.0}
    ov = lt.step_overhead(before, after, duration=10.0)
    assert ov["executor_minor_faults"] == 2000 and ov["executor_system_seconds"] == pytest.approx(1.5)


def test_process_faults_and_system_seconds_read_this_process():
    import os
    import resource

    faults, system = lt.process_faults_and_system_seconds(os.getpid())
    mine = resource.getrusage(resource.RUSAGE_SELF)
    # /proc's count first, getrusage's just after it: the same counter, a few faults apart at most.
    assert 0.9 * mine.ru_minflt <= faults <= mine.ru_minflt
    assert 0 <= system <= mine.ru_stime + 0.02
    assert lt.process_faults_and_system_seconds(2**22 + 12345) is None  # no such process


def test_round_orders_rotate():
    assert lt.round_orders(["a", "b", "c"], 3, True) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert lt.round_orders(["a", "b"], 2, False) == [["a"], ["a"], ["b"], ["b"]]


def test_parse_config_and_loopback():
    c = lt.parse_config("CP+PC=--enable-chunked-prefill --max-num-batched-tokens 512 || --dtype bfloat16")
    assert c == lt.ServerConfig("CP+PC", ["--enable-chunked-prefill", "--max-num-batched-tokens", "512"],
                                ["--dtype", "bfloat16"])
    with pytest.raises(ValueError):
        lt.parse_config("no-equals-sign")
    for ok in ("127.0.0.1", "127.3.4.5", "localhost", "[::1]"):
        lt.check_loopback(ok)
    for bad in ("10.0.0.1", "192.168.1.2", "example.com", "8.8.8.8"):
        with pytest.raises(ValueError):
            lt.check_loopback(bad)


# ---- the run and its JSON, with a fake backend ---------------------------------------------------


class FakeBackend:
    """Streams max_tokens tokens one chunk each with no delay; request 3 fails."""

    name = "fake"

    def __init__(self):
        self.sent, self.salts, self.in_flight, self.max_in_flight, self.queries = [], set(), 0, 0, 0

    async def open(self):
        pass

    async def close(self):
        pass

    async def stats(self):
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.queries // 4, "steps": len(self.sent)}

    async def send(self, req, record, *, cache_salt, timeout):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            self.salts.add(cache_salt)
            self.sent.append(record.index)
            if record.index == 3:
                raise RuntimeError("injected failure")
            timer = lt.StreamTimer(record)
            for _ in range(req.max_tokens):
                await asyncio.sleep(0)
                timer.tokens(1)
            timer.done()
            record.prompt_tokens = len(req.prompt_token_ids)
            if record.index >= 0:
                self.queries += record.prompt_tokens
            record.finish_reason, record.ok = "length", True
        finally:
            self.in_flight -= 1


RESULT_KEYS = {
    "schema", "backend", "label", "request_rate", "max_concurrency", "seed", "cache_salt", "num_warmup",
    "duration_s", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "input_throughput", "output_throughput", "total_token_throughput", "client_cached_token_fraction",
    "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "server_stats", "step_overhead", "errors", "requests",
}


def test_run_load_result_schema_concurrency_cap_and_failure():
    reqs = lt.random_dataset(10, input_len=20, prefix_len=4, output_len=3, vocab_size=384, seed=0)
    backend = FakeBackend()
    res = asyncio.run(lt.run_load(backend, reqs, max_concurrency=2, warmup=lt.warmup_requests(2, 384, 0),
                                  cache_salt="s", label="x", progress=False))
    assert set(res) == RESULT_KEYS
    assert res["schema"] == lt.SCHEMA and res["request_rate"] == "inf"
    assert backend.max_in_flight <= 2
    assert res["completed"] == 9 and res["failed"] == 1
    assert any("injected failure" in e for e in res["errors"])
    assert res["total_input_tokens"] == 9 * 20 and res["total_output_tokens"] == 27
    assert res["server_stats"]["prefix_cache_queries"] == 9 * 20  # warm-up excluded by the delta
    assert backend.salts == {"s", "s:warmup"}
    for key in lt.METRIC_KEYS:
        assert set(res[key]) == set(lt.STAT_KEYS)
    assert len(res["requests"]) == 10 and {"ttft", "tpot", "e2el", "itl", "ok"} <= set(res["requests"][0])
    json.dumps(res)  # serialisable as is


def test_run_load_stops_sending_at_max_duration():
    reqs = lt.random_dataset(5, input_len=20, prefix_len=4, output_len=1, vocab_size=384)
    # arrivals at rate 0.5/s spread over ~10 s; a 0.05 s bound lets only the first one out
    res = asyncio.run(lt.run_load(FakeBackend(), reqs, request_rate=0.5, seed=1, max_duration=0.05,
                                  request_timeout=5, progress=False))
    assert res["completed"] == 1 and res["failed"] == 4
    assert res["errors"] == ["not sent: --max-duration reached"]


def test_summarize_runs_paired_ratios_and_table():
    def run(label, rnd, tput):
        m = lt.compute_metrics([lt.RequestRecord(0, ok=True, prompt_tokens=int(tput), output_tokens=0, ttft=0.1,
                                                 e2el=0.1)], duration=1.0)
        return {"label": label, "round": rnd, **m, "server_stats": None, "step_overhead": None}

    runs = [run("base", 0, 100), run("fast", 0, 150), run("base", 1, 50), run("fast", 1, 100)]
    s = lt.summarize_runs(runs, ["base", "fast"], "base")
    t = s["fast"]["total_token_throughput"]
    assert t["median"] == 125 and t["ratio_to_baseline"] == pytest.approx(125 / 75)
    assert t["paired_ratio"]["min"] == pytest.approx(1.5) and t["paired_ratio"]["max"] == pytest.approx(2.0)
    table = lt.format_table(s, ["base", "fast"], "base")
    assert "base (base)" in table and "1.750" in table


# ---- the openai backend against a fake SSE server on loopback -------------------------------------


def test_openai_backend_streams_chunked_sse():
    async def scenario():
        seen = {}

        async def handle(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int([h for h in head.decode().split("\r\n") if h.lower().startswith("content-length")][0]
                         .split(":")[1])
            seen["body"] = json.loads(await reader.readexactly(length))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            events = [{"choices": [{"text": "a", "finish_reason": None}]},
                      {"choices": [{"text": "b", "finish_reason": None}]},
                      {"choices": [{"text": "c", "finish_reason": "length"}]},
                      {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3,
                                                "prompt_tokens_details": {"cached_tokens": 2}}}]
            payload = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
            # split across chunk boundaries to exercise the reassembly
            for i in range(0, len(payload), 17):
                piece = payload[i : i + 17]
                writer.write(b"%x\r\n" % len(piece) + piece + b"\r\n")
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            backend = lt.OpenAIBackend(f"http://127.0.0.1:{port}", "m")
            rec = lt.RequestRecord(0)
            await backend.open()
            try:
                await backend.send(lt.BenchRequest(3, [1, 2, 3]), rec, cache_salt="salt", timeout=10)
            finally:
                await backend.close()
        return rec, seen["body"]

    rec, body = asyncio.run(scenario())
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 3 and body["stream"] is True
    assert body["ignore_eos"] is True and body["cache_salt"] == "salt"
    assert rec.ok and rec.output_tokens == 3 and rec.prompt_tokens == 3 and rec.cached_tokens == 2
    assert len(rec.itl) == 2 and rec.finish_reason == "length"


def test_openai_backend_reports_an_http_error_with_its_body():
    async def scenario():
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            body = b'{"error": "model m not found"}'
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            backend = lt.OpenAIBackend(f"http://127.0.0.1:{port}", "m")
            await backend.open()
            try:
                with pytest.raises(RuntimeError, match="HTTP 404.*model m not found"):
                    await backend.send(lt.BenchRequest(3, [1, 2, 3]), lt.RequestRecord(0), cache_salt="", timeout=10)
            finally:
                await backend.close()

    asyncio.run(scenario())


def test_openai_backend_refuses_a_base_url_it_cannot_use():
    with pytest.raises(ValueError, match="--base-url"):
        lt.OpenAIBackend("grpc://127.0.0.1:1", "m")


# ---- against real stacks on the tiny checkpoint -------------------------------------------------


@pytest.mark.e2e  # starts service processes
def test_cli_against_a_running_stack(tiny_llama_path, tmp_path):
    from chunkwise_tools.serve import start_stack

    stack = start_stack(str(tiny_llama_path), executor_args=["--dtype", "float32"],
                        scheduler_args=["--stats-interval", "0", "--max-model-len", "256"], timeout=180)
    try:
        out = tmp_path / "r.json"
        rc = lt.main(["--address", stack.address, "--model", str(tiny_llama_path), "--num-prompts", "8",
                      "--input-len", "64", "--prefix-len", "32", "--num-prefix-groups", "2", "--output-len", "4",
                      "--request-rate", "50", "--max-concurrency", "4", "--max-duration", "60",
                      "--request-timeout", "60", "--result-json", str(out), "--no-progress"])
        assert rc == 0
        res = json.loads(out.read_text())
        assert res["completed"] == 8 and res["failed"] == 0
        assert res["total_input_tokens"] == 8 * 64 and res["total_output_tokens"] == 8 * 4
        # 6 of 8 requests can reuse their group's 32-token (2-block) prefix
        assert res["server_stats"]["prefix_cache_hits"] == 6 * 32
        assert res["client_cached_token_fraction"] == pytest.approx(6 * 32 / (8 * 64))
        assert res["dataset"]["num_groups"] == 2
    finally:
        stack.stop()


@pytest.mark.e2e  # starts service processes
def test_compare_two_configs_on_real_stacks(tiny_llama_path, tmp_path):
    out = tmp_path / "cmp.json"
    rc = lt.main([
        "--model", str(tiny_llama_path), "--num-prompts", "6", "--input-len", "64", "--prefix-len", "32",
        "--num-prefix-groups", "1", "--output-len", "3", "--max-concurrency", "3", "--repeats", "2",
        "--max-duration", "60", "--request-timeout", "60", "--executor-arg=--dtype", "--executor-arg=float32",
        "--compare", "neither=--no-enable-chunked-prefill --no-enable-prefix-caching --max-model-len 128 "
                     "--max-num-batched-tokens 128",
        "CP+PC=--max-model-len 128 --max-num-batched-tokens 32",
        "--result-json", str(out), "--no-progress",
    ])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["schema"] == lt.COMPARE_SCHEMA and res["baseline"] == "neither"
    assert [(r["label"], r["round"]) for r in res["runs"]] == [
        ("neither", 0), ("CP+PC", 0), ("CP+PC", 1), ("neither", 1)]  # interleaved, rotated
    for r in res["runs"]:
        assert r["completed"] == 6 and r["failed"] == 0
        hits = r["server_stats"]["prefix_cache_hits"]
        # each run has its own salt: the second round finds nothing cached by the first
        assert hits == (5 * 32 if r["label"] == "CP+PC" else 0)
        ov = r["step_overhead"]
        assert ov["steps"] > 0 and 0 <= ov["executor_seconds"] <= r["duration_s"] * 1.05
    s = res["summary"]
    assert s["neither"]["total_token_throughput"]["paired_ratio"]["median"] == pytest.approx(1.0)
    assert s["CP+PC"]["prefix_cache_hit_rate"]["median"] == pytest.approx(5 * 32 / (6 * 64))
    assert "CP+PC" in res["table"]
