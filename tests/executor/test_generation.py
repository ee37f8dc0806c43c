"""Greedy continuations equal transformers' generate() token for token."""

from __future__ import annotations

import pytest
import torch

from model_fixtures import load_reference

from .helpers import Driver, make_runner, random_tokens

NEW_TOKENS = 32


def hf_generate(ref, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def assert_same_continuation(ours: list[int], theirs: list[int], eos: int = 2) -> None:
    # generate() stops at eos; the engine leaves stopping to the scheduler.
    assert len(theirs) == NEW_TOKENS or theirs[-1] == eos
    assert ours[: len(theirs)] == theirs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_32_tokens_match_generate(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch, tie_word_embeddings=(arch == "qwen2"))
    ref = load_reference(path)
    runner = make_runner(path, block_size=8, num_kv_blocks=64)
    d = Driver(runner, seed=5)
    prompts = {"p0": random_tokens(20, seed=60), "p1": random_tokens(9, seed=61), "p2": random_tokens(33, seed=62)}
    for rid, prompt in prompts.items():
        d.add(rid, list(prompt))
    # Chunked prefills of different sizes, staggered, then everyone decodes together.
    d.step({"p0": 7, "p2": 16})
    d.step({"p0": None, "p1": 4, "p2": 10})
    d.step({"p0": 1, "p1": None, "p2": None})
    while any(len(r.outputs) < NEW_TOKENS for r in d.reqs.values()):
        d.step({rid: 1 for rid, r in d.reqs.items() if len(r.outputs) < NEW_TOKENS})
    for rid, prompt in prompts.items():
        assert_same_continuation(d.reqs[rid].outputs[:NEW_TOKENS], hf_generate(ref, prompt))


def test_greedy_with_cached_prefix_matches_generate(tiny_llama_path):
    ref = load_reference(tiny_llama_path)
    runner = make_runner(tiny_llama_path, block_size=4, num_kv_blocks=96)
    d = Driver(runner, seed=6)
    system = random_tokens(24, seed=70)
    first = d.add("first", system + random_tokens(5, seed=71))
    d.step({"first": None})
    prompt = system + random_tokens(11, seed=72)
    second = d.add("second", list(prompt), cached_blocks=first.blocks[:6])
    while len(second.outputs) < NEW_TOKENS:
        work = {"second": 6 if d.remaining("second") > 6 else None}
        if len(first.outputs) < NEW_TOKENS:
            work["first"] = 1
        d.step(work)
    assert_same_continuation(second.outputs, hf_generate(ref, prompt))
