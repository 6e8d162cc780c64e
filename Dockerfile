# gpumem-exporter image: the node daemon (`serve`, the default) and the demo (`demo`).
#
#   docker build -t gpumem-exporter .
#   docker run --rm -p 9445:9445 gpumem-exporter demo        # replayed trace, no GPU needed
#   docker run --rm --gpus all -p 9445:9445 gpumem-exporter  # node daemon (NVML + host)
#
# The base image is a build argument so that air-gapped builders can point it at a mirror
# (deploy/docker-smoke.sh uses it for a locally made Debian base). Keep both stages on the same
# base: the virtual environment links to the base image's Python.
ARG PYTHON_IMAGE=python:3.12-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python3 -m venv /opt/gpumem-exporter
# Only what the wheel needs (see .dockerignore), so code-only changes reuse no stale layers.
COPY pyproject.toml README.md ./
COPY exporter ./exporter
# The `kubernetes` extra (grpcio, protobuf): the node daemon's pod attribution through the
# kubelet's pod-resources API. Checked to load here, not at the first List on a node.
RUN /opt/gpumem-exporter/bin/pip install --no-cache-dir ".[kubernetes]" \
    && /opt/gpumem-exporter/bin/gpumem-exporter --help > /dev/null \
    && /opt/gpumem-exporter/bin/python -c "import grpc; from exporter.kubernetes import podresources; podresources.messages()"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpumem-exporter" \
      org.opencontainers.image.description="Prometheus exporter for PyTorch CUDA allocator, NVML and host memory" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed numeric UID/GID, so Kubernetes' runAsNonRoot can check it and the Helm chart's
# securityContext (runAsUser/fsGroup 10001) matches.
RUN groupadd --system --gid 10001 gpumem \
    && useradd --system --no-log-init --uid 10001 --gid gpumem --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin gpumem
COPY --from=builder /opt/gpumem-exporter /opt/gpumem-exporter
# GPUMEM_HOST: inside a container the exporter must listen beyond loopback to be reachable,
# for `demo` and any other subcommand too (a --host flag still wins).
ENV PATH=/opt/gpumem-exporter/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    GPUMEM_HOST=0.0.0.0 \
    GPUMEM_PORT=9445
USER 10001:10001
EXPOSE 9445
# /healthz answers 503 when samples are stale. Python, not curl: the slim image has no curl.
# Change the port with GPUMEM_PORT (not --port) so that this check follows it.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('GPUMEM_PORT', '9445'), timeout=4)"]
ENTRYPOINT ["gpumem-exporter"]
CMD ["serve", "--host", "0.0.0.0"]
