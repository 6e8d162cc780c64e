"""The example inference server (examples/inference_server/).

Its Kubernetes manifest is checked against the Kubernetes schemas and against the Helm chart's
PodMonitor (read from values.yaml, so the two cannot drift apart), and the app itself is run
for real on CPU, as `uvicorn` would run it in a pod, with the exporter embedded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO_ROOT
from tests.helpers import free_port, require_module

pytestmark = pytest.mark.slow

EXAMPLE = REPO_ROOT / "examples" / "inference_server"
MANIFEST = EXAMPLE / "deployment.yaml"
VALUES = REPO_ROOT / "deploy" / "helm" / "gpumem-exporter" / "values.yaml"
# The chart's oldest supported version (Chart.yaml kubeVersion), a recent one, and the newest
# the installed kubernetes-validate knows.
KUBE_VERSIONS = ("1.25.0", "1.30.0", "latest")
STARTUP_TIMEOUT_S = 90.0
SHUTDOWN_TIMEOUT_S = 20.0


def _documents() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]


def _one(kind: str) -> dict[str, Any]:
    found = [doc for doc in _documents() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in {MANIFEST.name}, found {len(found)}"
    return found[0]


def _pod_monitor_values() -> dict[str, Any]:
    return yaml.safe_load(VALUES.read_text())["podMonitor"]


def _server_container() -> dict[str, Any]:
    containers = _one("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {var["name"]: var.get("value", var.get("valueFrom")) for var in container["env"]}


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_manifest_is_valid_kubernetes(version: str) -> None:
    kubernetes_validate = require_module("kubernetes_validate", "kubernetes-validate")
    if version == "latest":
        version = kubernetes_validate.latest_version()
    documents = _documents()
    assert {doc["kind"] for doc in documents} == {"Deployment", "Service"}
    for doc in documents:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']} (k8s {version}): {err}")


def test_manifest_yaml_style() -> None:
    yamllint = require_module("yamllint.linter", "yamllint")
    config = require_module("yamllint.config", "yamllint").YamlLintConfig(
        "{extends: default, rules: {line-length: {max: 100}, document-start: disable}}"
    )
    for manifest in (MANIFEST, EXAMPLE / "deployment-sidecar.yaml"):
        problems = [str(p) for p in yamllint.run(manifest.read_text(), config)]
        assert not problems, manifest.name


def test_pod_is_scraped_by_the_charts_pod_monitor() -> None:
    pod_monitor = _pod_monitor_values()
    selector = pod_monitor["selector"]
    assert set(selector) == {"matchLabels"}, "update this test for the new selector form"
    pod_labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    for key, value in selector["matchLabels"].items():
        assert pod_labels.get(key) == value, f"pod template lacks the label {key}: {value!r}"

    container = _server_container()
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    port_name = pod_monitor["portName"]
    assert port_name in ports, f"no container port named {port_name!r}: {sorted(ports)}"
    env = _env(container)
    # The exporter must listen on the port the PodMonitor scrapes, beyond loopback.
    assert int(env["GPUMEM_PORT"]) == ports[port_name]
    assert env["GPUMEM_HOST"] == "0.0.0.0"


def test_manifest_gpumem_wiring() -> None:
    deployment = _one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = _server_container()
    env = _env(container)
    mounts = {mount["name"]: mount for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}

    # The admin token is a file from a Secret, never a variable.
    assert "GPUMEM_ADMIN_TOKEN" not in env
    token_file = Path(env["GPUMEM_ADMIN_TOKEN_FILE"])
    (secret_mount,) = [m for m in mounts.values() if Path(m["mountPath"]) == token_file.parent]
    secret = volumes[secret_mount["name"]]["secret"]
    assert token_file.name in {item["path"] for item in secret["items"]}

    # Read-only root: snapshots and recordings go to an emptyDir on /tmp.
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    (tmp_mount,) = [m for m in mounts.values() if m["mountPath"] == "/tmp"]
    assert "emptyDir" in volumes[tmp_mount["name"]]

    for name in ("POD_NAME", "POD_NAMESPACE", "NODE_NAME"):
        assert "fieldRef" in env[name], f"{name} should come from the Downward API"
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == "1"

    # Probes watch the app, not the exporter: a stale exporter must not restart the server.
    metrics_port = _pod_monitor_values()["portName"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "http", probe

    # The Service selects the pods and exposes the API, not the metrics port.
    service = _one("Service")
    assert deployment["spec"]["selector"]["matchLabels"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    assert service["spec"]["selector"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    assert [port["targetPort"] for port in service["spec"]["ports"]] == ["http"]
    assert metrics_port not in {port["targetPort"] for port in service["spec"]["ports"]}


# --- the app, run for real on CPU ---


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    app_url: str
    metrics_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM, as the kubelet sends it; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(SHUTDOWN_TIMEOUT_S)


def _wait_until_up(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"the server exited with {server.process.returncode}:\n{server.log()}")
        try:
            app = httpx.get(f"{server.app_url}/healthz", timeout=2)
            exporter = httpx.get(f"{server.metrics_url}/readyz", timeout=2)
            if app.status_code == 200 and exporter.status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"the server was not up after {STARTUP_TIMEOUT_S} s:\n{server.log()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    app_port, metrics_port = free_port(), free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPUMEM_")}
    env.update(
        GPUMEM_PORT=str(metrics_port),
        GPUMEM_INTERVAL_S="0.2",
        GPUMEM_LABELS="tier=test",
        MODEL_NAME="example-test",
        POD_NAME="example-test-0",
        INFERENCE_DEVICE="cpu",
        # CPU even on a GPU machine: this test is about a process that never initializes CUDA.
        CUDA_VISIBLE_DEVICES="",
        # Two CI cores: one for the model, one for the exporter and the test.
        OMP_NUM_THREADS="1",
    )
    # The command the README and the Deployment use.
    command = [sys.executable, "-m", "uvicorn", "examples.inference_server.app:app"]
    command += ["--host", "127.0.0.1", "--port", str(app_port)]
    log_path = tmp_path_factory.mktemp("example-server") / "server.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    running = Server(
        process, f"http://127.0.0.1:{app_port}", f"http://127.0.0.1:{metrics_port}", log_path
    )
    try:
        _wait_until_up(running)
        yield running
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_generate(server: Server) -> None:
    for batch_size in (1, 3):
        response = httpx.post(
            f"{server.app_url}/generate",
            json={"prompt_tokens": 16, "max_new_tokens": 4, "batch_size": batch_size},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["device"] == "cpu"
        assert body["dtype"] == "float32"
        assert body["model"] == "example-test"
        assert body["pod"] == "example-test-0"
        assert (body["batch_size"], body["prompt_tokens"], body["new_tokens"]) == (
            batch_size,
            16,
            4,
        )
        assert body["total_s"] > 0
        assert body["tokens_per_s"] > 0


@pytest.mark.parametrize(
    "body",
    [
        {"prompt_tokens": 16, "max_new_tokens": 4},  # missing batch_size
        {"prompt_tokens": 0, "max_new_tokens": 4, "batch_size": 1},
        {"prompt_tokens": 16, "max_new_tokens": 100_000, "batch_size": 1},
        {"prompt_tokens": 16, "max_new_tokens": 4, "batch_size": 1_000},
        {"prompt_tokens": "16", "max_new_tokens": 4, "batch_size": 1},
        {"prompt_tokens": 16.5, "max_new_tokens": 4, "batch_size": 1},
        {"prompt_tokens": 16, "max_new_tokens": 4, "batch_size": 1, "temperature": 0.7},
    ],
)
def test_generate_rejects_bad_input(server: Server, body: dict[str, Any]) -> None:
    response = httpx.post(f"{server.app_url}/generate", json=body, timeout=10)
    assert response.status_code == 422, response.text


def test_exporter_metrics(server: Server) -> None:
    response = httpx.get(f"{server.metrics_url}/metrics", timeout=10)
    assert response.status_code == 200
    samples = [
        sample
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    ]

    def values(name: str, **labels: str) -> list[float]:
        return [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]

    # The model label from MODEL_NAME merged with GPUMEM_LABELS, on every series.
    # Served by the helper exporter.start() started beside the server.
    assert values("gpumem_exporter_build_info", mode="helper", model="example-test", tier="test")
    host_total = values("host_memory_total_bytes", model="example-test")
    assert host_total
    assert host_total[0] > 0
    # The server's probe reports (its process on /metrics, by its host memory); CUDA is
    # never initialized, so it has no allocator to report: no allocator series at all.
    assert values("gpumem_exporter_source_up", source="agents") == [1.0]
    assert values("host_process_resident_memory_bytes", model="example-test")
    allocator = sorted({s.name for s in samples if s.name.startswith("torch_cuda_")})
    assert "torch_cuda_reserved_bytes" not in allocator
    assert "torch_cuda_allocated_bytes" not in allocator
    assert "torch_cuda_allocator_info" not in allocator
    assert not [s for s in samples if s.name.startswith("torch_cuda_") and "device" in s.labels]

    health = httpx.get(f"{server.metrics_url}/healthz", timeout=10)
    assert health.status_code == 200, health.text
    app_health = httpx.get(f"{server.app_url}/healthz", timeout=10).json()
    assert app_health["exporter_url"] == server.metrics_url
    assert app_health["exporter_error"] is None


def test_clean_shutdown(server: Server) -> None:
    started = time.monotonic()
    status = server.stop()
    log = server.log()
    # uvicorn shuts down gracefully, then re-raises the signal it caught (newer versions), so
    # the process ends with status 0 or by SIGTERM; the log says whether shutdown was clean.
    assert status in (0, -signal.SIGTERM), log
    assert "Application shutdown complete" in log
    assert time.monotonic() - started < SHUTDOWN_TIMEOUT_S
    assert "exporter stopped" in log  # the lifespan's shutdown ran
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.metrics_url}/metrics", timeout=2)


SIDECAR_MANIFEST = EXAMPLE / "deployment-sidecar.yaml"


def _sidecar_pod() -> dict[str, Any]:
    documents = [doc for doc in yaml.safe_load_all(SIDECAR_MANIFEST.read_text()) if doc]
    assert [doc["kind"] for doc in documents] == ["Deployment"]
    return dict(documents[0])


@pytest.mark.parametrize("version", ["1.30.0", "latest"])  # native sidecars: 1.29+
def test_sidecar_manifest_is_valid_kubernetes(version: str) -> None:
    kubernetes_validate = require_module("kubernetes_validate", "kubernetes-validate")
    if version == "latest":
        version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(_sidecar_pod(), version, strict=True)


def test_sidecar_manifest_wiring() -> None:
    """The helper in its own container: a native sidecar that owns the scraped port and the
    admin token; the server joins it through the shared folder and never starts one."""
    pod = _sidecar_pod()["spec"]["template"]["spec"]
    [helper] = pod["initContainers"]
    [server] = pod["containers"]
    assert helper["restartPolicy"] == "Always"
    assert helper["command"][-2:] == ["exporter.helper", "--sidecar"]
    helper_env, server_env = _env(helper), _env(server)
    ports = {p["name"]: p["containerPort"] for p in helper.get("ports", [])}
    assert ports[_pod_monitor_values()["portName"]] == int(helper_env["GPUMEM_PORT"])
    assert "gpumem-metrics" not in {p["name"] for p in server["ports"]}
    # One folder, mounted at the path both name, on a volume both mount.
    shared = helper_env["GPUMEM_HELPER_DIR"]
    assert server_env["GPUMEM_HELPER_DIR"] == shared
    mounted = [
        {m["name"] for m in c["volumeMounts"] if m["mountPath"] == shared} for c in (helper, server)
    ]
    assert mounted[0] == mounted[1] and len(mounted[0]) == 1
    assert server_env["GPUMEM_HELPER_SPAWN"] == "0"
    assert server_env["GPUMEM_PORT"] == helper_env["GPUMEM_PORT"]
    # The token: the helper's alone.
    assert "GPUMEM_ADMIN_TOKEN_FILE" in helper_env
    assert not any(k.startswith("GPUMEM_ADMIN_TOKEN") for k in server_env)
    token_volumes = {v["name"] for v in pod["volumes"] if "secret" in v}
    assert not token_volumes & {m["name"] for m in server["volumeMounts"]}
    # One user for both (the helper refuses another user's probes).
    assert pod["securityContext"]["runAsUser"] and "runAsUser" not in helper["securityContext"]
    assert "runAsUser" not in server["securityContext"]
