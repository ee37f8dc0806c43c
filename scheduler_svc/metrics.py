"""Prometheus metrics of the scheduler, named in the style of vLLM's (`chunkwise:` prefix).

Counters and gauges are read from the scheduler core's `stats()` at scrape time by a collector,
so `/metrics` and the GetStats RPC can never disagree. Latency histograms (TTFT, TPOT, end to
end, step times) are observed by the step loop as events happen.
"""

from __future__ import annotations

import logging
from typing import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("chunkwise.scheduler.metrics")

# Buckets for request latencies (seconds): CPU decode steps are slow, so they reach further
# than a GPU server's would.
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _StatsCollector(Collector):
    def __init__(self, get_stats: Callable):
        self._get_stats = get_stats

    def collect(self):
        st = self._get_stats()
        if st is None:  # before the executor handshake
            return
        counters = (
            ("prefix_cache_queries", "Prompt tokens of each request's first admission looked up in the prefix "
             "cache, counted once the step that used the lookup ran (resumes after preemption or an executor "
             "restart excluded)", st.prefix_cache_queries),
            ("prefix_cache_hits", "Of prefix_cache_queries, prompt tokens whose KV was reused from the cache "
             "(never KV that was recomputed)", st.prefix_cache_hits),
            ("resumed_cached_tokens", "Tokens preempted requests got back from the prefix cache on resume "
             "(kept out of the hit rate)", st.resumed_cached_tokens),
            ("recomputed_tokens", "Positions computed again after a preemption or an executor restart",
             st.recomputed_tokens),
            ("prompt_tokens", "Prompt tokens computed by the executor (cached ones excluded)", st.prefill_tokens),
            ("generation_tokens", "Output tokens computed", st.decode_tokens),
            ("num_preemptions", "Requests preempted for KV space", st.preemptions),
            ("steps", "Engine steps executed", st.steps),
            ("prefix_holds", "Admissions put off a step because another request was computing the same "
             "prefix block (counted per request and step)", st.prefix_holds),
        )
        for name, doc, value in counters:
            c = CounterMetricFamily(f"chunkwise:{name}", doc)
            c.add_metric([], value)
            yield c
        finished = CounterMetricFamily(
            "chunkwise:request_success", "Finished requests by reason", labels=["finished_reason"]
        )
        for reason, n in sorted(st.requests_finished.items()):
            finished.add_metric([reason], n)
        yield finished
        for name, doc, value in (
            ("num_requests_running", "Requests in the running queue", st.num_running),
            ("num_requests_waiting", "Requests in the waiting queue", st.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)",
             st.kv_blocks_used / st.kv_blocks_total if st.kv_blocks_total else 0.0),
            ("prefix_cache_hit_rate", "Prefix cache hits over queries since start (0-1)",
             st.prefix_cache_hits / st.prefix_cache_queries if st.prefix_cache_queries else 0.0),
        ):
            g = GaugeMetricFamily(f"chunkwise:{name}", doc)
            g.add_metric([], value)
            yield g
        blocks = GaugeMetricFamily("chunkwise:kv_blocks", "KV blocks by state", labels=["state"])
        blocks.add_metric(["free"], st.kv_blocks_free)
        blocks.add_metric(["used"], st.kv_blocks_used)
        blocks.add_metric(["cached"], st.kv_blocks_cached)  # a subset of free: evictable prefixes
        blocks.add_metric(["total"], st.kv_blocks_total)
        yield blocks


class Metrics:
    def __init__(self, get_stats: Callable):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StatsCollector(get_stats))
        r = self.registry
        self.ttft = Histogram("chunkwise:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("chunkwise:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("chunkwise:e2e_request_latency_seconds", "Arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.step = Histogram("chunkwise:step_duration_seconds",
                              "One engine step as the scheduler sees it (plan, RPC, execute)",
                              buckets=_STEP_BUCKETS, registry=r)
        self.executor_step = Histogram("chunkwise:executor_step_duration_seconds",
                                       "Compute time of one step, as the executor reports it",
                                       buckets=_STEP_BUCKETS, registry=r)
        self._server: WSGIServer | None = None

    def observe_step(self, wall_seconds: float, executor_seconds: float) -> None:
        self.step.observe(wall_seconds)
        self.executor_step.observe(executor_seconds)

    def observe_finished(self, arrival: float, first_token: float | None, finished: float, num_tokens: int) -> None:
        self.e2e.observe(finished - arrival)
        if first_token is not None and num_tokens > 1:
            self.tpot.observe((finished - first_token) / (num_tokens - 1))

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint in a thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        bound = int(server.server_address[1])
        log.info("Prometheus metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
