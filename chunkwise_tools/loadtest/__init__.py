"""Load-test a serving endpoint: `python -m chunkwise_tools.loadtest` (also `chunkwise bench`).

    # 100 prompts of the seed's shape at 2 requests/s (Poisson) against a running scheduler
    python -m chunkwise_tools.loadtest --address 127.0.0.1:50051 --num-prompts 100 --request-rate 2

    # closed loop, at most 8 in flight, multi-turn chat prompts, result JSON and plots
    python -m chunkwise_tools.loadtest --dataset multi-turn --max-concurrency 8 --result-json out.json --plot-dir plots

    # start each server config in turn on the same dataset and seed, print one table with ratios
    python -m chunkwise_tools.loadtest --compare \\
        "neither=--no-enable-chunked-prefill --no-enable-prefix-caching" \\
        "CP+PC=--enable-chunked-prefill --enable-prefix-caching" --repeats 2

Datasets (token ids, so any checkpoint works, tokenizer or not):
- `random`: each prompt is a shared prefix of its group followed by random tokens; the default is
  the seed's shape (637 prompt tokens, ~180 of them a prefix shared within a group, 200 output).
- `multi-turn`: conversations; turn k's prompt is the system prompt and every earlier user and
  assistant message plus a new user message, so it repeats turn k-1's prompt as its prefix.
- `jsonl`: one JSON object a line with `prompt` (text), `prompt_token_ids` or `messages`, and
  optionally `max_tokens` (or `output_len`).

Metrics follow vLLM's benchmark_serving definitions: TTFT is send to first token; TPOT is
(e2e - TTFT) / (output tokens - 1) per request; ITL is every gap between two successive streamed
chunks that carry tokens, pooled over requests; e2e is send to the last chunk. Throughputs divide
by the measured duration (first send to last completion, warm-up excluded). Percentiles
interpolate linearly between order statistics (numpy's default).

Only loopback targets are accepted unless --allow-remote is given; every run is bounded by
--num-prompts and --max-duration and stops by itself.

One concern a module: `datasets` (the prompts), `run` (arrivals, warm-up, one bounded run),
`metrics` (per-request records, vLLM's metric definitions, server counters), `backends`
(chunkwise's gRPC API through the SDK; OpenAI-compatible HTTP through httpx), `prometheus`
(scraping a /metrics endpoint with prometheus_client's parser), `compare` (a stack per server
config, interleaved rounds, paired ratios), `plots`, and `cli`.
"""

from chunkwise_tools.loadtest.backends import ChunkwiseBackend, OpenAIBackend, check_loopback
from chunkwise_tools.loadtest.compare import (
    COMPARE_SCHEMA,
    ManagedStack,
    ServerConfig,
    format_table,
    parse_config,
    round_orders,
    run_compare,
    summarize_runs,
)
from chunkwise_tools.loadtest.datasets import (
    BenchRequest,
    dataset_summary,
    jsonl_dataset,
    multi_turn_dataset,
    random_dataset,
)
from chunkwise_tools.loadtest.metrics import (
    COUNTER_FIELDS,
    METRIC_KEYS,
    STAT_KEYS,
    RequestRecord,
    StreamTimer,
    compute_metrics,
    percentile,
    process_cpu_seconds,
    process_faults_and_system_seconds,
    spread,
    stats_delta,
    step_overhead,
    summarize,
)
from chunkwise_tools.loadtest.plots import write_plots
from chunkwise_tools.loadtest.prometheus import parse_prometheus, scrape_prometheus
from chunkwise_tools.loadtest.run import MAX_PROMPTS, SCHEMA, arrival_offsets, run_load, warmup_requests
from chunkwise_tools.loadtest.cli import build_parser, main, model_vocab_size  # noqa: I001 (cli imports the rest)

__all__ = [
    "COMPARE_SCHEMA", "COUNTER_FIELDS", "MAX_PROMPTS", "METRIC_KEYS", "SCHEMA", "STAT_KEYS", "BenchRequest",
    "ChunkwiseBackend", "ManagedStack", "OpenAIBackend", "RequestRecord", "ServerConfig", "StreamTimer",
    "arrival_offsets", "build_parser", "check_loopback", "compute_metrics", "dataset_summary", "format_table",
    "jsonl_dataset", "main", "model_vocab_size", "multi_turn_dataset", "parse_config", "parse_prometheus", "percentile",
    "process_cpu_seconds", "process_faults_and_system_seconds", "random_dataset", "round_orders", "run_compare",
    "run_load", "scrape_prometheus", "spread", "stats_delta", "step_overhead", "summarize", "summarize_runs",
    "warmup_requests", "write_plots",
]
