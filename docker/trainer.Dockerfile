# syntax=docker/dockerfile:1
# openrl trainer image: torch (CUDA 13 build from PyPI) + peft on a CUDA base.
# Needs an NVIDIA driver >= 580 on the node (GKE: gpu_driver_version = "LATEST").
# It runs on the GPU by default (OPENRL_DEVICE=auto: cuda when torch sees one, with bf16
# base weights; openrl/device.py); the gke-gpu overlay sets OPENRL_DEVICE=cuda.
# Build from the repository root:
#   docker build -f docker/trainer.Dockerfile -t REGISTRY/trainer:TAG .
FROM nvidia/cuda:13.0.1-base-ubuntu24.04 AS build
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install pip==25.2 setuptools==80.9.0
COPY docker/constraints.txt /tmp/constraints.txt
# torch's CUDA build: PyPI's Linux x86_64 wheel of torch 2.13.0 is built against CUDA 13
# (the gateway image takes the +cpu wheel from download.pytorch.org/whl/cpu instead). For
# another CUDA, pass e.g. --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130.
# The build fails if what got installed is not a CUDA build (no GPU is needed to check).
ARG TORCH_INDEX_URL=https://pypi.org/simple
RUN pip install --index-url "${TORCH_INDEX_URL}" -c /tmp/constraints.txt torch==2.13.0 \
    && python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 'torch is not a CUDA build')"
COPY . /src
RUN pip install --no-build-isolation -c /tmp/constraints.txt /src \
    && openrl models build --dir /opt/openrl/models/tiny-qwen3 --quiet

FROM nvidia/cuda:13.0.1-base-ubuntu24.04
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 openrl \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin openrl
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/openrl/models /opt/openrl/models
# The root filesystem is read-only in the cluster: every cache goes to /tmp (an emptyDir).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    OPENRL_HOME=/tmp/openrl \
    HF_HOME=/tmp/hf \
    HF_HUB_OFFLINE=1 \
    XDG_CACHE_HOME=/tmp/cache \
    TRITON_CACHE_DIR=/tmp/cache/triton \
    OPENRL_DEVICE=auto
USER 10001:10001
EXPOSE 8080
# For docker run; in the cluster the Knative Service's probes do this.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz/live', timeout=4)"]
CMD ["python", "-m", "openrl.transport.bindings.http", "functions.trainer", "--host", "0.0.0.0", "--port", "8080"]
