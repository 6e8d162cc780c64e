"""The node daemon's Kubernetes attribution end to end inside one process: NVML values captured
on an H200 (tests/support/nvml_double), a stand-in kubelet (a real gRPC server on a unix
socket), cgroup files in a /proc tree of the test's own, the real sampler, collector and HTTP
routes."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from exporter.config import load_config
from exporter.http.server import create_app
from exporter.kubernetes.cgroup import parse_cgroup
from exporter.runtime import Runtime, build_runtime
from exporter.sources.kinds import kubelet_source
from exporter.sources.kubelet import KubeletSource
from exporter.sources.nvml import NvmlSource
from tests.conftest import DATA_DIR
from tests.support.kubelet_standin import (
    StandInKubelet,
    claim_pod,
    dra_device,
    link_container_log,
    pod,
    write_state,
)
from tests.support.nvml_double import FakeNvml

RAW = json.loads((DATA_DIR / "allocator_native.json").read_text())["nvml_raw"]
GPU0, GPU1 = (d["uuid"] for d in RAW["devices"])
PID = RAW["devices"][0]["processes"][0]["pid"]
PID_USED = RAW["devices"][0]["processes"][0]["usedGpuMemory"]
CGROUPS = DATA_DIR / "cgroup"
ERROR_INFO = "gpumem_exporter_kubelet_error_info"
POD_UID = "2c9f8a79-5391-454b-88cb-86190881cb96"  # in v2-systemd-crio.txt


def fake_proc(root: Path, cgroup_fixture: str) -> str:
    (root / str(PID)).mkdir(parents=True, exist_ok=True)
    (root / str(PID) / "cgroup").write_bytes((CGROUPS / cgroup_fixture).read_bytes())
    return str(root)


def kubelet_started(tmp: Path, cgroup_fixture: str, namespace: str, pod: str, container: str):
    """The kubelet's link for the container of that cgroup (its /var/log/containers, here
    tmp/containers): what names the process's pod and container."""
    where = parse_cgroup((CGROUPS / cgroup_fixture).read_text())
    if where is not None and where.pod_uid:
        link_container_log(
            tmp / "containers", namespace, pod, where.pod_uid, container, where.container_id
        )


def pod_files(process: Path, hostname: str, namespace: str) -> None:
    """What a pod's container writes of itself under /proc/<pid>/root: its tenant's files,
    which the daemon must never believe nor open."""
    (process / "root" / "etc").mkdir(parents=True, exist_ok=True)
    (process / "root" / "etc" / "hostname").write_text(hostname + "\n")
    account = process / "root" / "var/run/secrets/kubernetes.io/serviceaccount"
    account.mkdir(parents=True, exist_ok=True)
    (account / "namespace").write_text(namespace)


class Node:
    def __init__(
        self, tmp: Path, cgroup_fixture: str = "v2-systemd-crio.txt", detail: str = "full"
    ) -> None:
        self.state = tmp / "state.json"
        self.socket = tmp / "kubelet.sock"
        write_state(self.state, [pod("serving", "llama-0", "server", f"{GPU0}::0")])
        self.kubelet = StandInKubelet(self.socket, self.state).start()
        self.fake = FakeNvml(copy.deepcopy(RAW))  # a test may start and stop processes
        self.nvml = NvmlSource(self.fake, process_interval_s=0.0)  # every tick: see it at once
        self.source = KubeletSource(
            lambda: self.nvml.last_pids,
            socket_path=str(self.socket),
            refresh_s=0.5,
            timeout_s=1.0,
            proc=fake_proc(tmp / "proc", cgroup_fixture),
            logs_folder=str(tmp / "containers"),
        )
        kubelet_started(tmp, cgroup_fixture, "serving", "llama-0", "server")
        self.runtime: Runtime = build_runtime(
            load_config(env={}, detail=detail), mode="node", sources=[self.nvml, self.source]
        )
        self.client = TestClient(create_app(self.runtime))

    def metrics(self) -> dict[str, list]:
        self.runtime.sampler.tick()
        text = self.client.get("/metrics").text
        return {f.name: f.samples for f in text_string_to_metric_families(text)}

    def wait_for(self, check, timeout_s: float = 5.0) -> dict[str, list]:
        deadline = time.monotonic() + timeout_s
        while True:
            families = self.metrics()
            if check(families) or time.monotonic() > deadline:
                return families
            time.sleep(0.05)

    def close(self) -> None:
        self.runtime.sampler.stop()
        self.kubelet.stop()


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    n.close()


def pods_of(families) -> set[tuple[str, str, str, str]]:
    return {
        (s.labels["gpu_uuid"], s.labels["namespace"], s.labels["pod"], s.labels["container"])
        for s in families.get("gpu_pod_info", [])
    }


def up(families) -> float:
    return families["gpumem_exporter_kubelet_up"][0].value


@pytest.mark.slow
def test_the_gpu_and_its_process_are_named_and_move_with_the_assignment(node):
    families = node.wait_for(lambda f: pods_of(f))
    assert up(families) == 1.0
    assert pods_of(families) == {(GPU0, "serving", "llama-0", "server")}
    [named] = families["gpu_process_pod_info"]
    assert (
        named.labels.items() >= {"pid": str(PID), "namespace": "serving", "pod": "llama-0"}.items()
    )
    [container] = families["gpu_process_container_info"]
    assert container.labels["pod_uid"] == POD_UID
    unattributed = {
        s.labels["gpu_uuid"]: s.value for s in families["gpu_memory_unattributed_bytes"]
    }
    assert unattributed == {GPU0: 0.0, GPU1: 0.0}  # GPU1 has no pod but uses nothing
    # Device series keep their identity: no pod label is added to them.
    assert all("pod" not in s.labels for s in families["gpu_memory_used_bytes"])

    # The GPU moves to another pod: seen within one refresh (0.5 s here).
    write_state(node.state, [pod("batch", "embed-7", "worker", f"{GPU0}::0")])
    started = time.monotonic()
    families = node.wait_for(lambda f: "batch" in {p[1] for p in pods_of(f)})
    assert pods_of(families) == {(GPU0, "batch", "embed-7", "worker")}
    assert time.monotonic() - started < 2.0


NEW_PID = PID + 1000


def replace_the_process(node: Node, tmp: Path) -> None:
    """The GPU's process exits and a process of pod batch/embed-7 (another pod UID) starts on
    the same GPU."""
    process = tmp / "proc" / str(NEW_PID)
    process.mkdir(parents=True)
    (process / "cgroup").write_bytes((CGROUPS / "v2-cgroupfs-burstable.txt").read_bytes())
    kubelet_started(tmp, "v2-cgroupfs-burstable.txt", "batch", "embed-7", "worker")
    node.fake.raw["devices"][0]["processes"][0]["pid"] = NEW_PID


def judged(families) -> dict[str, str]:
    return {
        s.labels["pid"]: s.labels["reason"]
        for s in families.get("gpu_process_memory_unattributed_bytes", [])
    }


def unattributed_on_gpu0(families) -> float:
    return {s.labels["gpu_uuid"]: s.value for s in families["gpu_memory_unattributed_bytes"]}[GPU0]


@pytest.mark.slow
def test_a_process_newer_than_the_kubelets_answer_is_never_judged_by_it(node, tmp_path):
    """The GPU moves from llama-0 to embed-7 while the kubelet takes 0.8 s to answer: every
    scrape in that window used to judge embed-7's process by the old assignment (not
    assigned: its memory charged as nobody's). It is "pending", not counted, until a List
    asked after it answers; then it is named."""
    node.wait_for(lambda f: f.get("gpu_process_pod_info"))
    write_state(node.state, [pod("batch", "embed-7", "worker", f"{GPU0}::0")], delay_s=0.8)
    replace_the_process(node, tmp_path)
    started = time.monotonic()
    while time.monotonic() - started < 0.6:
        families = node.metrics()
        assert judged(families) == {str(NEW_PID): "pending"}
        assert unattributed_on_gpu0(families) == 0.0
        assert families.get("gpu_process_pod_info", []) == []
        time.sleep(0.1)
    families = node.wait_for(lambda f: f.get("gpu_process_pod_info"))
    [named] = families["gpu_process_pod_info"]
    assert (named.labels["pid"], named.labels["pod"]) == (str(NEW_PID), "embed-7")
    assert judged(families) == {}


@pytest.mark.slow
def test_while_the_kubelet_is_down_a_new_process_stays_pending(node, tmp_path):
    node.wait_for(lambda f: f.get("gpu_process_pod_info"))
    node.kubelet.stop()
    node.socket.unlink(missing_ok=True)
    replace_the_process(node, tmp_path)
    families = node.wait_for(lambda f: up(f) == 0.0)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        families = node.metrics()
        assert judged(families) == {str(NEW_PID): "pending"}
        assert unattributed_on_gpu0(families) == 0.0
        time.sleep(0.1)
    # The old assignment is still served, aged by the last success.
    assert pods_of(families) == {(GPU0, "serving", "llama-0", "server")}


def test_at_the_basic_level_a_containers_gpu_memory_is_keyed_by_the_container(tmp_path):
    """The default level serves no per-pid series for pods' processes: their GPU memory is
    summed per GPU and container, an identity a restart of the server keeps."""
    node = Node(tmp_path, detail="basic")
    try:
        families = node.wait_for(lambda f: "gpu_container_memory_used_bytes" in f)
        [used] = families["gpu_container_memory_used_bytes"]
        assert used.labels == {
            "gpu": "0",
            "gpu_uuid": GPU0,
            "namespace": "serving",
            "pod": "llama-0",
            "container": "server",
        }
        assert used.value == PID_USED
        assert not {"gpu_process_pod_info", "gpu_process_memory_used_bytes"} & set(families)
        assert all("pid" not in s.labels for samples in families.values() for s in samples)
    finally:
        node.close()


def test_a_gpu_assigned_elsewhere_leaves_this_gpus_memory_unattributed(node):
    node.metrics()  # the process is seen first: the List below is asked after it
    write_state(node.state, [pod("serving", "llama-0", "server", "GPU-on-another-node")])
    node.source.refresh()
    families = node.metrics()
    unattributed = {
        s.labels["gpu_uuid"]: s.value for s in families["gpu_memory_unattributed_bytes"]
    }
    assert unattributed[GPU0] == RAW["devices"][0]["memory_v2"]["used"]
    [process] = families["gpu_process_memory_unattributed_bytes"]
    assert process.labels["reason"] == "not_assigned" and process.value == PID_USED


def test_a_host_process_is_held_outside_any_pod(tmp_path):
    node = Node(tmp_path, "host-service.txt")
    try:
        families = node.wait_for(lambda f: "gpu_process_memory_unattributed_bytes" in f)
        [process] = families["gpu_process_memory_unattributed_bytes"]
        assert (
            process.labels.items()
            >= {"pid": str(PID), "reason": "no_pod", "gpu_uuid": GPU0}.items()
        )
        assert process.value == PID_USED
        unattributed = {
            s.labels["gpu_uuid"]: s.value for s in families["gpu_memory_unattributed_bytes"]
        }
        assert unattributed[GPU0] == PID_USED
    finally:
        node.close()


@pytest.mark.slow
def test_a_slow_kubelet_never_stalls_a_tick(node):
    write_state(node.state, [], delay_s=3)
    node.source.read()  # a pid-set change wakes the refresher at once; later ticks too
    started = time.monotonic()
    for _ in range(20):
        node.runtime.sampler.tick()
    assert time.monotonic() - started < 0.5  # 20 ticks while the kubelet takes 3 s a call
    families = node.wait_for(lambda f: "DEADLINE" in str(f.get(ERROR_INFO)), timeout_s=5)
    assert up(families) == 0.0
    [error] = families[ERROR_INFO]
    assert "DEADLINE_EXCEEDED" in error.labels["error"]


@pytest.mark.slow
def test_a_kubelet_that_goes_away_and_restarts_is_a_state_then_recovers(node, caplog):
    node.wait_for(lambda f: up(f) == 1.0)
    node.kubelet.stop()
    node.socket.unlink(missing_ok=True)
    families = node.wait_for(lambda f: "not found" in str(f.get(ERROR_INFO)))
    assert up(families) == 0.0
    [error] = families[ERROR_INFO]
    assert "not found" in error.labels["error"]
    # The last known assignment stays, with its age.
    assert pods_of(families) == {(GPU0, "serving", "llama-0", "server")}
    assert families["gpumem_exporter_kubelet_refresh_errors"][0].value >= 1
    node.kubelet = StandInKubelet(node.socket, node.state).start()
    families = node.wait_for(lambda f: up(f) == 1.0)
    assert up(families) == 1.0
    assert "gpumem_exporter_kubelet_error_info" not in families
    messages = [r.getMessage() for r in caplog.records if "kubelet" in r.getMessage()]
    assert sum("not found" in m for m in messages) == 1  # one line per reason


def test_missing_grpc_is_a_state_said_once(tmp_path, caplog):
    from exporter.kubernetes.podresources import KubeletClientMissing

    def no_grpc(*args, **kwargs):
        raise KubeletClientMissing("grpcio is not installed (pip install 'x[kubernetes]')")

    (tmp_path / "kubelet.sock").touch()
    source = KubeletSource(
        lambda: [], socket_path=str(tmp_path / "kubelet.sock"), client_factory=no_grpc
    )
    for _ in range(3):
        source.refresh()
    reading = source.read()
    source.close()
    assert reading.kubelet is not None and reading.kubelet.up is False
    assert "grpcio is not installed" in (reading.kubelet.error or "")
    assert sum("grpcio" in r.getMessage() for r in caplog.records) == 1


def test_kubelet_source_is_on_in_kubernetes_and_off_outside(tmp_path):
    config = load_config(env={})
    assert kubelet_source(config, list, env={}) is None  # no socket at the default path here
    source = kubelet_source(config, list, env={"KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    assert isinstance(source, KubeletSource)
    assert source.socket_path.endswith("pod-resources/kubelet.sock")
    off = load_config(env={"GPUMEM_KUBELET_SOCKET": "off", "KUBERNETES_SERVICE_HOST": "x"})
    assert kubelet_source(off, list, env={"KUBERNETES_SERVICE_HOST": "x"}) is None
    explicit = load_config(env={"GPUMEM_KUBELET_SOCKET": str(tmp_path / "k.sock")})
    source = kubelet_source(explicit, list, env={})
    assert isinstance(source, KubeletSource) and source.socket_path == str(tmp_path / "k.sock")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("GPUMEM_KUBELET_SOCKET", "relative/kubelet.sock"),
        ("GPUMEM_KUBELET_REFRESH_S", "0"),
        ("GPUMEM_KUBELET_TIMEOUT_S", "soon"),
        ("GPUMEM_KUBELET_RESOURCES", "gpu"),
    ],
)
def test_bad_kubelet_settings_are_one_line_errors(name, value):
    from exporter.config import ConfigError

    with pytest.raises(ConfigError, match=name):
        load_config(env={name: value})


def test_extra_resources_are_matched(tmp_path):
    config = load_config(env={"GPUMEM_KUBELET_RESOURCES": "example.com/gpu, amd.com/*"})
    assert config.kubelet_resources == ("example.com/gpu", "amd.com/*")
    state, sock = tmp_path / "s.json", tmp_path / "k.sock"
    write_state(
        state,
        [
            pod("a", "p", "c", "GPU-x", resource="example.com/gpu"),
            pod("a", "q", "c", "GPU-y", resource="amd.com/gpu"),
            pod("a", "r", "c", "GPU-z", resource="other.com/gpu"),
        ],
    )
    kubelet = StandInKubelet(sock, state).start()
    try:
        source = kubelet_source(
            load_config(
                env={
                    "GPUMEM_KUBELET_SOCKET": str(sock),
                    **{"GPUMEM_KUBELET_RESOURCES": "example.com/gpu,amd.com/*"},
                }
            ),
            list,
        )
        assert isinstance(source, KubeletSource)
        source.refresh()
        reading = source.read()
        source.close()
    finally:
        kubelet.stop()
    assert reading.kubelet is not None
    assert {d.pod for d in reading.kubelet.devices or ()} == {"p", "q"}


def test_a_blind_node_daemon_is_not_ready_with_its_reason():
    import pynvml

    fake = FakeNvml(RAW)
    fake.init_error = pynvml.NVMLError_DriverNotLoaded()
    runtime = build_runtime(load_config(env={}), mode="node", sources=[NvmlSource(fake)])
    client = TestClient(create_app(runtime))
    runtime.sampler.tick()
    response = client.get("/readyz")
    assert response.status_code == 503
    assert "NVML" in response.json()["reason"] and "Driver" in response.json()["reason"]
    seeing = build_runtime(load_config(env={}), mode="node", sources=[NvmlSource(FakeNvml(RAW))])
    client = TestClient(create_app(seeing))
    assert client.get("/readyz").status_code == 503  # no sample yet
    seeing.sampler.tick()
    assert client.get("/readyz").json() == {"ready": True}


def test_an_embedded_exporter_without_nvml_is_still_ready():
    """Only the node daemon exists to read NVML."""
    import pynvml

    fake = FakeNvml(RAW)
    fake.init_error = pynvml.NVMLError_LibraryNotFound()
    runtime = build_runtime(load_config(env={}), mode="embedded", sources=[NvmlSource(fake)])
    runtime.sampler.tick()
    assert TestClient(create_app(runtime)).get("/readyz").status_code == 200


def test_a_change_of_gpu_processes_asks_the_kubelet_at_once(tmp_path):
    """A pod that starts or stops changes the GPU processes: the kubelet is asked then, not
    only every refresh_s (60 s here)."""
    state, sock = tmp_path / "s.json", tmp_path / "k.sock"
    write_state(state, [pod("serving", "llama-0", "server", GPU0)])
    kubelet = StandInKubelet(sock, state).start()
    pids = [[1]]
    source = KubeletSource(lambda: pids[0], socket_path=str(sock), refresh_s=60)
    try:
        source.read()
        deadline = time.monotonic() + 5
        while source.refreshes < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        calls = kubelet.calls
        for _ in range(5):
            source.read()  # the same processes: no new call
        time.sleep(0.3)
        assert kubelet.calls == calls
        pids[0] = [1, 2]
        source.read()
        deadline = time.monotonic() + 5
        while kubelet.calls == calls and time.monotonic() < deadline:
            time.sleep(0.02)
        assert kubelet.calls == calls + 1
    finally:
        source.close()
        kubelet.stop()


def test_a_fifo_in_a_tenants_root_never_stalls_the_daemon(tmp_path):
    """Round 4, HIGH 1: a process chrooted into a folder whose etc/hostname (and service
    account namespace file) are FIFOs blocked the tick's open() for good: samples stopped,
    /metrics froze, /healthz went stale for the whole node. Nothing under a process's root
    is opened now: ticks go on, and the process is named from the kubelet's links."""
    node = Node(tmp_path)
    try:
        root = tmp_path / "proc" / str(PID) / "root"
        account = root / "var/run/secrets/kubernetes.io/serviceaccount"
        for folder in (root / "etc", account):
            folder.mkdir(parents=True, exist_ok=True)
        os.mkfifo(root / "etc" / "hostname")
        os.mkfifo(account / "namespace")
        ticked = threading.Event()
        found: dict[str, list] = {}

        def scrapes() -> None:
            for _ in range(3):
                found.update(node.metrics())
            ticked.set()

        threading.Thread(target=scrapes, daemon=True).start()
        if not ticked.wait(5.0):
            # Unblock the stuck open() so the test's thread can end, then fail.
            for fifo in (root / "etc" / "hostname", account / "namespace"):
                with contextlib.suppress(OSError):
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            pytest.fail("the tick blocked on a tenant's FIFO")
        families = node.wait_for(lambda f: f.get("gpu_process_pod_info"))
        [named] = families["gpu_process_pod_info"]
        assert (named.labels["namespace"], named.labels["pod"]) == ("serving", "llama-0")
    finally:
        node.close()


def test_what_a_pods_container_says_of_itself_charges_nobody(tmp_path):
    """Round 4, HIGH 2: pod B (no GPU) on pod A's GPU, its container's /etc/hostname and
    service-account namespace saying it is pod A, was charged to A, and nothing was counted
    outside the pods. Names come from the kubelet's links now: B's process is B's, its
    memory held outside the pods that hold the GPU; what its files say changes nothing."""
    node = Node(tmp_path, "v2-cgroupfs-burstable.txt")  # pod B's cgroup: another pod UID
    try:
        pod_files(tmp_path / "proc" / str(PID), "llama-0", "serving")  # B says it is A
        kubelet_started(tmp_path, "v2-cgroupfs-burstable.txt", "ml", "notebook-3", "nb")
        families = node.wait_for(lambda f: judged(f) and f.get("gpu_process_pod_info"))
        [named] = families["gpu_process_pod_info"]
        assert (named.labels["namespace"], named.labels["pod"]) == ("ml", "notebook-3")
        assert judged(families) == {str(PID): "not_assigned"}
        assert unattributed_on_gpu0(families) == PID_USED
        assert "gpu_container_memory_used_bytes" not in families or all(
            s.labels["pod"] != "llama-0" for s in families["gpu_container_memory_used_bytes"]
        )
    finally:
        node.close()


def test_unreadable_kubelet_links_are_a_state_and_judge_nothing(tmp_path, caplog):
    node = Node(tmp_path)
    try:
        for link in (tmp_path / "containers").iterdir():
            link.unlink()
        (tmp_path / "containers").rmdir()
        families = node.wait_for(
            lambda f: bool(f.get("gpumem_exporter_kubelet_container_logs_error_info"))
        )
        [error] = families["gpumem_exporter_kubelet_container_logs_error_info"]
        assert error.labels["folder"] == str(tmp_path / "containers")
        assert "No such file or directory" in error.labels["error"]
        assert families.get("gpu_process_pod_info", []) == []
        assert judged(families) == {} and unattributed_on_gpu0(families) == 0.0
        for _ in range(3):
            node.source.refresh()
        said = [r for r in caplog.records if "container logs" in r.getMessage()]
        assert len(said) == 1  # once per reason
    finally:
        node.close()


@pytest.mark.slow
def test_a_gpu_a_claim_gave_is_attributed_and_unattributed_once_the_claim_goes(tmp_path):
    """A 1.34 kubelet reports the GPU NVIDIA's DRA driver gave a ResourceClaim as `gpu-<minor>`
    (here GPU 0 is /dev/nvidia1: minor and NVML index differ). Attributed by the GPU's UUID
    like a device plugin's GPU; with the claim gone its memory is unattributed at the next
    refresh (issue 37)."""
    node = Node(tmp_path)
    try:
        node.fake.minor_numbers = {0: 1, 1: 0}
        kubelet_started(tmp_path, "v2-systemd-crio.txt", "research", "notebook-1", "jupyter")
        write_state(
            node.state,
            [claim_pod("research", "notebook-1", "jupyter", "notebook-gpu", dra_device("gpu-1"))],
        )
        families = node.wait_for(lambda f: f.get("gpu_process_pod_info"))
        assert pods_of(families) == {(GPU0, "research", "notebook-1", "jupyter")}
        [row] = families["gpu_pod_info"]
        assert (row.labels["resource"], row.labels["device_id"]) == ("gpu.nvidia.com", "gpu-1")
        [claim] = families["gpu_dra_claim_info"]
        assert claim.labels == {
            "gpu_uuid": GPU0, "namespace": "research", "pod": "notebook-1",
            "container": "jupyter", "claim": "notebook-gpu", "claim_namespace": "research",
            "driver": "gpu.nvidia.com", "pool": "gpu-node-1", "device": "gpu-1", "share_id": "",
        }  # fmt: skip
        [named] = families["gpu_process_pod_info"]
        assert named.labels["pod"] == "notebook-1"
        assert unattributed_on_gpu0(families) == 0.0

        write_state(node.state, [])  # the claim is deallocated
        started = time.monotonic()
        families = node.wait_for(lambda f: unattributed_on_gpu0(f) > 0)
        assert unattributed_on_gpu0(families) == RAW["devices"][0]["memory_v2"]["used"]
        assert "gpu_dra_claim_info" not in families or not families["gpu_dra_claim_info"]
        assert time.monotonic() - started < 2.0  # one refresh is 0.5 s here
    finally:
        node.close()
