#!/usr/bin/env bash
# The device check for a lent GPU machine: set up (CUDA torch, FlashInfer, flash-attn where a
# wheel exists), report what attention backend `auto` picks and why, then run every test marked
# cuda (FlashInfer and flash-attn parity with the torch backend, the NCCL tensor-parallel test
# where two GPUs exist) under a time limit, and print one summary. Budget: under 8 minutes on one
# GPU; `DEVICE_CHECK_PYTEST_TIMEOUT` (seconds, default 360) caps the test run.
# Not yet in it: the ~1B-model throughput run of the seed-shaped workload (issue 15).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
scripts/setup.sh test > /tmp/device-check-setup.log 2>&1 || { tail -30 /tmp/device-check-setup.log; exit 2; }
py=.venv/bin/python
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
timeout "${DEVICE_CHECK_PYTEST_TIMEOUT:-360}" $py -m pytest -q -m cuda -rs -p no:cacheprovider tests/executor \
    2>&1 | tee /tmp/device-check-pytest.log | tail -40
rc=${PIPESTATUS[0]}
echo "== device check: pytest -m cuda rc=$rc ($(grep -E '[0-9]+ (passed|failed|skipped)' /tmp/device-check-pytest.log | tail -1)) in $(( $(date +%s) - start )) s"
if ! $py -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "== device check: torch sees no CUDA device, so nothing above ran on a GPU"
    exit 3
fi
exit "$rc"
