#!/usr/bin/env bash
# Wheels the lent GPU machine's image lacks, downloaded here into .whl/ (git-ignored) so a device
# run can carry them: that machine reaches no registry, and its image already holds CUDA torch,
# triton, transformers, pytest and hypothesis (see /work/.library/device/KINDS.md). Python 3.12,
# manylinux x86_64, binaries only, no dependencies resolved (each one is named here).
# Not included: FlashInfer. flashinfer-python 0.7.2.post1 alone is a 62 MB wheel and pulls
# nvidia-cutlass-dsl, cuda-tile and others, past the 64 MiB a device call can carry; its tests
# skip there, saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.35.1 \
    smg-grpc-proto==0.4.28 prometheus-client uvloop
du -sh .whl
