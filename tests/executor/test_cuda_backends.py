"""Every attention backend that can run on this GPU, through the real runner at block size 16,
against transformers at every position: a prompt in chunks, a prefix-cache hit followed by
chunks, decodes riding along (issue 15's parity check; runs only where CUDA is, from
scripts/device-check.sh). The model has head dim 64, which FlashInfer's kernels need.

bfloat16 logits cannot equal float32 transformers, so each backend is held to the torch
backend's own error on the same GPU and the same steps (a backend that read a wrong block or
position would be off by far more than rounding), and FlexAttention, which also runs float32,
is held to float32 tolerances there."""

from __future__ import annotations

import pytest
import torch

from model_fixtures import load_reference

from .helpers import hf_logits, make_runner, run_chunked_cached_mixed

pytestmark = pytest.mark.cuda
HEAD_DIM_64 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def _max_error(runner, ref) -> float:
    d, checked = run_chunked_cached_mixed(runner)
    worst = 0.0
    for rid, start in checked:
        r = d.reqs[rid]
        end = max(r.logits) + 1
        want = hf_logits(ref, r.tokens[:end])[start:end]
        worst = max(worst, (d.logits_matrix(rid, start, end).float().cpu() - want).abs().max().item())
    return worst


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = tiny_checkpoint("llama", **HEAD_DIM_64)
    return path, load_reference(path)


@pytest.mark.parametrize("backend", ["flashinfer", "flex"])
def test_backend_in_bfloat16_is_as_close_to_transformers_as_the_torch_backend(model, backend):
    from executor_svc.attention import select_backend

    path, ref = model
    try:
        select_backend(backend, torch.device("cuda"), torch.bfloat16, 64, 16)
    except ValueError as e:
        pytest.skip(str(e))
    errors = {}
    for name in ("torch", backend):
        runner = make_runner(path, block_size=16, num_kv_blocks=32, device="cuda", dtype="bfloat16",
                             attention_backend=name)
        assert runner.info.attention_backend == name
        errors[name] = _max_error(runner, ref)
    assert errors[backend] <= 1.5 * errors["torch"] + 0.05, errors  # a misread block: ~25x (checked on CPU)


def test_flex_in_float32_matches_transformers(model):
    path, ref = model
    runner = make_runner(path, block_size=16, num_kv_blocks=32, device="cuda", dtype="float32",
                         attention_backend="flex")
    assert _max_error(runner, ref) < 2e-3
