#!/usr/bin/env bash
# The device check for a lent GPU machine: set up (CUDA torch, FlashInfer, flash-attn where a
# wheel exists), report what attention backend `auto` picks and why, run every test marked cuda
# (FlashInfer, FlexAttention and flash-attn against transformers and the torch backend at every
# position under chunking, cache hits and mixed decodes; greedy end to end in all four CP/PC
# configs; the NCCL tensor-parallel test where two GPUs exist), then the step-time run of
# bench/cuda_step.py (a random TinyLlama-1.1B-shaped model, every backend side by side), and
# print one summary. Budget: under 8 minutes on one GPU. `DEVICE_CHECK_PYTEST_TIMEOUT` (default
# 300 s) caps the tests, `DEVICE_CHECK_BENCH_TIMEOUT` (default 150 s) the step-time run. On a
# machine with no registry (the lent one), run scripts/device-wheels.sh on this side first, carry
# .whl, and set DEVICE_CHECK_PYTHON=python3 there.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
if [ -n "${DEVICE_CHECK_PYTHON:-}" ]; then
    # A machine with no registry (the lent one): its own python (CUDA torch, triton, transformers,
    # pytest), this checkout on PYTHONPATH, and the wheels scripts/device-wheels.sh put in .whl/.
    py=$DEVICE_CHECK_PYTHON
    if compgen -G ".whl/*.whl" >/dev/null; then
        $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 2
        export PYTHONPATH=/tmp/site
    fi
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    scripts/setup.sh test > /tmp/device-check-setup.log 2>&1 || { tail -30 /tmp/device-check-setup.log; exit 2; }
    py=.venv/bin/python
fi
nvidia-smi -L || true
$py - <<'PY'
import importlib.metadata as m
import torch
from executor_svc.attention import select_backend
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for pkg in ("flashinfer-python", "flash-attn"):
    try:
        print(pkg, m.version(pkg))
    except m.PackageNotFoundError:
        print(pkg, "not installed")
if torch.cuda.is_available():
    for bs in (16, 256):
        cls, why = select_backend("auto", torch.device("cuda"), torch.bfloat16, 64, bs)
        print(f"auto at block size {bs}: {cls.name} ({why})")
PY
timeout "${DEVICE_CHECK_PYTEST_TIMEOUT:-300}" $py -m pytest -q -m cuda -rs -p no:cacheprovider tests/executor \
    tests/e2e/test_generation_e2e.py \
    2>&1 | tee /tmp/device-check-pytest.log | tail -40
rc=${PIPESTATUS[0]}
echo "== device check: pytest -m cuda rc=$rc ($(grep -E '[0-9]+ (passed|failed|skipped)' /tmp/device-check-pytest.log | tail -1)) in $(( $(date +%s) - start )) s"
if $py -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    mkdir -p bench/results
    timeout "${DEVICE_CHECK_BENCH_TIMEOUT:-150}" $py bench/cuda_step.py --rounds 2 --repeats 3 \
        --json bench/results/cuda_step.json 2>&1 | tee /tmp/device-check-bench.log | tail -8
    echo "== device check: bench/cuda_step.py rc=${PIPESTATUS[0]} (bench/results/cuda_step.json)"
fi
if ! $py -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "== device check: torch sees no CUDA device, so nothing above ran on a GPU"
    exit 3
fi
exit "$rc"
