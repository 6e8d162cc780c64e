#!/usr/bin/env bash
# Smoke test of the image: build it, run `demo` (a replayed real-GPU trace, no GPU needed) as
# Kubernetes would (read-only root, no capabilities, non-root), scrape /metrics, check a few
# families, wait for Docker's HEALTHCHECK to report healthy, clean up.
#
#   deploy/docker-smoke.sh
#
# Environment:
#   DOCKER        docker CLI to use (default: docker; podman works too)
#   IMAGE         tag to build (default: gpumem-exporter:smoke); removed afterwards unless
#                 KEEP_IMAGE=1
#   PYTHON_IMAGE  base image (default: the Dockerfile's, python:3.12-slim); point it at a
#                 mirror or a locally built base where no registry is reachable
#   BUILD_ARGS    extra `docker build` arguments, e.g. "--network host"
#   PORT          host port on 127.0.0.1 to publish the exporter on (default: 19445)
#   TIMEOUT_S     how long to wait for metrics and health (default: 90)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
docker=${DOCKER:-docker}
image=${IMAGE:-gpumem-exporter:smoke}
port=${PORT:-19445}
timeout_s=${TIMEOUT_S:-90}
name=gpumem-smoke-$$
# Families the demo must serve; the build info must say it is the demo.
required=(
  'gpumem_exporter_build_info{.*mode="demo"'
  'gpumem_exporter_source_up{'
  'gpumem_exporter_last_sample_timestamp_seconds'
  'torch_cuda_allocated_bytes{'
  'torch_cuda_reserved_bytes{'
  'gpu_memory_total_bytes{'
)

log() { printf 'docker-smoke: %s\n' "$*" >&2; }

cleanup() {
  "$docker" rm -f "$name" >/dev/null 2>&1 || true
  if [[ "${KEEP_IMAGE:-0}" != 1 ]]; then
    "$docker" rmi "$image" >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

fetch() {  # fetch URL: print the body, fail on any non-200 (python, so no curl is needed)
  python3 - "$1" <<'EOF'
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=5) as response:
    sys.stdout.write(response.read().decode())
EOF
}

build_args=(--tag "$image")
if [[ -n "${PYTHON_IMAGE:-}" ]]; then
  build_args+=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE")
fi
# shellcheck disable=SC2206  # BUILD_ARGS is split on purpose
build_args+=(${BUILD_ARGS:-})

log "building $image"
"$docker" build "${build_args[@]}" "$root"

size=$("$docker" image inspect --format '{{.Size}}' "$image")
log "image size: $((size / 1024 / 1024)) MiB"
user=$("$docker" image inspect --format '{{.Config.User}}' "$image")
if [[ -z "$user" || "$user" == 0* || "$user" == root* ]]; then
  log "FAIL: the image runs as root (USER '$user')"
  exit 1
fi

log "running demo on 127.0.0.1:$port"
"$docker" run --detach --name "$name" \
  --publish "127.0.0.1:$port:9445" \
  --read-only --tmpfs /tmp \
  --cap-drop ALL --security-opt no-new-privileges \
  --health-interval 2s --health-start-period 5s \
  "$image" demo >/dev/null

metrics=""
deadline=$((SECONDS + timeout_s))
until metrics=$(fetch "http://127.0.0.1:$port/metrics" 2>/dev/null) \
    && grep -q '^torch_cuda_reserved_bytes{' <<<"$metrics"; do
  if ((SECONDS > deadline)) || [[ "$("$docker" inspect --format '{{.State.Running}}' "$name")" != true ]]; then
    log "FAIL: no allocator metrics after ${timeout_s}s; container log:"
    "$docker" logs "$name" >&2 || true
    exit 1
  fi
  sleep 1
done

missing=0
for pattern in "${required[@]}"; do
  if ! grep -Eq "^${pattern//\{/\\\{}" <<<"$metrics"; then
    log "FAIL: /metrics has no series matching ^$pattern"
    missing=1
  fi
done
if ((missing)); then
  "$docker" logs "$name" >&2 || true
  exit 1
fi
log "/metrics: $(grep -c '^[a-z]' <<<"$metrics") series, required families present"

fetch "http://127.0.0.1:$port/healthz" >/dev/null
fetch "http://127.0.0.1:$port/readyz" >/dev/null
log "/healthz and /readyz: 200"

uid=$("$docker" exec "$name" python3 -c 'import os; print(os.getuid())')
if [[ "$uid" == 0 ]]; then
  log "FAIL: the exporter runs as root"
  exit 1
fi

until [[ "$("$docker" inspect --format '{{.State.Health.Status}}' "$name")" == healthy ]]; do
  if ((SECONDS > deadline)); then
    log "FAIL: HEALTHCHECK never reported healthy:"
    "$docker" inspect --format '{{json .State.Health}}' "$name" >&2
    exit 1
  fi
  sleep 1
done
log "HEALTHCHECK: healthy (uid $uid)"
log "PASS"
