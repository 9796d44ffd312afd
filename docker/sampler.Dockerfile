# syntax=docker/dockerfile:1
# openrl sampler image: vLLM (multi-LoRA) on a CUDA base. vLLM 0.24.0 pins its own torch
# (2.11.0, CUDA 13), so openrl is installed without its torch pin: its other dependencies
# come from pyproject.toml, versions from docker/constraints-sampler.txt.
# Needs an NVIDIA driver >= 580 on the node (GKE: gpu_driver_version = "LATEST").
# It runs on the GPU by default (OPENRL_DEVICE=auto: cuda when torch sees one, with bf16
# base weights; openrl/device.py); the gke-gpu overlay sets OPENRL_DEVICE=cuda and
# OPENRL_SAMPLER_BACKEND=vllm.
# Build from the repository root:
#   docker build -f docker/sampler.Dockerfile -t REGISTRY/sampler:TAG .
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
COPY docker/constraints-sampler.txt /tmp/constraints.txt
# vLLM and its torch come from PyPI, whose Linux x86_64 wheels are CUDA builds (never the
# +cpu wheel index the gateway image uses); the build fails if torch is not one.
RUN pip install -c /tmp/constraints.txt vllm==0.24.0 \
    && python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 'torch is not a CUDA build')"
COPY . /src
RUN python -c "import tomllib; print('\n'.join(d for d in tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['dependencies'] if not d.startswith('torch')))" > /tmp/requirements.txt \
    && pip install -c /tmp/constraints.txt -r /tmp/requirements.txt \
    && pip install --no-build-isolation --no-deps /src \
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
    VLLM_CACHE_ROOT=/tmp/cache/vllm \
    VLLM_USE_FLASHINFER_SAMPLER=0 \
    OPENRL_DEVICE=auto
USER 10001:10001
EXPOSE 8080
# For docker run; in the cluster the Knative Service's probes do this.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz/live', timeout=4)"]
CMD ["python", "-m", "openrl.transport.bindings.http", "functions.sampler", "--host", "0.0.0.0", "--port", "8080"]
