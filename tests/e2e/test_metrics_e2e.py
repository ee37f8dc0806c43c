"""The Prometheus endpoint is real and agrees with the GetStats RPC after traffic."""

from __future__ import annotations

import random
import socket
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from client import Client
from e2e_helpers import running_stack


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_match_stats_after_traffic(tiny_llama_dir):
    port = _free_port()
    rng = random.Random(11)
    prefix = [rng.randrange(3, 384) for _ in range(40)]
    flags = ["--block-size", "16", "--max-num-batched-tokens", "64", "--max-model-len", "256",
             "--metrics-port", str(port)]
    with running_stack(tiny_llama_dir, ["--num-kv-blocks", "64"], flags) as stack:
        with Client(stack.address) as c:
            for i in range(4):
                c.generate(prompt_token_ids=prefix + [rng.randrange(3, 384) for _ in range(10 + i)],
                           max_tokens=5, temperature=0, ignore_eos=True)
            # The engine may still run a step after the last stream ends (it flushes the
            # executor's state of finished requests), so compare a scrape taken between two
            # identical stats snapshots.
            for _ in range(100):
                st = c.stats()
                m = _scrape(port)
                if c.stats() == st:
                    break
                time.sleep(0.05)

    def value(name, **labels):
        return m[(name, tuple(sorted(labels.items())))]

    assert value("chunkwise:prefix_cache_queries_total") == st["prefix_cache_queries"]
    assert value("chunkwise:prefix_cache_hits_total") == st["prefix_cache_hits"] > 0
    assert value("chunkwise:prompt_tokens_total") == st["prefill_tokens"]
    assert value("chunkwise:generation_tokens_total") == st["decode_tokens"]
    assert value("chunkwise:steps_total") == st["steps"]
    assert value("chunkwise:request_success_total", finished_reason="length") == 4
    assert value("chunkwise:num_requests_running") == 0
    assert value("chunkwise:kv_blocks", state="used") == st["kv_blocks_used"] == 0
    assert value("chunkwise:kv_blocks", state="cached") == st["kv_blocks_cached"] > 0
    assert value("chunkwise:kv_blocks", state="total") == st["kv_blocks_total"] == 64
    assert value("chunkwise:time_to_first_token_seconds_count") == 4
    assert value("chunkwise:e2e_request_latency_seconds_count") == 4
    assert value("chunkwise:time_per_output_token_seconds_count") == 4
    assert value("chunkwise:step_duration_seconds_count") == st["steps"]
    assert value("chunkwise:executor_step_duration_seconds_sum") > 0
