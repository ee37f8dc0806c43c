"""Full-prompt logits of the compact model equal transformers' (fp32), across the family."""

from __future__ import annotations

import pytest
import torch

from chunkwise.plan import GREEDY, NewRequestData, RunningRequestDelta, SamplingParams, ScheduledChunk, StepPlan
from executor_svc.attention.torch_backend import prefill_gemm_pays
from executor_svc.config import cpu_bf16_flags
from executor_svc.loader import load_model, read_spec
from executor_svc.models import packed_linear
from executor_svc.models.llama import GateUpSiluMul, Linear
from executor_svc.models import UnsupportedModelError
from model_fixtures import load_reference

from .helpers import hf_logits, make_runner, random_tokens

ATOL = 1e-4  # fp32; logits are O(5)

VARIANTS = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-mqa-bias": ("llama", dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True)),
    "llama-rope-linear": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-rope-llama3": ("llama", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "llama-rope-dynamic": ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "llama-head-dim-32": ("llama", dict(head_dim=32)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-untied": ("qwen2", dict(tie_word_embeddings=False, num_hidden_layers=3)),
    "mistral": ("mistral", dict(num_hidden_layers=3)),
}


def full_prompt_logits(path, tokens, packed=True, **config):
    runner = make_runner(path, block_size=16, num_kv_blocks=16, **config)
    # On CPU every linear layer and lm_head run through oneDNN with prepacked weights (see
    # packed_linear.py), unless packing was refused: the parity below is then F.linear's.
    layers = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert all((m.packed is not None) == packed for m in layers)
    assert (runner.model.lm_head_packed is not None) == packed
    # float32: the MLPs' gate/up as one packed matmul, silu * up eager (the pair of packed halves
    # is for bf16: test_bf16_mlp_on_packed_halves_runs_close_to_float32).
    assert all(m.up_packed is None for m in layers if isinstance(m, GateUpSiluMul))
    blocks = list(reversed(range(16)))[: -(-len(tokens) // 16)]  # non-contiguous, descending
    plan = StepPlan(1, new_requests=[NewRequestData("r", tokens, blocks, GREEDY)],
                    chunks=[ScheduledChunk("r", 0, len(tokens), 0, True)])
    result, logits = runner.execute_with_logits(plan)
    return result, logits["r"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_prompt_logits_match_transformers(tiny_checkpoint, variant):
    arch, overrides = VARIANTS[variant]
    path = tiny_checkpoint(arch, **overrides)
    tokens = random_tokens(150, seed=7)
    ours_result, ours = full_prompt_logits(path, tokens)
    ref = hf_logits(load_reference(path), tokens)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert ours_result.sampled[0].token_id == int(ref[-1].argmax())


@pytest.mark.parametrize("variant", ["llama-mqa-bias", "qwen2-untied"])
def test_full_prompt_logits_match_transformers_without_packed_weights(tiny_checkpoint, variant, monkeypatch):
    # The plain F.linear path (CUDA, or a CPU where oneDNN's packing is unavailable or fails its
    # self-check) stays exact too.
    monkeypatch.setattr(packed_linear, "available", lambda device: False)
    arch, overrides = VARIANTS[variant]
    path = tiny_checkpoint(arch, **overrides)
    tokens = random_tokens(150, seed=7)
    _, ours = full_prompt_logits(path, tokens, packed=False)
    torch.testing.assert_close(ours, hf_logits(load_reference(path), tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_silu_mul_on_packed_halves_matches_the_exact_activation(dtype, bias, monkeypatch):
    # silu(x Wg + bg) * (x Wu + bu) from the two packed matmuls' epilogues, against the same in
    # float64: float32 to its rounding, bf16 no further off than the eager bf16 path (one
    # [T, 2n] matmul rounded to bf16, then silu and the product each rounded again).
    if not packed_linear.available(torch.device("cpu")):
        pytest.skip("no oneDNN packing here")
    g = torch.Generator().manual_seed(0)
    n, k = 96, 64
    w = (torch.randn(2 * n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(2 * n, generator=g).to(dtype) if bias else None
    x = torch.randn(40, k, generator=g).to(dtype)
    if packed_linear.pack(w, b, widen=False) is None:
        pytest.skip(f"oneDNN packs no {dtype} weight here")
    pair = packed_linear.pack_silu_mul(w, b)
    assert pair is not None
    (gate, up), (gate_bias, up_bias) = pair
    with torch.inference_mode():
        got = packed_linear.silu_mul(x, gate, up, gate_bias, up_bias)
        ref_gate, ref_up = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()).split(n, -1)
        exact = torch.nn.functional.silu(ref_gate) * ref_up
        eager_gate, eager_up = torch.nn.functional.linear(x, w, b).split(n, -1)
        eager = torch.nn.functional.silu(eager_gate) * eager_up
    assert got.dtype == dtype and got.shape == (40, n)
    err = (got.double() - exact).abs().max().item()
    if dtype == torch.float32:
        assert err < 1e-5 * (exact.abs().max().item() + 1)
    else:
        assert err <= (eager.double() - exact).abs().max().item()
    # A pair that disagrees with F.linear on the probe is refused.
    real = packed_linear.silu_mul
    monkeypatch.setattr(packed_linear, "silu_mul", lambda *a: real(*a) + 1.0)
    assert packed_linear.pack_silu_mul(w, b) is None


@pytest.mark.parametrize("variant", ["llama-gqa-untied", "llama-mqa-bias"])
def test_large_batches_on_the_plain_weights_match_transformers(tiny_checkpoint, variant, monkeypatch):
    # With --cpu-plain-weight-min-rows every linear layer keeps both copies: the 150-row prefill
    # goes through F.linear on the plain weights; the packed ones see only lm_head (over all 150
    # rows here, for the logits compared, padded to 152 as the whole step is: padded_rows) and
    # packing's own 3-row self-checks.
    packed_rows = []
    real = packed_linear.linear
    monkeypatch.setattr(packed_linear, "linear", lambda x, p, bias: packed_rows.append(x.shape[0]) or real(x, p, bias))
    arch, overrides = VARIANTS[variant]
    path = tiny_checkpoint(arch, **overrides)
    tokens = random_tokens(150, seed=7)
    _, ours = full_prompt_logits(path, tokens, cpu_plain_weight_min_rows=64)
    assert packed_linear.padded_rows(150) == 152
    assert packed_rows.count(152) == 1 and set(packed_rows) == {3, 152}
    torch.testing.assert_close(ours, hf_logits(load_reference(path), tokens), atol=ATOL, rtol=0)
    # The threshold splits the same layer: one row below it goes to the packed copy, and agrees.
    runner = make_runner(path, block_size=16, num_kv_blocks=16, cpu_plain_weight_min_rows=64)
    layer = runner.model.layers[0].mlp.down_proj
    assert layer.packed is not None and layer.weight.numel() and layer.plain_min_rows == 64
    assert runner.model.plain_layers == 4 * len(runner.model.layers) and runner.model.plain_bytes > 0
    x = torch.randn(64, layer.weight.shape[1])
    with torch.inference_mode():
        packed_rows.clear()
        torch.testing.assert_close(layer(x[:63]), layer(x)[:63], atol=1e-5, rtol=0)
    assert packed_rows == [63]


def test_plain_weight_copies_only_when_asked_and_never_crowding_memory(tiny_llama_path, monkeypatch):
    import executor_svc.engine as engine

    # By default one copy, the packed one, whatever the CPU (the plain weight is freed).
    for capability in ("AVX2", "AVX512"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        runner = make_runner(tiny_llama_path)
        assert runner.model.plain_layers == 0 and runner.model.plain_bytes == 0
        assert all(m.weight.numel() == 0 for m in runner.model.modules() if isinstance(m, Linear))
    # Asked for, but the second copies would take over 1/4 of the memory available: one copy only.
    monkeypatch.setattr(engine, "_memory_available", lambda: 1 << 20)
    runner = make_runner(tiny_llama_path, cpu_plain_weight_min_rows=64)
    assert runner.model.plain_layers == 0 and runner.model.plain_bytes == 0
    monkeypatch.setattr(engine, "_memory_available", lambda: 1 << 40)
    assert make_runner(tiny_llama_path, cpu_plain_weight_min_rows=64).model.plain_layers > 0


def test_a_packed_weight_that_does_not_reproduce_f_linear_is_refused(monkeypatch):
    w, b = torch.randn(24, 16), torch.randn(24)
    packed = packed_linear.pack(w, b)
    assert packed is not None
    x = torch.randn(5, 16)
    with torch.inference_mode():
        torch.testing.assert_close(packed_linear.linear(x, packed, b), torch.nn.functional.linear(x, w, b))
    real = packed_linear.linear
    monkeypatch.setattr(packed_linear, "linear", lambda x, p, bias: real(x, p, bias) + 1e-2)
    assert packed_linear.pack(w, b) is None
    layer = Linear(16, 24, bias=True, dtype=torch.float32, device=torch.device("cpu"))
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    assert not layer.pack() and layer.packed is None and layer.weight.shape == (24, 16)  # untouched


def _without_reduced_precision_packing(monkeypatch):
    # A CPU like the Zen 3 (AVX2): oneDNN packs float32 weights but refuses bf16 and fp16 ones.
    real = packed_linear._reorder

    def reorder(weight, rows_hint=packed_linear.ROWS_HINT):
        if weight.dtype != torch.float32:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")
        return real(weight, rows_hint)

    monkeypatch.setattr(packed_linear, "_reorder", reorder)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_weights_widened_to_float32_round_like_the_exact_sum(dtype, monkeypatch):
    _without_reduced_precision_packing(monkeypatch)
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(96, 64, generator=g) / 8).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(40, 64, generator=g).to(dtype)
    assert packed_linear.pack(w, b, widen=False) is None
    packed = packed_linear.pack(w, b)
    assert packed is not None and packed.dtype == torch.float32
    with torch.inference_mode():
        got = packed_linear.linear(x, packed, b)
    assert got.dtype == dtype
    # The exact sum rounded once to the weight's dtype; float32 accumulation may land one unit of
    # the last place away (eps: one unit relative to 1; the fallback's F.linear does the same), or a
    # float32 rounding near zero.
    exact = (x.double() @ w.double().T + b.double()).to(dtype)
    torch.testing.assert_close(got.float(), exact.float(), rtol=torch.finfo(dtype).eps, atol=1e-5)
    assert (got != exact).float().mean() < 0.01


def test_bf16_model_on_a_cpu_without_bf16_matmuls_computes_in_float32(tiny_llama_path, monkeypatch):
    import executor_svc.engine as engine

    _without_reduced_precision_packing(monkeypatch)
    monkeypatch.setattr(engine, "_memory_available", lambda: 1 << 40)
    tokens = random_tokens(60, seed=3)
    plan = StepPlan(1, new_requests=[NewRequestData("r", tokens, [3, 1, 4, 0], GREEDY)],
                    chunks=[ScheduledChunk("r", 0, 60, 0, True)])
    ref = hf_logits(load_reference(tiny_llama_path), tokens)
    runner = make_runner(tiny_llama_path, block_size=16, num_kv_blocks=8, dtype="bfloat16")
    layers = [m for m in runner.model.modules() if isinstance(m, Linear)]
    copies = [p for m in layers for p in m.packed_copies()]
    assert all(p.dtype == torch.float32 for p in copies) and all(m.weight.numel() == 0 for m in layers)
    assert runner.model.lm_head_packed.dtype == torch.float32
    assert runner.model.widened_bytes == 4 * (sum(p.numel() for p in copies) + runner.model.lm_head_packed.numel())
    assert runner.kv_cache.layers[0].dtype == torch.bfloat16
    # Plain bf16 copies for large batches would be the slow path: not kept even when asked for.
    asked = make_runner(tiny_llama_path, block_size=16, num_kv_blocks=8, dtype="bfloat16", cpu_plain_weight_min_rows=64)
    assert asked.model.plain_layers == 0 and asked.model.widened_bytes == runner.model.widened_bytes
    assert all(m.plain_min_rows == 0 and m.weight.numel() == 0 for m in asked.model.modules() if isinstance(m, Linear))
    _, logits = runner.execute_with_logits(plan)
    widened = logits["r"]
    assert (widened - ref).abs().max() < 0.25  # as close as bf16 allows (test_bfloat16_runs_close_to_float32)
    # The bf16 linear weights over a quarter of the memory available: no float32 copies, F.linear in bf16.
    bf16_bytes = 2 * sum(p.numel() for p in copies)
    monkeypatch.setattr(engine, "_memory_available", lambda: 4 * bf16_bytes - 1)
    runner = make_runner(tiny_llama_path, block_size=16, num_kv_blocks=8, dtype="bfloat16")
    assert all(m.packed is None for m in runner.model.modules() if isinstance(m, Linear))
    assert runner.model.lm_head_packed is None and runner.model.widened_bytes == 0
    _, logits = runner.execute_with_logits(plan)
    assert (logits["r"] - ref).abs().max() < 0.25
    # The two bf16 runs differ only in the order of float32 sums (identical on the Zen 3), much
    # less than either differs from float32.
    assert (logits["r"] - widened).abs().max() < 0.1
    assert int(logits["r"][-1].argmax()) == int(widened[-1].argmax())


def test_rope_scaling_changes_logits(tiny_checkpoint):
    # Guard against the parity test passing because scaling is silently ignored on both sides.
    tokens = random_tokens(150, seed=7)
    _, plain = full_prompt_logits(tiny_checkpoint("llama"), tokens)
    for variant in ("llama-rope-linear", "llama-rope-llama3"):
        arch, overrides = VARIANTS[variant]
        _, scaled = full_prompt_logits(tiny_checkpoint(arch, **overrides), tokens)
        assert (scaled[50:] - plain[50:]).abs().max() > 1e-2, variant


def test_sharded_checkpoint_loads_identically(tiny_checkpoint, tiny_llama_path):
    sharded = tiny_checkpoint("llama", max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    a = load_model(tiny_llama_path).model.state_dict()
    b = load_model(sharded).model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_model_info(tiny_qwen2_path):
    runner = make_runner(tiny_qwen2_path)
    info = runner.info
    assert info.architecture == "Qwen2ForCausalLM"
    assert info.vocab_size == 384 and info.max_model_len == 512
    assert info.eos_token_ids == (2,)
    assert info.dtype == "float32" and info.device == "cpu" and info.attention_backend == "torch"
    ref = load_reference(tiny_qwen2_path)
    assert info.num_parameters == sum(p.numel() for p in ref.parameters())


def test_generation_config_eos_ids_are_merged(tiny_checkpoint, tmp_path):
    import json
    import shutil

    path = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "ckpt")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    spec, _ = read_spec(path)
    assert spec.eos_token_ids == (2, 7, 9)


def test_max_model_len_cap(tiny_llama_path):
    assert read_spec(tiny_llama_path, max_model_len=100)[1] == 100
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 512"):
        read_spec(tiny_llama_path, max_model_len=1000)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel|gpt2") as e:
        load_model(tmp_path)
    assert "LlamaForCausalLM" in str(e.value) and "Qwen2ForCausalLM" in str(e.value)


def test_unsupported_rope_type_is_a_clear_error(tmp_path):
    from model_fixtures import tiny_config

    cfg = tiny_config("llama", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 128})
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="RoPE type 'yarn'.*llama3"):
        read_spec(tmp_path)


def test_sliding_window_shorter_than_context_is_rejected(tiny_checkpoint):
    path = tiny_checkpoint("mistral", sliding_window=64)
    with pytest.raises(UnsupportedModelError, match="sliding-window.*--max-model-len 64"):
        read_spec(path)
    # Within the window full attention is identical, so a capped context is served.
    assert read_spec(path, max_model_len=64)[1] == 64


def test_missing_tensor_is_named(tiny_llama_path, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path = shutil.copytree(tiny_llama_path, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors for: layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(path)


def test_not_a_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)


def test_bfloat16_runs_close_to_float32(tiny_llama_path):
    tokens = random_tokens(60, seed=3)
    runner = make_runner(tiny_llama_path, block_size=16, num_kv_blocks=8, dtype="bfloat16")
    assert runner.info.dtype == "bfloat16"
    assert runner.kv_cache.layers[0].dtype == torch.bfloat16
    # Prefill as GEMMs with the compiled softmax where the CPU multiplies bf16 natively without
    # AMX (torch_backend.prefill_gemm_pays); torch's flash kernel elsewhere.
    native = prefill_gemm_pays(cpu_bf16_flags())
    assert runner.info.prefill_attention == ("bf16-gemm" if native else "sdpa")
    plan = StepPlan(1, new_requests=[NewRequestData("r", tokens, [3, 1, 4, 0], GREEDY)],
                    chunks=[ScheduledChunk("r", 0, 60, 0, True)])
    _, logits = runner.execute_with_logits(plan)
    ref = hf_logits(load_reference(tiny_llama_path), tokens)
    assert logits["r"].dtype == torch.float32
    assert (logits["r"] - ref).abs().max() < 0.25  # bf16 has ~3 significant digits
    # --enforce-eager: the same GEMMs with torch's eager softmax; the two differ in exp's last
    # bit at most, far below bf16's rounding.
    eager = make_runner(tiny_llama_path, block_size=16, num_kv_blocks=8, dtype="bfloat16", enforce_eager=True)
    assert eager.info.prefill_attention == ("bf16-gemm-eager-softmax" if native else "sdpa")
    _, eager_logits = eager.execute_with_logits(plan)
    assert (eager_logits["r"] - logits["r"]).abs().max() < 0.05


def test_bf16_mlp_on_packed_halves_runs_close_to_float32(tiny_checkpoint, monkeypatch):
    # Where oneDNN packs bf16 natively, each MLP's gate/up halves are packed apart and silu * up
    # happens in their epilogues (llama.GateUpSiluMul; with a bias here too); where the pair is
    # refused, one packed gate/up matmul and eager silu * up. Both as close to the float32
    # reference as bf16 allows, and to each other within bf16's rounding of the intermediate.
    path = tiny_checkpoint("llama", num_key_value_heads=1, attention_bias=True, mlp_bias=True)
    tokens = random_tokens(60, seed=3)
    plan = StepPlan(1, new_requests=[NewRequestData("r", tokens, [3, 1, 4, 0], GREEDY)],
                    chunks=[ScheduledChunk("r", 0, 60, 0, True)])
    ref = hf_logits(load_reference(path), tokens)
    if packed_linear.pack(torch.randn(8, 16).to(torch.bfloat16), widen=False) is None:
        pytest.skip("oneDNN does not pack bf16 on this CPU (the float32 copies' path: test above)")
    fused = make_runner(path, block_size=16, num_kv_blocks=8, dtype="bfloat16")
    gate_ups = [m for m in fused.model.modules() if isinstance(m, GateUpSiluMul)]
    assert gate_ups and all(m.up_packed is not None and m.packed.dtype == torch.bfloat16 for m in gate_ups)
    _, fused_logits = fused.execute_with_logits(plan)
    monkeypatch.setattr(packed_linear, "pack_silu_mul", lambda *args, **kwargs: None)
    whole = make_runner(path, block_size=16, num_kv_blocks=8, dtype="bfloat16")
    assert all(m.up_packed is None and m.packed is not None for m in whole.model.modules() if isinstance(m, GateUpSiluMul))
    _, whole_logits = whole.execute_with_logits(plan)
    for logits in (fused_logits["r"], whole_logits["r"]):
        assert (logits - ref).abs().max() < 0.25  # bf16 has ~3 significant digits
    assert (fused_logits["r"] - whole_logits["r"]).abs().max() < 0.1


def test_bf16_layers_packed_for_one_row_with_amx_lm_head_and_gate_up_for_32(tiny_llama_path, monkeypatch):
    # With AMX, bf16 layers packed for 32 rows had oneDNN multiply prefill-sized batches on one of
    # two threads; packed for 1 row it splits them (packed_linear.layer_rows_hint). float32, and
    # CPUs without AMX, keep 32, and so do lm_head (it sees only the sampling rows) and the MLP's
    # gate/up (1 row gained nothing there).
    assert packed_linear.layer_rows_hint(torch.bfloat16, ["avx512_bf16", "amx_bf16"]) == 1
    assert packed_linear.layer_rows_hint(torch.bfloat16, ["avx512_bf16"]) == packed_linear.ROWS_HINT == 32
    assert packed_linear.layer_rows_hint(torch.float32, ["avx512_bf16", "amx_bf16"]) == packed_linear.ROWS_HINT
    if packed_linear.pack(torch.randn(8, 16).to(torch.bfloat16), widen=False) is None:
        pytest.skip("oneDNN does not pack bf16 on this CPU")
    import executor_svc.engine as engine

    tokens = random_tokens(60, seed=3)
    plan = StepPlan(1, new_requests=[NewRequestData("r", tokens, [3, 1, 4, 0], GREEDY)],
                    chunks=[ScheduledChunk("r", 0, 60, 0, True)])
    hints: list[tuple[tuple[int, ...], int]] = []
    real = packed_linear._reorder
    monkeypatch.setattr(packed_linear, "_reorder",
                        lambda w, rows_hint=32: hints.append((tuple(w.shape), rows_hint)) or real(w, rows_hint))
    runs = {}
    for flags in (["avx512_bf16", "amx_bf16"], ["avx512_bf16"]):
        hints.clear()
        monkeypatch.setattr(engine, "cpu_bf16_flags", lambda flags=flags: flags)
        runner = make_runner(tiny_llama_path, block_size=16, num_kv_blocks=8, dtype="bfloat16")
        n = runner.spec.num_layers
        assert (runner.spec.vocab_size, runner.spec.hidden_size) in [shape for shape, h in hints if h == 32]
        # Per layer q/k/v, o and down at 1 with AMX; the gate and up halves, and lm_head, at 32.
        counts = {h: sum(1 for _, hint in hints if hint == h) for h in (1, 32)}
        assert counts == ({1: 3 * n, 32: 2 * n + 1} if "amx_bf16" in flags else {1: 0, 32: 5 * n + 1})
        _, logits = runner.execute_with_logits(plan)
        runs[len(flags)] = logits["r"]
    ref = hf_logits(load_reference(tiny_llama_path), tokens)
    for logits in runs.values():
        assert (logits - ref).abs().max() < 0.25  # bf16 has ~3 significant digits
    # The blocking changes the order of each dot product's float32 sums, nothing more.
    assert (runs[2] - runs[1]).abs().max() < 0.05


def test_the_last_layer_runs_on_the_sampling_rows_only_and_changes_no_value(tiny_llama_path):
    """`execute` takes the last layer's o_proj and MLP over the rows that sample only (llama.py:
    `keep_rows`); `execute_with_logits` over every row. Their sampled tokens and logprobs agree, a
    step where no row samples still writes every row's K/V in the last layer, and the logits of
    the step after it are those of the whole prompt at once."""
    sampling = SamplingParams(temperature=0.0, num_logprobs=3)
    a, b = random_tokens(70, seed=11), random_tokens(45, seed=12)
    plan = StepPlan(1, new_requests=[NewRequestData("a", a, [0, 1, 2, 3, 4], sampling),
                                     NewRequestData("b", b, [5, 6, 7], sampling)],
                    chunks=[ScheduledChunk("a", 0, 70, 0, True), ScheduledChunk("b", 0, 45, 0, True)])
    runner = make_runner(tiny_llama_path, block_size=16, num_kv_blocks=16)
    pruned = runner.execute(plan)
    runner.reset()
    whole, logits = runner.execute_with_logits(plan)
    for got, want in zip(pruned.sampled, whole.sampled):
        assert got.req_id == want.req_id and got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t for t, _ in got.top_logprobs] == [t for t, _ in want.top_logprobs]
        last = torch.log_softmax(logits[got.req_id][-1], -1)
        assert got.logprob == pytest.approx(float(last[got.token_id]), abs=1e-5)
    # The first 50 positions in a step that samples nothing (no row kept), the rest after, in
    # blocks no step wrote before (so every key the second step reads, this run wrote).
    runner.reset()
    first = StepPlan(1, new_requests=[NewRequestData("a", a, [11, 12, 13, 14, 15], GREEDY)],
                     chunks=[ScheduledChunk("a", 0, 50, 0, False)])
    assert runner.execute(first).sampled == []
    rest = StepPlan(2, running=[RunningRequestDelta("a", [], [])], chunks=[ScheduledChunk("a", 50, 20, 50, True)])
    _, split = runner.execute_with_logits(rest)
    torch.testing.assert_close(split["a"], logits["a"][50:], atol=1e-5, rtol=0)


def test_steps_padded_to_row_buckets_compute_what_unpadded_steps_do(tiny_llama_path, monkeypatch):
    """On CPU with packed linear layers each step runs padded to a bounded row count
    (packed_linear.padded_rows: oneDNN compiles a kernel per row count). The pad rows write no K/V
    and leave no trace: tokens, logprobs, logits and the KV cache equal an unpadded runner's."""
    assert [packed_linear.padded_rows(n) for n in (1, 8, 9, 97, 512, 513, 1000, 1024, 1025, 4000)] == \
        [8, 8, 16, 104, 512, 528, 1008, 1024, 1056, 4032]
    assert len({packed_linear.padded_rows(n) for n in range(1, 8193)}) == 192
    rows_seen = []
    real = packed_linear.linear
    monkeypatch.setattr(packed_linear, "linear", lambda x, p, bias: rows_seen.append(x.shape[0]) or real(x, p, bias))
    sampling = SamplingParams(temperature=0.0, num_logprobs=3)
    a, b, c = random_tokens(70, seed=21), random_tokens(45, seed=22), random_tokens(5, seed=23)
    first = StepPlan(1, new_requests=[NewRequestData("a", a, [0, 1, 2, 3, 4], sampling),
                                      NewRequestData("b", b, [5, 6, 7], sampling)],
                     chunks=[ScheduledChunk("a", 0, 70, 0, True), ScheduledChunk("b", 0, 40, 0, False)])
    padded, plain = (make_runner(tiny_llama_path, block_size=16, num_kv_blocks=16) for _ in range(2))
    assert padded.pad_rows
    plain.pad_rows = False
    results = {}
    for name, runner in (("padded", padded), ("plain", plain)):
        rows_seen.clear()
        one = runner.execute(first)
        # A decode, the rest of b's prompt, and a new request that samples: 1 + 5 + 5 rows.
        second = StepPlan(2, new_requests=[NewRequestData("c", c, [8], sampling)],
                          running=[RunningRequestDelta("a", [], [], append_sampled=True),
                                   RunningRequestDelta("b", [], [])],
                          chunks=[ScheduledChunk("a", 70, 1, 70, True), ScheduledChunk("b", 40, 5, 40, True),
                                  ScheduledChunk("c", 0, 5, 0, True)], follows_step_id=1)
        two, logits = runner.execute_with_logits(second)
        three = runner.execute(StepPlan(3, running=[RunningRequestDelta("c", [], [], append_sampled=True)],
                                        chunks=[ScheduledChunk("c", 5, 1, 5, True)], follows_step_id=2))
        results[name] = (one.sampled + two.sampled + three.sampled, logits, runner.kv_cache.layers, list(rows_seen))
    (got, got_logits, got_kv, got_rows), (want, want_logits, want_kv, want_rows) = results["padded"], results["plain"]
    # What the linear layers saw: 110 rows -> 112 (the last layer: 1 sampling row -> 8), 11 -> 16
    # (execute_with_logits keeps every row), 1 -> 8; unpadded, the counts themselves.
    assert set(got_rows) == {112, 8, 16} and set(want_rows) == {110, 1, 11}
    assert [(s.req_id, s.token_id) for s in got] == [(s.req_id, s.token_id) for s in want]
    for g, w in zip(got, want):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [t for t, _ in g.top_logprobs] == [t for t, _ in w.top_logprobs]
    for req in ("a", "b", "c"):
        assert got_logits[req].shape == want_logits[req].shape
        torch.testing.assert_close(got_logits[req], want_logits[req], atol=1e-5, rtol=0)
    # Blocks 9-15 were never handed out: no pad row wrote into them (nor anywhere else).
    for g, w in zip(got_kv, want_kv):
        torch.testing.assert_close(g[:, :9], w[:, :9], atol=1e-5, rtol=0)
        assert not g[:, 9:].any() and not w[:, 9:].any()
