"""The pod reader: this node's pods from a stand-in Kubernetes API (real HTTPS with a
certificate of its own, tests/support/kube_api_standin.py), and what it adds to attribution: exact
names on shared GPUs, and a process of a pod that does not hold its GPU although others do."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from exporter.attribution import attribute
from exporter.config import load_config
from exporter.http.server import create_app
from exporter.kubernetes.pods import PodsApiError, PodsClient
from exporter.runtime import build_runtime
from exporter.sample import (
    GpuReading,
    KubeletReading,
    PodDevice,
    ProcessContainerReading,
    ProcessGpuReading,
    Sample,
)
from exporter.sources.kubelet import KubeletSource
from exporter.sources.nvml import NvmlSource
from tests.conftest import DATA_DIR
from tests.support.kube_api_standin import CRIO_ID, TOKEN, UID_A, UID_B, StandInApi, pod
from tests.support.kubelet_standin import StandInKubelet, write_state
from tests.support.kubelet_standin import pod as kubelet_pod
from tests.support.nvml_double import FakeNvml

RAW = json.loads((DATA_DIR / "allocator_native.json").read_text())["nvml_raw"]
GPU0 = RAW["devices"][0]["uuid"]
PID = RAW["devices"][0]["processes"][0]["pid"]


@pytest.fixture
def api(tmp_path):
    server = StandInApi(tmp_path, TOKEN)
    server.pods = [
        pod("serving", "llama-0", UID_A, {"server": CRIO_ID}),
        pod("batch", "embed-7", UID_B, {"worker": "b" * 64}),
    ]
    (tmp_path / "token").write_text(TOKEN + "\n")
    yield server
    server.stop()


def client(api: StandInApi, tmp_path: Path, **kwargs) -> PodsClient:
    return PodsClient(
        "gpu-node-1",
        api_url=api.url,
        token_path=tmp_path / "token",
        ca_path=api.cert,
        **kwargs,
    )


@pytest.mark.slow
def test_the_pods_of_this_node(api, tmp_path):
    listed = client(api, tmp_path).list()
    assert listed.pods == {UID_A: ("serving", "llama-0"), UID_B: ("batch", "embed-7")}
    assert listed.containers == {CRIO_ID: "server", "b" * 64: "worker"}
    assert api.requests == ["/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-node-1"]


@pytest.mark.slow
def test_a_refused_token_is_an_error_that_does_not_show_it(api, tmp_path):
    (tmp_path / "token").write_text("stale-token")
    with pytest.raises(PodsApiError, match="HTTP 401") as caught:
        client(api, tmp_path).list()
    assert "stale-token" not in str(caught.value)


def test_an_api_server_not_trusted_is_an_error(api, tmp_path):
    untrusted = PodsClient(
        "gpu-node-1", api_url=api.url, token_path=tmp_path / "token", ca_path=None
    )
    with pytest.raises(PodsApiError, match=r"(?i)certificate"):
        untrusted.list()


@pytest.mark.slow
def test_a_trickling_api_server_is_cut_at_one_deadline_for_the_whole_call(api, tmp_path):
    """A PodList sent one byte every 0.2 s would take minutes; the call ends at its deadline
    (per-read timeouts never fire while bytes trickle in)."""
    api.trickle_s = 0.2
    started = time.monotonic()
    with pytest.raises(PodsApiError, match="did not answer within 1 s"):
        client(api, tmp_path, timeout_s=1.0).list()
    assert time.monotonic() - started < 3


@pytest.mark.slow
def test_a_redirect_is_not_followed_and_the_token_goes_nowhere_else(api, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    elsewhere = StandInApi(tmp_path / "elsewhere", TOKEN)
    try:
        api.redirect_to = elsewhere.url.replace("https://", "http://")
        with pytest.raises(PodsApiError, match="HTTP 307"):
            client(api, tmp_path).list()
        assert elsewhere.requests == []
    finally:
        elsewhere.stop()


@pytest.mark.slow
def test_a_rotated_cluster_ca_is_read_again(api, tmp_path):
    """After the cluster CA rotates (a new ca.crt in the service account's folder), the next
    call trusts it: no restart."""
    ca = tmp_path / "ca.crt"
    shutil.copy(api.cert, ca)
    reader = PodsClient("gpu-node-1", api_url=api.url, token_path=tmp_path / "token", ca_path=ca)
    assert reader.list().pods
    (tmp_path / "rotated").mkdir()
    rotated = StandInApi(tmp_path / "rotated", TOKEN)  # a server with another certificate
    try:
        rotated.pods = api.pods
        moved = PodsClient(
            "gpu-node-1", api_url=rotated.url, token_path=tmp_path / "token", ca_path=ca
        )
        with pytest.raises(PodsApiError, match=r"(?i)certificate"):
            moved.list()
        staged = tmp_path / ".ca.crt"
        shutil.copy(rotated.cert, staged)
        staged.replace(ca)  # as the kubelet swaps the projected volume's files
        assert moved.list().pods
    finally:
        rotated.stop()


def test_no_node_name_or_cluster_is_an_error():
    with pytest.raises(PodsApiError, match="NODE_NAME"):
        PodsClient("", api_url="https://127.0.0.1:1")
    with pytest.raises(PodsApiError, match="KUBERNETES_SERVICE_HOST"):
        PodsClient.in_cluster({})


def shared_gpu_sample(pods: dict[str, tuple[str, str]] | None) -> Sample:
    """GPU 0 time-sliced between serving/llama-0 and batch/embed-7; a process of each on it,
    and one of a third pod (ml/notebook-3) that holds no GPU but uses this one."""
    devices = [
        PodDevice("serving", "llama-0", "server", "nvidia.com/gpu", f"{GPU0}::0"),
        PodDevice("batch", "embed-7", "worker", "nvidia.com/gpu", f"{GPU0}::1"),
    ]
    uid_c = "0043435f-1854-4327-b76b-730f681a781d"
    return Sample(
        timestamp=0.0,
        gpus=[GpuReading(index=0, uuid=GPU0, used_bytes=30 << 30)],
        processes=[
            ProcessGpuReading(0, GPU0, 101, 10 << 30),
            ProcessGpuReading(0, GPU0, 102, 10 << 30),
            ProcessGpuReading(0, GPU0, 103, 8 << 30),
        ],
        kubelet=KubeletReading(
            socket="/k.sock",
            up=True,
            asked_s=1.0,  # after the processes were first seen (at 0.0)
            devices=devices,
            pods=pods,
            containers={CRIO_ID: "server", "b" * 64: "worker", "c" * 64: "jupyter"},
            pods_api=pods is not None,
        ),
        process_containers=[
            ProcessContainerReading(101, "container", pod_uid=UID_A, container_id=CRIO_ID),
            ProcessContainerReading(102, "container", pod_uid=UID_B, container_id="b" * 64),
            ProcessContainerReading(103, "container", pod_uid=uid_c, container_id="c" * 64),
        ],
    )


def test_the_pod_reader_names_processes_on_a_shared_gpu_and_finds_the_intruder():
    pods = {
        UID_A: ("serving", "llama-0"),
        UID_B: ("batch", "embed-7"),
        "0043435f-1854-4327-b76b-730f681a781d": ("ml", "notebook-3"),
    }
    result = attribute(shared_gpu_sample(pods))
    assert result is not None
    names = {p.pid: (p.namespace, p.pod, p.container) for p in result.process_pods}
    assert names == {
        101: ("serving", "llama-0", "server"),
        102: ("batch", "embed-7", "worker"),
        103: ("ml", "notebook-3", "jupyter"),
    }
    [intruder] = result.unattributed_processes
    assert (intruder.pid, intruder.reason) == (103, "not_assigned")
    assert result.unattributed_gpus[GPU0] == (0, 8 << 30)


def test_without_the_pod_reader_a_shared_gpu_keeps_pod_uids_and_judges_no_pod_process():
    result = attribute(shared_gpu_sample(None))
    assert result is not None
    assert {p.pod for p in result.process_pods} == {""}
    assert result.unattributed_processes == []


def test_the_node_daemon_serves_the_pod_readers_names_and_its_state(api, tmp_path):
    proc = tmp_path / "proc" / str(PID)
    proc.mkdir(parents=True)
    proc.joinpath("cgroup").write_bytes((DATA_DIR / "cgroup" / "v2-systemd-crio.txt").read_bytes())
    state = tmp_path / "kubelet.json"
    # GPU 0 shared by two pods: without the API, its process would keep its pod UID only.
    write_state(
        state,
        [
            kubelet_pod("serving", "llama-0", "server", f"{GPU0}::0"),
            kubelet_pod("batch", "embed-7", "worker", f"{GPU0}::1"),
        ],
    )
    kubelet = StandInKubelet(tmp_path / "kubelet.sock", state).start()
    nvml = NvmlSource(FakeNvml(RAW))
    source = KubeletSource(
        lambda: nvml.last_pids,
        socket_path=str(tmp_path / "kubelet.sock"),
        refresh_s=0.2,
        proc=str(tmp_path / "proc"),
        pods=lambda: client(api, tmp_path),
    )
    # The per-pid families are served at the full detail level.
    config = load_config(env={}, detail="full")
    runtime = build_runtime(config, mode="node", sources=[nvml, source])
    http = TestClient(create_app(runtime))

    def scrape() -> tuple[str, dict]:
        runtime.sampler.tick()
        text = http.get("/metrics").text
        return text, {f.name: f.samples for f in text_string_to_metric_families(text)}

    try:
        deadline = time.monotonic() + 10
        while "gpu_process_pod_info" not in scrape()[1] and time.monotonic() < deadline:
            time.sleep(0.05)
        text, families = scrape()
        [named] = families["gpu_process_pod_info"]
        assert named.labels == {
            "pid": str(PID),
            "namespace": "serving",
            "pod": "llama-0",
            "container": "server",
        }
        assert families["gpumem_exporter_pods_api_up"][0].value == 1.0
        # The token rotates to one the API refuses: a state, and never the token itself.
        (tmp_path / "token").write_text("rotated-bad-token")
        deadline = time.monotonic() + 10
        while "gpumem_exporter_pods_api_error_info" not in families and time.monotonic() < deadline:
            time.sleep(0.05)
            text, families = scrape()
        assert families["gpumem_exporter_pods_api_up"][0].value == 0.0
        [error] = families["gpumem_exporter_pods_api_error_info"]
        assert "HTTP 401" in error.labels["error"]
        assert TOKEN not in text and "rotated-bad-token" not in text
        assert "gpu_process_pod_info" not in families  # names unknown now: not guessed
    finally:
        runtime.sampler.stop()
        kubelet.stop()


def test_the_pod_reader_setting_is_validated():
    from exporter.config import ConfigError

    assert load_config(env={"GPUMEM_KUBELET_POD_READER": "1"}).kubelet_pod_reader is True
    with pytest.raises(ConfigError, match="GPUMEM_KUBELET_POD_READER"):
        load_config(env={"GPUMEM_KUBELET_POD_READER": "maybe"})


@pytest.mark.slow
def test_a_slow_api_server_never_holds_up_the_kubelets_refresh(api, tmp_path):
    """The pod reader is asked beside the kubelet: while the API server trickles its answer
    (held to the reader's deadline), the kubelet's assignments go on being refreshed."""
    state = tmp_path / "kubelet.json"
    write_state(state, [kubelet_pod("serving", "llama-0", "server", f"{GPU0}::0")])
    kubelet = StandInKubelet(tmp_path / "kubelet.sock", state).start()
    api.trickle_s = 0.5
    source = KubeletSource(
        lambda: {PID},
        socket_path=str(tmp_path / "kubelet.sock"),
        refresh_s=0.1,
        proc=str(tmp_path / "proc"),
        pods=lambda: client(api, tmp_path, timeout_s=5.0),
    )
    try:
        source.read()  # starts both threads
        time.sleep(1.5)
        assert source.refreshes >= 5  # not one refresh per 5 s deadline
        reading = source.read().kubelet
        assert reading is not None and reading.up and reading.devices
        write_state(state, [kubelet_pod("batch", "embed-7", "worker", f"{GPU0}::0")])
        deadline = time.monotonic() + 2

        def first_pod() -> str:
            kubelet = source.read().kubelet
            assert kubelet is not None and kubelet.devices
            return kubelet.devices[0].pod

        while first_pod() != "embed-7":
            assert time.monotonic() < deadline, "the kubelet's new answer waited for the API"
            time.sleep(0.05)
    finally:
        source.close()
        kubelet.stop()
