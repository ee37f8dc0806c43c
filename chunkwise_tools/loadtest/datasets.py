"""Datasets of token-id (or text, or chat) prompts for the load tester."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass
class BenchRequest:
    """One request of a dataset. Exactly one of the three prompt fields is set."""

    max_tokens: int
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    group: int = -1  # prefix group or conversation, -1: none

    @property
    def prompt_len(self) -> int | None:
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else None


def _token_range(vocab_size: int) -> tuple[int, int]:
    """Ids to draw random tokens from: skip the lowest ids, where special tokens usually sit."""
    if vocab_size < 8:
        raise ValueError(f"vocab_size must be at least 8, got {vocab_size}")
    return min(100, vocab_size // 4), vocab_size - 1


def _lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in [mean * (1 - r), mean * (1 + r)], at least 1."""
    if range_ratio <= 0:
        return max(1, mean)
    lo, hi = int(mean * (1 - range_ratio)), int(math.ceil(mean * (1 + range_ratio)))
    return max(1, rng.randint(lo, hi))


def random_dataset(
    num_prompts: int,
    *,
    input_len: int = 637,
    output_len: int = 200,
    prefix_len: int = 180,
    num_prefix_groups: int = 8,
    range_ratio: float = 0.0,
    output_range_ratio: float = 0.0,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts of `input_len` tokens (on average) whose first `prefix_len` are shared in a group.

    Request i belongs to group i % num_prefix_groups, so the groups interleave in arrival order;
    with G groups the first G requests miss and the rest can hit prefix_len tokens (rounded down to
    whole KV blocks by the server): hit rate ~ (1 - G/N) * prefix_len / input_len.
    """
    if prefix_len > input_len:
        raise ValueError(f"prefix_len ({prefix_len}) must not exceed input_len ({input_len})")
    if num_prefix_groups < 1:
        raise ValueError("num_prefix_groups must be >= 1")
    rng = random.Random(seed)
    lo, hi = _token_range(vocab_size)
    prefixes = [[rng.randint(lo, hi) for _ in range(prefix_len)] for _ in range(num_prefix_groups)]
    out = []
    for i in range(num_prompts):
        group = i % num_prefix_groups
        n = max(_lengths(rng, input_len, range_ratio), prefix_len + 1)
        suffix = [rng.randint(lo, hi) for _ in range(n - prefix_len)]
        out.append(BenchRequest(_lengths(rng, output_len, output_range_ratio), prefixes[group] + suffix, group=group))
    return out


def multi_turn_dataset(
    num_conversations: int,
    *,
    turns: int = 4,
    system_len: int = 200,
    user_len: int = 60,
    answer_len: int = 60,
    output_len: int = 60,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[BenchRequest]:
    """Chat-shaped prompts: turn k = system + (user, assistant) * (k - 1) + user.

    The assistant messages are synthetic (random tokens standing for earlier answers), so the
    dataset is fixed before the run. Requests are ordered turn by turn across conversations
    (all first turns, then all second turns, ...); with a request rate or a concurrency cap that
    spaces them, a turn arrives after the previous turn of its conversation was computed, and its
    prompt's prefix is in the cache (sent all at once, most turns race their predecessors).
    """
    rng = random.Random(seed)
    lo, hi = _token_range(vocab_size)

    def tokens(n: int) -> list[int]:
        return [rng.randint(lo, hi) for _ in range(n)]

    conversations = []
    for _ in range(num_conversations):
        history = tokens(system_len)
        prompts = []
        for _ in range(turns):
            history = history + tokens(user_len)
            prompts.append(list(history))
            history = history + tokens(answer_len)
        conversations.append(prompts)
    return [
        BenchRequest(output_len, conversations[c][t], group=c)
        for t in range(turns)
        for c in range(num_conversations)
    ]


def jsonl_dataset(path: str | Path, *, default_output_len: int = 200, limit: int | None = None) -> list[BenchRequest]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            max_tokens = int(obj.get("max_tokens", obj.get("output_len", default_output_len)))
            given = [k for k in ("prompt", "prompt_token_ids", "messages") if k in obj]
            if len(given) != 1:
                raise ValueError(f"{path}:{lineno}: needs exactly one of prompt, prompt_token_ids, messages")
            req = BenchRequest(max_tokens, group=int(obj.get("group", -1)))
            setattr(req, given[0], obj[given[0]])
            out.append(req)
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def dataset_summary(requests: Sequence[BenchRequest]) -> dict:
    lens = [r.prompt_len for r in requests if r.prompt_len is not None]
    return {
        "num_requests": len(requests),
        "mean_prompt_len": sum(lens) / len(lens) if lens else None,
        "mean_max_tokens": sum(r.max_tokens for r in requests) / len(requests) if requests else None,
        "num_groups": len({r.group for r in requests if r.group >= 0}),
    }

