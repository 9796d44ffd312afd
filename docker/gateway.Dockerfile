# syntax=docker/dockerfile:1
# openrl CPU image: the gateway on GKE, and all three functions in the cpu-dev overlay
# (trainer and sampler on their CPU/transformers path, torch's CPU build).
# Build from the repository root:
#   docker build -f docker/gateway.Dockerfile -t REGISTRY/gateway:TAG .
FROM python:3.12.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch's CPU build: the default PyPI wheel is a multi-GB CUDA build the gateway never uses.
RUN pip install pip==25.2 setuptools==80.9.0 \
    && pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu
COPY docker/constraints.txt /tmp/constraints.txt
COPY . /src
RUN pip install --no-build-isolation -c /tmp/constraints.txt /src \
    && openrl models build --dir /opt/openrl/models/tiny-qwen3 --quiet

FROM python:3.12.11-slim-bookworm
RUN groupadd --gid 10001 openrl \
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
    XDG_CACHE_HOME=/tmp/cache
USER 10001:10001
EXPOSE 8080
# For docker run; in the cluster the Knative Service's probes do this.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/api/v1/healthz', timeout=4)"]
CMD ["python", "-m", "functions.gateway", "--host", "0.0.0.0", "--port", "8080"]
