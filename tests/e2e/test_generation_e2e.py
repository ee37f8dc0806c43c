"""End to end: SDK -> scheduler_svc -> executor_svc, real processes on ephemeral loopback ports,
compared token for token with transformers on the same checkpoint.

Covers all four combinations of chunked prefill (CP) and prefix caching (PC), with concurrent
requests sharing prefixes and the seed's geometry (block 16, budget 64). Exactness under
preemption (a KV pool too small for the burst, in all four combinations, with one step at a time
and with async scheduling) is in tests/reliability/test_async_scheduling_e2e.py.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from client import Client
from e2e_helpers import running_stack

BLOCK = 16
MAX_MODEL_LEN = 256
COMBOS = [
    pytest.param(True, True, id="CP+PC"),
    pytest.param(True, False, id="CP-only"),
    pytest.param(False, True, id="PC-only"),
    pytest.param(False, False, id="neither"),
]


def scheduler_flags(chunked: bool, caching: bool, budget: int = 64) -> list[str]:
    # Without chunked prefill a whole prompt must fit one step, so the budget is max_model_len.
    return [
        "--block-size", str(BLOCK),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-batched-tokens", str(budget if chunked else MAX_MODEL_LEN),
        "--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill",
        "--enable-prefix-caching" if caching else "--no-enable-prefix-caching",
    ]


def shared_prefix_prompts(seed: int, n: int, prefix_len: int = 48) -> list[list[int]]:
    rng = random.Random(seed)
    groups = [[rng.randrange(3, 384) for _ in range(prefix_len)] for _ in range(2)]
    prompts = []
    for i in range(n):
        suffix = [rng.randrange(3, 384) for _ in range(rng.randrange(5, 90))]
        prompts.append(groups[i % 2] + suffix)
    return prompts


def expected_cached(prompt_len: int) -> int:
    """Prompt tokens a repeat of a fully cached prompt reports: whole blocks, less one token
    when the prompt is exactly block-aligned (its last token is recomputed to sample from)."""
    return prompt_len - 1 if prompt_len % BLOCK == 0 else prompt_len // BLOCK * BLOCK


def run_concurrently(address: str, prompts: list[list[int]], max_tokens: int):
    def one(p):
        with Client(address) as c:
            return c.generate(prompt_token_ids=p, max_tokens=max_tokens, temperature=0)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def wait_idle(client: Client, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = client.stats()
        if st["num_running"] == 0 and st["num_waiting"] == 0 and st["kv_blocks_used"] == 0:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle: {st}")
        time.sleep(0.05)


@pytest.mark.parametrize("chunked,caching", COMBOS)
def test_concurrent_shared_prefixes_match_transformers(tiny_llama_dir, reference, chunked, caching):
    check_concurrent_shared_prefixes(tiny_llama_dir, reference, chunked, caching, [])


@pytest.mark.cuda
@pytest.mark.parametrize("chunked,caching", COMBOS)
def test_concurrent_shared_prefixes_on_cuda_match_transformers(tiny_llama_dir, reference, chunked, caching):
    """The same on a GPU, float32 (auto picks FlexAttention where triton is, else torch)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    check_concurrent_shared_prefixes(tiny_llama_dir, reference, chunked, caching, ["--device", "cuda"])


def check_concurrent_shared_prefixes(tiny_llama_dir, reference, chunked, caching, executor_args):
    prompts = shared_prefix_prompts(seed=1, n=8)
    with running_stack(tiny_llama_dir, ["--num-kv-blocks", "256", *executor_args],
                       scheduler_flags(chunked, caching)) as stack:
        results = run_concurrently(stack.address, prompts, max_tokens=12)
        for p, r in zip(prompts, results):
            reference.check(p, 12, r.token_ids)
            assert r.usage.prompt_tokens == len(p)
            assert r.usage.completion_tokens == len(r.token_ids)

        with Client(stack.address) as c:
            before = wait_idle(c)
            assert before["preemptions"] == 0
            # Repeat every prompt, one at a time: the cache (if on) must serve whole blocks, and
            # the prefill counter must show every other prompt token computed, none skipped.
            want_prefill = 0
            for p in prompts:
                r = c.generate(prompt_token_ids=p, max_tokens=12, temperature=0)
                reference.check(p, 12, r.token_ids)
                cached = expected_cached(len(p)) if caching else 0
                assert r.usage.cached_prompt_tokens == cached
                want_prefill += len(p) - cached
            after = wait_idle(c)
        assert after["prefill_tokens"] - before["prefill_tokens"] == want_prefill
        assert after["kv_blocks_free"] + after["kv_blocks_used"] == after["kv_blocks_total"]


@pytest.fixture(scope="module")
def seed_stack(tiny_llama_dir):
    """The seed's configuration: block 16, budget 64, both features on."""
    with running_stack(tiny_llama_dir, ["--num-kv-blocks", "128"], scheduler_flags(True, True)) as stack:
        yield stack


def test_seed_case_120_then_128_tokens(seed_stack, reference):
    rng = random.Random(120)
    p120 = [rng.randrange(3, 384) for _ in range(120)]
    p128 = [rng.randrange(3, 384) for _ in range(128)]
    with Client(seed_stack.address) as c:
        s0 = wait_idle(c)
        first = c.generate(prompt_token_ids=p120, max_tokens=8, temperature=0)
        s1 = wait_idle(c)
        again = c.generate(prompt_token_ids=p120, max_tokens=8, temperature=0)
        s2 = wait_idle(c)
        c.generate(prompt_token_ids=p128, max_tokens=4, temperature=0)
        again128 = c.generate(prompt_token_ids=p128, max_tokens=4, temperature=0)
        s3 = wait_idle(c)
    reference.check(p120, 8, first.token_ids)
    reference.check(p120, 8, again.token_ids)
    reference.check(p128, 4, again128.token_ids)
    # All 120 prompt tokens computed once (chunks [0,64) and [64,120)), none skipped...
    assert first.usage.cached_prompt_tokens == 0
    assert s1["prefill_tokens"] - s0["prefill_tokens"] == 120
    # ...and only the 8 tokens of the partial last block recomputed on the repeat.
    assert again.usage.cached_prompt_tokens == 112
    assert s2["prefill_tokens"] - s1["prefill_tokens"] == 8
    assert again128.usage.cached_prompt_tokens == 127
    assert s3["prefill_tokens"] - s2["prefill_tokens"] == 128 + 1


def test_stream_cancel_frees_blocks(seed_stack, reference):
    rng = random.Random(3)
    prompt = [rng.randrange(3, 384) for _ in range(100)]
    with Client(seed_stack.address) as c:
        wait_idle(c)
        got = []
        for chunk in c.stream(prompt_token_ids=prompt, max_tokens=120, temperature=0, ignore_eos=True):
            got += chunk.token_ids
            if len(got) >= 3:
                break  # cancels the call
        st = wait_idle(c)  # raises unless running == waiting == used blocks == 0
        assert st["requests_finished"].get("abort", 0) >= 1
        assert got == reference.greedy(prompt, 120)[: len(got)]


def test_abort_by_id_and_two_clients_at_once(seed_stack, reference):
    rng = random.Random(4)
    long_prompt = [rng.randrange(3, 384) for _ in range(60)]
    short_prompt = [rng.randrange(3, 384) for _ in range(30)]
    with Client(seed_stack.address) as a, Client(seed_stack.address) as b:
        wait_idle(a)
        stream = a.stream(prompt_token_ids=long_prompt, max_tokens=180, temperature=0,
                          ignore_eos=True, request_id="to-abort")
        first = next(stream)
        # Meanwhile a second client is served normally.
        r = b.generate(prompt_token_ids=short_prompt, max_tokens=10, temperature=0)
        assert b.abort("to-abort") is True  # before the reference runs: 170 steps is all it has left
        reference.check(short_prompt, 10, r.token_ids)
        rest = list(stream)
        assert rest[-1].finish_reason == "abort"
        assert len(first.token_ids) + sum(len(x.token_ids) for x in rest) < 180
        assert b.abort("to-abort") is False  # already gone
        wait_idle(a)


def test_streamed_chunks_add_up_to_generate(seed_stack):
    rng = random.Random(5)
    prompt = [rng.randrange(3, 384) for _ in range(40)]
    with Client(seed_stack.address) as c:
        chunks = list(c.stream(prompt_token_ids=prompt, max_tokens=10, temperature=0))
        whole = c.generate(prompt_token_ids=prompt, max_tokens=10, temperature=0)
    assert [t for ch in chunks for t in ch.token_ids] == whole.token_ids
    assert chunks[-1].finish_reason == whole.finish_reason
    assert all(ch.finish_reason is None for ch in chunks[:-1])
    assert len(chunks) >= 2  # streamed token by token, not in one message


def test_async_client_concurrent_streams(seed_stack, reference):
    import asyncio

    from client import AsyncClient

    rng = random.Random(6)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randrange(20, 70))] for _ in range(4)]

    async def main():
        async with AsyncClient(seed_stack.address) as c:
            async def one(p):
                ids = []
                async for chunk in c.stream(prompt_token_ids=p, max_tokens=9, temperature=0):
                    ids += chunk.token_ids
                return ids

            streamed = await asyncio.gather(*(one(p) for p in prompts))
            whole = await c.generate(prompt_token_ids=prompts[0], max_tokens=9, temperature=0)
            stats = await c.stats()
            return streamed, whole, stats

    streamed, whole, stats = asyncio.run(main())
    for p, ids in zip(prompts, streamed):
        reference.check(p, 9, ids)
    assert whole.token_ids == streamed[0]
    assert stats["kv_blocks_total"] == 128


def test_health_and_reflection(seed_stack):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(seed_stack.address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="chunkwise.v1.Generation"), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert {"chunkwise.v1.Generation", "grpc.health.v1.Health"} <= services
