# The loraplane operator image: slim Python, the `operator` extra only (no torch, no engine), non-root.
# Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/loraplane/loraplane-operator:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/loraplane
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src/ src/
# The wheel, then exactly that file with its extra: the image runs what tests/test_wheel.py installs and
# imports, never the source tree.
RUN /opt/loraplane/bin/pip install --upgrade pip \
 && /opt/loraplane/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/loraplane/bin/pip install "$(ls /wheels/loraplane-*.whl)[operator]"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="loraplane-operator" \
      org.opencontainers.image.description="kopf operator for LoRABase and LoRAAdapter" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed numeric uid/gid matches the chart's runAsUser and satisfies runAsNonRoot checks.
RUN groupadd --system --gid 10001 loraplane \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin loraplane
COPY --from=build /opt/loraplane /opt/loraplane
# The root filesystem may be read-only: nothing writes outside /tmp (an emptyDir in the chart).
ENV PATH=/opt/loraplane/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TMPDIR=/tmp
USER 10001:10001
# 8080: kopf liveness (/healthz); 9090: Prometheus /metrics.
EXPOSE 8080 9090
# Both images share the `loraplane` entrypoint; the subcommand is the default command (the chart passes
# `operator run <flags>` as args, as the operator passes `serve <flags>` to server pods).
ENTRYPOINT ["loraplane"]
CMD ["operator", "run", "--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz", "--metrics-port=9090"]
