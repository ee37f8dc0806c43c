"""SMG's vllm.grpc.engine.VllmEngine service on a real stack: the tokens equal transformers'
and chunkwise.v1's, the counts and info are right, and every feature chunkwise lacks is refused
by name while the server keeps serving."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from client import Client
from e2e_helpers import running_stack

pytestmark = pytest.mark.e2e

API_KEY = "vllm-api-test-key"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
PROMPT = [5 + (i * 7) % 90 for i in range(40)]  # 40 tokens: two full 16-token blocks to cache


@pytest.fixture(scope="module")
def stack(tiny_llama_dir):
    with running_stack(tiny_llama_dir, scheduler_args=["--max-model-len", "256", "--api-key", API_KEY,
                                                       "--served-model-name", "tiny"]) as s:
        yield s


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.address) as ch:
        yield vpb_grpc.VllmEngineStub(ch)


def _request(rid: str, prompt=PROMPT, stream: bool = True, **sampling) -> vpb.GenerateRequest:
    # EOS ignored so every request runs its full length whatever the random model samples.
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", 8)
    sampling.setdefault("ignore_eos", True)
    return vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=prompt), stream=stream,
                               sampling_params=vpb.SamplingParams(**sampling))


def _generate(stub, req):
    return list(stub.Generate(req, metadata=AUTH, timeout=60))


def _check(reference, tokens: list[int]) -> None:
    """transformers' greedy continuation (which stops at EOS, where ours goes on) is a prefix."""
    want = reference.greedy(PROMPT, len(tokens))
    assert tokens[: len(want)] == want


def test_streamed_greedy_tokens_equal_transformers_and_chunkwise_v1(stub, stack, reference):
    out = _generate(stub, _request("stream-1"))
    chunks = [r.chunk for r in out if r.WhichOneof("response") == "chunk"]
    completes = [r.complete for r in out if r.WhichOneof("response") == "complete"]
    assert len(completes) == 1 and out[-1].WhichOneof("response") == "complete"
    tokens = [t for c in chunks for t in c.token_ids]
    assert len(tokens) == 8
    _check(reference, tokens)
    assert sum(c.completion_tokens for c in chunks) == 8  # each chunk counts its own tokens
    assert all(c.prompt_tokens == len(PROMPT) for c in chunks)
    done = completes[0]
    assert done.finish_reason == "length" and done.prompt_tokens == len(PROMPT)
    assert list(done.output_ids) == list(chunks[-1].token_ids)  # the last delta, as vLLM's servicer sends
    with Client(stack.address, api_key=API_KEY, timeout=60) as c:
        assert c.generate(prompt_token_ids=PROMPT, max_tokens=8, temperature=0, ignore_eos=True).token_ids == tokens


def test_unstreamed_is_one_complete_with_every_token_and_the_cache_hit(stub, reference):
    _generate(stub, _request("warm-cache", max_tokens=1))
    out = _generate(stub, _request("whole-1", stream=False))
    assert [r.WhichOneof("response") for r in out] == ["complete"]
    done = out[0].complete
    _check(reference, list(done.output_ids))
    assert done.completion_tokens == 8 and done.finish_reason == "length"
    assert done.cached_tokens == 32  # two whole blocks of the earlier identical prompt


def test_logprobs_match_the_sampled_tokens(stub):
    out = _generate(stub, _request("lp-1", stream=False, logprobs=2))
    done = out[0].complete
    lp = done.output_logprobs
    assert list(lp.token_ids) == list(done.output_ids)
    assert len(lp.token_logprobs) == 8 and all(x <= 0 for x in lp.token_logprobs)
    for sampled, top in zip(lp.token_ids, lp.top_logprobs):
        assert len(top.token_ids) == 2 and top.token_ids[0] == sampled  # greedy: the sampled one is the top


@pytest.mark.parametrize("sampling, field", [
    (dict(n=2), "sampling_params.n"),
    (dict(frequency_penalty=0.5), "sampling_params.frequency_penalty"),
    (dict(repetition_penalty=1.2), "sampling_params.repetition_penalty"),
    (dict(min_tokens=3), "sampling_params.min_tokens"),
    (dict(prompt_logprobs=1), "sampling_params.prompt_logprobs"),
    (dict(logit_bias={5: 1.0}), "sampling_params.logit_bias"),
    (dict(json_schema="{}"), "sampling_params.json_schema"),
    (dict(logprobs=-1), "sampling_params.logprobs"),
    (dict(max_tokens=500), "sampling_params.max_tokens"),
    (dict(top_p=1.5), "sampling_params.top_p"),
])
def test_refused_features_name_their_field_and_the_server_keeps_serving(stub, sampling, field):
    with pytest.raises(grpc.RpcError) as e:
        _generate(stub, _request(f"bad-{field}", **sampling))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field), e.value.details()
    assert _generate(stub, _request(f"after-{field}", max_tokens=1))[-1].complete.finish_reason == "length"


def test_bad_prompts_and_multimodal_input_are_refused(stub):
    for req, field in (
        (_request("oov", prompt=[1, 2, 10_000]), "tokenized.input_ids"),
        (vpb.GenerateRequest(request_id="no-input"), "input"),
        (vpb.GenerateRequest(request_id="mm", tokenized=vpb.TokenizedInput(input_ids=[1, 2]),
                             mm_inputs=vpb.MultimodalInputs(mm_hashes=["x"])), "mm_inputs"),
    ):
        with pytest.raises(grpc.RpcError) as e:
            _generate(stub, req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field)


def test_api_key_and_malformed_bytes(stack, stub):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request("no-key"), timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(stack.address) as ch:
        raw = ch.unary_unary("/vllm.grpc.engine.VllmEngine/GetLoads")
        with pytest.raises(grpc.RpcError) as e:
            raw(b"\xff\xff\xff", metadata=AUTH, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_info_loads_flush_and_unimplemented(stub):
    assert stub.HealthCheck(vpb.HealthCheckRequest(), metadata=AUTH).healthy
    info = stub.GetModelInfo(vpb.GetModelInfoRequest(), metadata=AUTH)
    assert info.served_model_name == "tiny" and info.max_context_length == 256 and info.is_generation
    assert info.vocab_size > 0 and list(info.architectures) == ["LlamaForCausalLM"]
    server = stub.GetServerInfo(vpb.GetServerInfoRequest(), metadata=AUTH)
    assert server.block_size == 16 and server.max_num_seqs == 256 and server.server_type == "vllm-grpc"
    _generate(stub, _request("before-flush", max_tokens=1))
    loads = stub.GetLoads(vpb.GetLoadsRequest(), metadata=AUTH)
    (load,) = loads.loads
    assert load.num_running_reqs == 0 and load.num_used_tokens == 0 and load.max_total_num_tokens > 0
    assert 0 < load.cache_hit_rate < 1
    assert stub.FlushCache(cpb.FlushCacheRequest(), metadata=AUTH).success
    done = _generate(stub, _request("after-flush", stream=False, max_tokens=1))[0].complete
    assert done.cached_tokens == 0
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=[1, 2])), metadata=AUTH, timeout=30)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_kv_events_follow_the_prefix_cache(stub):
    assert stub.FlushCache(cpb.FlushCacheRequest(), metadata=AUTH).success
    call = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), metadata=AUTH, timeout=60)
    try:
        snapshot = next(call)
        assert [e.WhichOneof("data") for e in snapshot.events] == ["cleared"]  # the index is empty
        prompt = [200 + i for i in range(40)]
        _generate(stub, _request("kv-1", prompt=prompt, stream=False))
        batch = next(call)
        assert batch.sequence_number > snapshot.sequence_number
        stored = [e.stored for e in batch.events]
        # Positions 0..46 were computed (the 48th token is sampled, not computed): two full blocks.
        assert [list(s.blocks[0].token_ids) for s in stored] == [prompt[:16], prompt[16:32]]
        assert not stored[0].HasField("parent_block_hash")
        assert stored[1].parent_block_hash == stored[0].blocks[0].block_hash
        assert all(s.blocks[0].block_size == 16 for s in stored)
        assert stub.FlushCache(cpb.FlushCacheRequest(), metadata=AUTH).success
        cleared = next(call)
        assert [e.WhichOneof("data") for e in cleared.events] == ["cleared"]
        assert cleared.sequence_number == batch.sequence_number + 1
    finally:
        call.cancel()


def test_abort_ends_a_running_request(stub):
    call = stub.Generate(_request("long-1", max_tokens=200), metadata=AUTH, timeout=60)
    first = next(call)
    assert first.WhichOneof("response") == "chunk"
    stub.Abort(vpb.AbortRequest(request_ids=["long-1"]), metadata=AUTH)
    rest = list(call)
    assert rest[-1].complete.finish_reason == "abort"
    assert sum(len(r.chunk.token_ids) for r in [first, *rest] if r.WhichOneof("response") == "chunk") < 200
