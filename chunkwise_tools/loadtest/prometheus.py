"""Prometheus text endpoints (chunkwise's and vLLM's), read with prometheus_client's parser."""

from __future__ import annotations

from urllib.request import urlopen

from prometheus_client.parser import text_string_to_metric_families


def scrape_prometheus(url: str, timeout: float = 5.0) -> dict[str, float]:
    """A Prometheus text endpoint's samples (name -> value, label sets summed)."""
    with urlopen(url, timeout=timeout) as resp:  # noqa: S310 (a loopback URL we built)
        text = resp.read().decode()
    return parse_prometheus(text)


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format -> {sample name: value}, summing a sample's label sets.

    Sample names are as exposed (a counter's `_total`, a histogram's `_sum`/`_count`/`_bucket`),
    which is what the callers look up."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out
