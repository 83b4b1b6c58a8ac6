# The loraplane server image: CUDA runtime + Python, the `server` extra (torch, triton, FastAPI), non-root.
# Build from the repository root (on a machine with Docker; no GPU is needed to build):
#   docker build -f docker/server.Dockerfile -t ghcr.io/loraplane/loraplane-server:0.1.0 .
# The torch wheel from PyPI bundles its CUDA libraries; the base image brings the matching runtime and
# the NVIDIA container toolkit hooks. The host's driver must support CUDA_VERSION.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/loraplane
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src/ src/
# The wheel, then exactly that file with its extra: the image runs what tests/test_wheel.py installs and
# imports, never the source tree.
RUN /opt/loraplane/bin/pip install --upgrade pip \
 && /opt/loraplane/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/loraplane/bin/pip install "$(ls /wheels/loraplane-*.whl)[server]"

FROM ${CUDA_IMAGE}
LABEL org.opencontainers.image.title="loraplane-server" \
      org.opencontainers.image.description="OpenAI-compatible multi-LoRA server: one base model, many adapters" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles kernels at run time and needs a C compiler and the Python headers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 loraplane \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin loraplane \
 && mkdir -p /var/cache/loraplane \
 && chown 10001:10001 /var/cache/loraplane
COPY --from=build /opt/loraplane /opt/loraplane
# Read-only-root friendly: every cache (adapter host cache, Triton kernels, HF/torch) lives under one
# writable volume; the operator mounts the LoRABase hostCache (hostPath or emptyDir) there, and /tmp is an emptyDir.
ENV PATH=/opt/loraplane/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TMPDIR=/tmp \
    LORAPLANE_CACHE_DIR=/var/cache/loraplane \
    XDG_CACHE_HOME=/var/cache/loraplane/xdg \
    TRITON_CACHE_DIR=/var/cache/loraplane/triton \
    HF_HOME=/var/cache/loraplane/hf \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/loraplane/inductor
VOLUME ["/var/cache/loraplane", "/tmp"]
USER 10001:10001
EXPOSE 8000
# The operator's server Deployment passes `serve <flags>` as args (src/loraplane/operator/builders.py server_args).
ENTRYPOINT ["loraplane"]
CMD ["serve"]
