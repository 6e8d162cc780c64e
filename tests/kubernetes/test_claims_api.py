"""The claim reader: the ResourceClaims of this node's DRA devices from a stand-in Kubernetes
API (real HTTPS, tests/support/kube_api_standin.py), the memory each claim consumed of a GPU
several claims share held against what its processes use (issue 37)."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from exporter.config import load_config
from exporter.http.server import create_app
from exporter.kubernetes.claims import (
    ClaimedDevice,
    ClaimsApiError,
    ClaimsClient,
    parse_claims,
    parse_quantity,
)
from exporter.kubernetes.pods import PodsClient
from exporter.runtime import build_runtime
from exporter.sources.kubelet import KubeletSource
from exporter.sources.nvml import NvmlSource
from tests.conftest import DATA_DIR
from tests.support.kube_api_standin import (
    CRIO_ID,
    TOKEN,
    UID_A,
    UID_B,
    StandInApi,
    pod,
    resource_claim,
    resource_slice,
)
from tests.support.kubelet_standin import StandInKubelet, claim_pod, dra_device, write_state
from tests.support.nvml_double import FakeNvml

RAW = json.loads((DATA_DIR / "allocator_native.json").read_text())["nvml_raw"]
GPU0 = RAW["devices"][0]["uuid"]
PID = RAW["devices"][0]["processes"][0]["pid"]
PID_USED = RAW["devices"][0]["processes"][0]["usedGpuMemory"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10Gi", 10 << 30),
        ("1536Mi", 1536 << 20),
        ("1.5Gi", 3 << 29),
        ("1500M", 1_500_000_000),
        ("1073741824", 1 << 30),
        ("0.5", 1),  # rounded up to a whole byte
        # Round 4, LOW 10: valid quantities the reader refused.
        ("1500m", 2),  # milli-bytes: 1.5 bytes, rounded up
        ("1e3", 1000),
        ("1E9", 10**9),
        ("2.5e-1", 1),
        ("+4Ki", 4096),
        ("5.", 5),
        (".5Mi", 1 << 19),
        ("100n", 1),
        ("0", 0),
    ],
)
def test_quantities_of_bytes(text, expected):
    assert parse_quantity(text) == expected


@pytest.mark.parametrize("text", ["", "10GiB", "-1Gi", "1e99", "1e", "ten", "1.2.3", "Gi"])
def test_what_is_no_quantity_of_bytes_is_refused(text):
    with pytest.raises(ValueError):
        parse_quantity(text)


def test_a_quantity_that_cannot_be_read_costs_only_its_device(caplog):
    """Round 4, LOW 10: one claim's unreadable consumed memory failed the whole read, every
    namespace's claims with it. Now only that device of that claim is left out, said once."""
    data = {
        "items": [
            resource_claim("research", "a", ("gpu-0", "7f3a", "10Gi")),
            resource_claim("research", "odd", ("gpu-1", "9b1c", "lots")),
            resource_claim("research", "milli", ("gpu-1", "1d2e", "1500m")),
        ]
    }
    assert parse_claims(data) == {
        "a": [ClaimedDevice("gpu.nvidia.com", "gpu-node-1", "gpu-0", "7f3a", 10 << 30)],
        "odd": [],
        "milli": [ClaimedDevice("gpu.nvidia.com", "gpu-node-1", "gpu-1", "1d2e", 2)],
    }
    assert "claim odd: consumedCapacity not a quantity of bytes: 'lots'" in caplog.text


def test_a_claim_list_gives_each_claims_devices_and_memory():
    data = {
        "items": [
            resource_claim("research", "a", ("gpu-0", "7f3a", "10Gi")),
            resource_claim("research", "whole", ("gpu-1", "", None)),
            {"metadata": {"name": "pending"}, "status": {}},  # not allocated yet
        ]
    }
    assert parse_claims(data) == {
        "a": [ClaimedDevice("gpu.nvidia.com", "gpu-node-1", "gpu-0", "7f3a", 10 << 30)],
        "whole": [ClaimedDevice("gpu.nvidia.com", "gpu-node-1", "gpu-1", "", None)],
        "pending": [],
    }


@pytest.fixture
def api(tmp_path):
    server = StandInApi(tmp_path, TOKEN)
    server.pods = [
        pod("research", "notebook-a", UID_A, {"jupyter": CRIO_ID}),
        pod("research", "notebook-b", UID_B, {"jupyter": "b" * 64}),
    ]
    server.claims = {
        "research": [
            resource_claim("research", "a-share", ("gpu-0", "7f3a", "10Gi")),
            resource_claim("research", "b-share", ("gpu-0", "9c1e", "1Mi")),
        ]
    }
    (tmp_path / "token").write_text(TOKEN + "\n")
    yield server
    server.stop()


def pods_client(api: StandInApi, tmp_path) -> PodsClient:
    return PodsClient("gpu-node-1", api=api.client_api(tmp_path / "token"))


def claims_client(api: StandInApi, tmp_path) -> ClaimsClient:
    return ClaimsClient(api.client_api(tmp_path / "token"), "gpu-node-1")


@pytest.mark.slow
def test_a_forbidden_or_malformed_claim_list_is_one_line(api, tmp_path):
    api.forbid_claims = True
    with pytest.raises(ClaimsApiError, match=r"resourceclaims in research: .*HTTP 403"):
        claims_client(api, tmp_path).list({"research"})
    api.forbid_claims = False
    api.claims = {"research": [{"metadata": {"name": "x"}, "status": {"allocation": {
        "devices": {"results": [{"pool": "p", "device": "gpu-0"}]}}}}]}  # fmt: skip
    with pytest.raises(ClaimsApiError, match="not a ResourceClaimList"):
        claims_client(api, tmp_path).list({"research"})
    # A quantity it cannot read costs that device only (round 4): the list is read.
    api.claims = {"research": [{"metadata": {"name": "x"}, "status": {"allocation": {
        "devices": {"results": [{"driver": "gpu.nvidia.com", "pool": "p", "device": "gpu-0",
                                 "consumedCapacity": {"memory": "lots"}}]}}}}]}  # fmt: skip
    assert claims_client(api, tmp_path).list({"research"}) == {("research", "x"): []}


@pytest.mark.slow
def test_claimed_memory_is_held_against_what_the_claims_processes_use(api, tmp_path):
    """Two claims share GPU 0 (consumable capacity): notebook-a claimed 10 GiB, notebook-b
    1 MiB. notebook-a's process uses PID_USED (under 10 GiB); notebook-b uses nothing. Then
    notebook-b's claim is the one the process is in: it uses more than it claimed. The API
    forbidding resourceclaims is a state, and the claimed series go."""
    proc = tmp_path / "proc" / str(PID)
    proc.mkdir(parents=True)
    proc.joinpath("cgroup").write_bytes((DATA_DIR / "cgroup" / "v2-systemd-crio.txt").read_bytes())
    state = tmp_path / "kubelet.json"
    shares = [
        claim_pod("research", name, "jupyter", claim, dra_device("gpu-0", share_id=share))
        for name, claim, share in (
            ("notebook-a", "a-share", "7f3a"),
            ("notebook-b", "b-share", "9c1e"),
        )
    ]
    write_state(state, shares)
    kubelet = StandInKubelet(tmp_path / "kubelet.sock", state).start()
    fake = FakeNvml(RAW)
    fake.minor_numbers = {0: 0, 1: 1}
    nvml = NvmlSource(fake)
    source = KubeletSource(
        lambda: nvml.last_pids,
        socket_path=str(tmp_path / "kubelet.sock"),
        refresh_s=0.2,
        proc=str(tmp_path / "proc"),
        pods=lambda: pods_client(api, tmp_path),
        claims=lambda: claims_client(api, tmp_path),
    )
    runtime = build_runtime(load_config(env={}), mode="node", sources=[nvml, source])
    http = TestClient(create_app(runtime))

    def scrape() -> dict:
        runtime.sampler.tick()
        text = http.get("/metrics").text
        return {f.name: f.samples for f in text_string_to_metric_families(text)}

    def by_claim(families, name) -> dict[str, float]:
        return {s.labels["claim"]: s.value for s in families.get(name, [])}

    def wait(check) -> dict:
        deadline = time.monotonic() + 10
        while not check(families := scrape()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return families

    try:
        families = wait(lambda f: by_claim(f, "gpu_dra_claim_memory_used_bytes").get("a-share"))
        assert by_claim(families, "gpu_dra_claim_memory_claimed_bytes") == {
            "a-share": 10 << 30,
            "b-share": 1 << 20,
        }
        assert by_claim(families, "gpu_dra_claim_memory_used_bytes") == {
            "a-share": PID_USED,
            "b-share": 0.0,
        }
        assert families["gpumem_exporter_claims_api_up"][0].value == 1.0
        [share] = [
            s for s in families["gpu_dra_claim_memory_claimed_bytes"]
            if s.labels["claim"] == "a-share"
        ]  # fmt: skip
        assert share.labels["gpu_uuid"] == GPU0 and share.labels["share_id"] == "7f3a"

        # The process is notebook-b's now (its pod UID): it uses far more than its 1 MiB.
        api.pods = [
            pod("research", "notebook-a", UID_B, {"jupyter": "b" * 64}),
            pod("research", "notebook-b", UID_A, {"jupyter": CRIO_ID}),
        ]
        families = wait(lambda f: by_claim(f, "gpu_dra_claim_memory_used_bytes").get("b-share"))
        assert (
            by_claim(families, "gpu_dra_claim_memory_used_bytes")["b-share"]
            == PID_USED
            > (by_claim(families, "gpu_dra_claim_memory_claimed_bytes")["b-share"])
        )

        api.forbid_claims = True
        families = wait(lambda f: "gpumem_exporter_claims_api_error_info" in f)
        assert families["gpumem_exporter_claims_api_up"][0].value == 0.0
        [error] = families["gpumem_exporter_claims_api_error_info"]
        assert "HTTP 403" in error.labels["error"]
        assert "gpu_dra_claim_memory_claimed_bytes" not in families
        assert families["gpu_dra_claim_info"]  # the kubelet's view stands without the API
    finally:
        runtime.sampler.stop()
        kubelet.stop()


@pytest.mark.slow
def test_a_dra_device_named_in_no_known_shape_resolves_through_the_nodes_resource_slices(
    api, tmp_path
):
    """Another DRA driver (named in GPUMEM_KUBELET_RESOURCES) names GPU 0 `accel-3`: the
    local map misses, the node's ResourceSlices say its UUID, and NVML reports that GPU. A
    slice naming a UUID NVML does not report names nothing, and its pod no row (issue 51)."""
    api.slices = [
        resource_slice(
            "dra.example.com", "gpu-node-1", {"accel-3": GPU0, "accel-4": "GPU-not-here"}
        )
    ]
    state = tmp_path / "kubelet.json"
    write_state(
        state,
        [
            claim_pod("research", "a", "c", "ka", dra_device("accel-3", driver="dra.example.com")),
            claim_pod("research", "b", "c", "kb", dra_device("accel-4", driver="dra.example.com")),
        ],
    )
    kubelet = StandInKubelet(tmp_path / "kubelet.sock", state).start()
    nvml = NvmlSource(FakeNvml(RAW))
    source = KubeletSource(
        lambda: nvml.last_pids,
        socket_path=str(tmp_path / "kubelet.sock"),
        refresh_s=0.2,
        resources=("gpu.nvidia.com", "dra.example.com"),
        claims=lambda: claims_client(api, tmp_path),
    )
    runtime = build_runtime(load_config(env={}), mode="node", sources=[nvml, source])
    http = TestClient(create_app(runtime))
    try:
        deadline = time.monotonic() + 10
        while True:
            runtime.sampler.tick()
            text = http.get("/metrics").text
            families = {f.name: f.samples for f in text_string_to_metric_families(text)}
            rows = {
                s.labels["device_id"]: s.labels["gpu_uuid"]
                for s in families.get("gpu_pod_info", [])
            }
            if rows.get("accel-3") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert rows == {"accel-3": GPU0}
        assert any("resourceslices" in r for r in api.requests)
    finally:
        runtime.sampler.stop()
        kubelet.stop()


@pytest.mark.slow
def test_nvidias_own_names_never_ask_for_resource_slices(api, tmp_path):
    state = tmp_path / "kubelet.json"
    write_state(state, [claim_pod("research", "a", "c", "ka", dra_device("gpu-0"))])
    kubelet = StandInKubelet(tmp_path / "kubelet.sock", state).start()
    source = KubeletSource(
        lambda: set(),
        socket_path=str(tmp_path / "kubelet.sock"),
        claims=lambda: claims_client(api, tmp_path),
    )
    try:
        source.refresh()
        source.refresh_pods()
        assert not any("resourceslices" in r for r in api.requests)
        assert any("resourceclaims" in r for r in api.requests)
    finally:
        source.close()
        kubelet.stop()


def reading_pods(source: KubeletSource) -> dict[str, tuple[str, str]] | None:
    """The pod names of the kubelet source's reading now."""
    kubelet = source.read().kubelet
    assert kubelet is not None
    return kubelet.pods


@pytest.mark.slow
def test_slow_claim_lists_never_hold_up_the_pod_names(api, tmp_path):
    """Round 4, LOW 11: the pod reader and the claim reader shared one thread: with claim
    lists taking 2.5 s each, a new pod was named 63 s after the API listed it, while
    gpumem_exporter_pods_api_up stayed 1. Each reader has its own thread now."""
    state = tmp_path / "kubelet.json"
    write_state(state, [claim_pod("research", "a", "c", "ka", dra_device("gpu-0"))])
    kubelet = StandInKubelet(tmp_path / "kubelet.sock", state).start()
    api.claims_delay_s = 3.0
    source = KubeletSource(
        lambda: set(),
        socket_path=str(tmp_path / "kubelet.sock"),
        refresh_s=0.2,
        pods=lambda: pods_client(api, tmp_path),
        claims=lambda: claims_client(api, tmp_path),
    )
    try:
        source.read()  # starts the threads
        time.sleep(0.5)  # the claim reader is now waiting on its slow list
        api.pods.append(pod("research", "newcomer", UID_B, {CRIO_ID: "worker"}))
        started = time.monotonic()
        while UID_B not in (reading_pods(source) or {}):
            assert time.monotonic() - started < 2.0, "named only after the claims' list"
            time.sleep(0.05)
    finally:
        api.claims_delay_s = 0.0
        source.close()
        kubelet.stop()
