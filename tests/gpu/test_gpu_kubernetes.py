"""Kubernetes attribution on a real GPU: a CUDA process, a stand-in kubelet (a real gRPC server
on a unix socket, tests/support/kubelet_standin) and `gpumem-exporter serve` as separate processes.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_kubernetes.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO_ROOT, repo_env
from tests.helpers import free_port, kill_process
from tests.support.kubelet_standin import claim_pod, dra_device, pod, write_state

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GiB = 1 << 30
HOLDER = """
import sys, time, torch
x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print(torch.cuda.get_device_properties(0).uuid, flush=True)
time.sleep(600)
"""


@pytest.fixture
def node(tmp_path) -> Iterator[dict]:
    # Every process is killed and reaped however the set-up ends: a kubelet that never says
    # ready must not leave the holder's 2 GiB on the GPU for the tests after.
    started: list[subprocess.Popen[str]] = []

    def start(args: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, **kwargs)
        started.append(proc)
        return proc

    try:
        holder = start([sys.executable, "-c", HOLDER], env=repo_env())
        assert holder.stdout is not None
        uuid = "GPU-" + holder.stdout.readline().strip()
        state, sock = tmp_path / "state.json", tmp_path / "kubelet.sock"
        write_state(state, [pod("serving", "llama-0", "server", f"{uuid}::0", f"{uuid}::1")])
        kubelet = start(
            [sys.executable, "-m", "tests.support.kubelet_standin", str(sock), str(state)],
            env=repo_env(),
            cwd=REPO_ROOT,
        )
        assert kubelet.stdout is not None
        assert kubelet.stdout.readline().strip() == "ready"
        port = free_port()
        serve = start(
            [sys.executable, "-m", "exporter.cli", "serve", "--port", str(port)],
            env={
                **repo_env(),
                "GPUMEM_KUBELET_SOCKET": str(sock),
                "GPUMEM_KUBELET_REFRESH_S": "1",
                "GPUMEM_PROCESS_INTERVAL_S": "1",
            },
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        yield {"uuid": uuid, "pid": holder.pid, "state": state, "url": url, "proc": serve}
    finally:
        for proc in reversed(started):
            kill_process(proc)


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def wait_for(url: str, check: Callable[[dict], bool], timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    families: dict = {}
    while time.monotonic() < deadline:
        try:
            families = scrape(url)
            if check(families):
                return families
        except (OSError, KeyError, StopIteration):
            pass
        time.sleep(0.2)
    raise AssertionError(f"condition not met in {timeout_s} s; last scrape: {families}")


def value(families: dict, name: str, **labels: str) -> float:
    return next(
        s.value for s in families[name] if all(s.labels.get(k) == v for k, v in labels.items())
    )


def pod_rows(families: dict) -> set[tuple[str, str, str]]:
    return {
        (s.labels["gpu_uuid"], s.labels["pod"], s.labels["device_id"])
        for s in families.get("gpu_pod_info", [])
    }


def test_a_cuda_process_on_a_gpu_assigned_to_a_pod(node, tmp_path):
    uuid, pid, url = node["uuid"], str(node["pid"]), node["url"]
    cgroup = Path(f"/proc/{pid}/cgroup").read_text()
    families = wait_for(
        url,
        lambda f: (
            (uuid, "llama-0", uuid) in pod_rows(f)
            and any(s.labels.get("pid") == pid for s in f.get("gpu_process_memory_used_bytes", []))
        ),
    )
    used = value(families, "gpu_process_memory_used_bytes", pid=pid, gpu_uuid=uuid)
    assert used >= 2 * GiB
    # The GPU is the pod's: its device series keep their identity, the info series names it.
    assert pod_rows(families) == {(uuid, "llama-0", uuid)}  # two replicas, one row
    # This process's cgroup shows no pod: held outside any pod, by its NVML-reported bytes.
    assert "kubepods" not in cgroup, cgroup
    reason = next(
        s.labels["reason"]
        for s in families["gpu_process_memory_unattributed_bytes"]
        if s.labels["pid"] == pid
    )
    assert reason == "no_pod"
    assert value(families, "gpu_process_memory_unattributed_bytes", pid=pid) == used
    outside = sum(
        s.value
        for s in families["gpu_process_memory_unattributed_bytes"]
        if s.labels["gpu_uuid"] == uuid and s.labels["reason"] != "unknown"
    )
    assert value(families, "gpu_memory_unattributed_bytes", gpu_uuid=uuid) == outside >= used
    with urllib.request.urlopen(url + "/readyz", timeout=5) as response:
        assert json.loads(response.read()) == {"ready": True}

    # The kubelet names another GPU: this GPU's memory belongs to no pod, all of it.
    write_state(
        node["state"],
        [pod("serving", "llama-0", "server", "GPU-00000000-0000-0000-0000-000000000000")],
    )
    started = time.monotonic()
    families = wait_for(
        url,
        lambda f: (
            (
                "GPU-00000000-0000-0000-0000-000000000000",
                "llama-0",
                "GPU-00000000-0000-0000-0000-000000000000",
            )
            in pod_rows(f)
        ),
    )
    moved_after_s = time.monotonic() - started
    device_used = value(families, "gpu_memory_used_bytes", gpu_uuid=uuid)
    assert value(families, "gpu_memory_unattributed_bytes", gpu_uuid=uuid) == device_used
    assert device_used >= used
    assert moved_after_s < 3.0  # within one refresh (1 s) plus a tick and a scrape

    # GKE names GPUs by the minor number of /dev/nvidiaN: resolved through NVML, not an index.
    import pynvml

    pynvml.nvmlInit()
    minor = pynvml.nvmlDeviceGetMinorNumber(pynvml.nvmlDeviceGetHandleByUUID(uuid.encode()))
    pynvml.nvmlShutdown()
    write_state(node["state"], [pod("serving", "llama-0", "server", f"nvidia{minor}/vgpu0")])
    families = wait_for(url, lambda f: (uuid, "llama-0", f"nvidia{minor}/vgpu0") in pod_rows(f))
    assert value(families, "gpu_memory_unattributed_bytes", gpu_uuid=uuid) == outside
    out = Path(os.environ.get("OUT", tmp_path))
    (out / "gpu_kubernetes.json").write_text(
        json.dumps(
            {
                "uuid": uuid,
                "pid": pid,
                "cgroup": cgroup,
                "process_used": used,
                "device_used": device_used,
                "moved_after_s": moved_after_s,
                "minor": minor,
            },
            indent=1,
        )
    )


def test_a_real_gpu_a_claim_gave_is_attributed_by_its_minor(node, tmp_path):
    """Issue 37: the stand-in kubelet reports the real GPU as NVIDIA's DRA driver does,
    `gpu-<its minor>` in a ResourceClaim; the node daemon attributes it to that pod by the
    GPU's UUID; with the claim gone its memory is unattributed within one refresh."""
    import pynvml

    uuid, pid, url = node["uuid"], str(node["pid"]), node["url"]
    pynvml.nvmlInit()
    minor = pynvml.nvmlDeviceGetMinorNumber(pynvml.nvmlDeviceGetHandleByUUID(uuid.encode()))
    pynvml.nvmlShutdown()
    device = f"gpu-{minor}"
    claim = claim_pod("research", "notebook-1", "jupyter", "notebook-gpu", dra_device(device))
    write_state(node["state"], [claim])
    families = wait_for(
        url,
        lambda f: (
            (uuid, "notebook-1", device) in pod_rows(f)
            and any(s.labels.get("pid") == pid for s in f.get("gpu_process_memory_used_bytes", []))
        ),
    )
    [row] = [s for s in families["gpu_pod_info"] if s.labels["gpu_uuid"] == uuid]
    assert row.labels["resource"] == "gpu.nvidia.com"
    [info] = families["gpu_dra_claim_info"]
    assert (info.labels["gpu_uuid"], info.labels["claim"], info.labels["device"]) == (
        uuid,
        "notebook-gpu",
        device,
    )
    used = value(families, "gpu_process_memory_used_bytes", pid=pid, gpu_uuid=uuid)
    # Held by the claim's pod: only processes in no pod (the holder, a host process) count
    # outside it, not the whole GPU.
    held_outside = value(families, "gpu_memory_unattributed_bytes", gpu_uuid=uuid)
    processes_outside = sum(
        s.value
        for s in families["gpu_process_memory_unattributed_bytes"]
        if s.labels["gpu_uuid"] == uuid and s.labels["reason"] != "unknown"
    )
    assert held_outside == processes_outside >= used
    device_used = value(families, "gpu_memory_used_bytes", gpu_uuid=uuid)

    write_state(node["state"], [])  # the claim is deallocated
    started = time.monotonic()
    families = wait_for(
        url,
        lambda f: (
            value(f, "gpu_memory_unattributed_bytes", gpu_uuid=uuid)
            == value(f, "gpu_memory_used_bytes", gpu_uuid=uuid)
        ),
    )
    released_after_s = time.monotonic() - started
    assert released_after_s < 3.0  # one refresh (1 s) plus a tick and a scrape
    out = Path(os.environ.get("OUT", tmp_path))
    (out / "gpu_dra.json").write_text(
        json.dumps(
            {
                "uuid": uuid,
                "minor": minor,
                "device": device,
                "process_used": used,
                "held_outside_while_claimed": held_outside,
                "device_used": device_used,
                "unattributed_after_release_s": released_after_s,
            },
            indent=1,
        )
    )
