"""End to end on the embedded default model (SmolLM2-135M-Instruct): text in, text out, compared
with transformers on the same converted checkpoint. Slower than the tiny-model tests; deselect
with -m 'not smollm'."""

from __future__ import annotations

import math

import pytest

from client import ChunkwiseError, Client
from e2e_helpers import Reference, running_stack

pytestmark = pytest.mark.smollm

BUDGET = 128


@pytest.fixture(scope="module")
def smollm_dir():
    from chunkwise.model_source import resolve_model

    try:
        return resolve_model(None)
    except FileNotFoundError as e:  # the package is installed by scripts/setup.sh
        pytest.fail(f"embedded model missing: {e}")


@pytest.fixture(scope="module")
def smollm_ref(smollm_dir):
    return Reference(smollm_dir)


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    from chunkwise.model_source import load_tokenizer

    return load_tokenizer(smollm_dir)


@pytest.fixture(scope="module")
def stack(smollm_dir):
    flags = ["--block-size", "16", "--max-num-batched-tokens", str(BUDGET), "--max-model-len", "2048"]
    with running_stack(smollm_dir, ["--num-kv-blocks", "512"], flags) as s:
        yield s


def test_capital_of_france(stack, smollm_ref, tokenizer):
    prompt = "The capital of France is"
    with Client(stack.address) as c:
        r = c.generate(prompt=prompt, max_tokens=8, temperature=0)
    assert r.text.startswith(" Paris"), r.text
    ids = tokenizer(prompt).input_ids
    smollm_ref.check(ids, 8, r.token_ids)
    assert r.text == tokenizer.decode(r.token_ids, skip_special_tokens=True)
    # The default CPU stack ran it through the compiled paged decode kernel and compiled
    # element-wise ops, and says so in GetStats (prefill through SDPA: this stack runs float32).
    with Client(stack.address) as c:
        st = c.stats()
    assert (st["attention_backend"], st["decode_attention"], st["prefill_attention"], st["layer_ops"]) == \
        ("torch", "paged-inductor", "sdpa", "compiled"), st


def test_chat_messages_use_the_template(stack, smollm_ref, tokenizer):
    from chunkwise.model_source import apply_chat_template

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with Client(stack.address) as c:
        r = c.generate(messages=messages, max_tokens=24, temperature=0)
    ids = apply_chat_template(tokenizer, messages)
    assert r.usage.prompt_tokens == len(ids)
    smollm_ref.check(ids, 24, r.token_ids)
    assert "Paris" in r.text
    assert r.finish_reason in ("stop", "length")


def test_long_prompt_chunked_and_cached_matches_transformers(stack, smollm_ref, tokenizer):
    text = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(60))
    ids = tokenizer(text).input_ids
    assert len(ids) > 3 * BUDGET  # several chunks
    with Client(stack.address) as c:
        first = c.generate(prompt_token_ids=ids, max_tokens=12, temperature=0)
        again = c.generate(prompt_token_ids=ids, max_tokens=12, temperature=0)
    smollm_ref.check(ids, 12, first.token_ids)
    assert again.token_ids == first.token_ids
    assert again.usage.cached_prompt_tokens == (len(ids) - 1 if len(ids) % 16 == 0 else len(ids) // 16 * 16)


def test_logprobs_match_transformers(stack, smollm_ref, tokenizer):
    import torch

    ids = tokenizer("The quick brown fox jumps over the").input_ids
    with Client(stack.address) as c:
        r = c.generate(prompt_token_ids=ids, max_tokens=5, temperature=0, logprobs=3)
    assert len(r.logprobs) == len(r.token_ids)
    with torch.no_grad():
        logits = smollm_ref.model(torch.tensor([ids + r.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    for i, (tok, lp) in enumerate(zip(r.token_ids, r.logprobs)):
        row = ref[len(ids) - 1 + i]
        assert lp.token_id == tok
        assert math.isclose(lp.logprob, row[tok].item(), abs_tol=1e-3)
        top = torch.topk(row, 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        for (_, got), want in zip(lp.top, top.values.tolist()):
            assert math.isclose(got, want, abs_tol=1e-3)


def test_stop_string_is_cut_and_finishes(stack):
    with Client(stack.address) as c:
        full = c.generate(prompt="The capital of France is", max_tokens=8, temperature=0)
        assert " Paris" in full.text
        r = c.generate(prompt="The capital of France is", max_tokens=8, temperature=0, stop=["aris"])
    assert r.finish_reason == "stop"
    assert r.text == full.text[: full.text.index("aris")]
    assert "aris" not in r.text


def test_text_prompt_too_long_is_invalid_argument(stack):
    with Client(stack.address) as c:
        with pytest.raises(ChunkwiseError) as e:
            c.generate(prompt="hello " * 3000, max_tokens=4)
        assert e.value.code.name == "INVALID_ARGUMENT"
        assert "max_model_len" in e.value.message
        # and the server keeps serving
        assert c.generate(prompt="The capital of France is", max_tokens=2, temperature=0).text
