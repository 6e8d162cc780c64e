"""Kubernetes attribution end to end with a real Prometheus server (Debian package `prometheus`).

A node daemon (the real runtime, sources, collector and HTTP server, in this process: NVML
values captured on an H200 through tests/support/nvml_double, cgroup files in a /proc tree of
the test's own) asks a stand-in kubelet (a real gRPC server on a unix socket,
tests/support/kubelet_standin) which pod holds each GPU. Prometheus scrapes it as the chart's
ServiceMonitor does (honor_labels, the daemon's own pod as target labels) and evaluates
deploy/prometheus/ rules every second:
- "GPU memory by namespace" and by pod/container come out of the recording rules;
- the GPU moves to another pod and the answer follows;
- a GPU that no pod holds fires GpuMemoryHeldOutsideAnyPod (its `for:` shortened to 3 s);
- every dashboard query on attribution series returns data (the demo has no kubelet);
- a GPU a ResourceClaim gave (DRA, NVIDIA's driver naming it by its minor) counts in the same
  rules, and is unattributed once the claim goes.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator

import pytest

from exporter.kubernetes.claims import ClaimsClient
from exporter.kubernetes.pods import PodsClient
from exporter.sources.kubelet import KubeletSource
from exporter.sources.nvml import NvmlSource
from tests.conftest import DATA_DIR, REPO_ROOT, require_tool
from tests.helpers import (
    Cluster,
    daemon_under_prometheus,
    iter_panel_queries,
    needs_kubelet,
    values,
)
from tests.support.kube_api_standin import CRIO_ID, TOKEN, UID_A, UID_B, StandInApi, resource_claim
from tests.support.kube_api_standin import pod as api_pod
from tests.support.kubelet_standin import (
    StandInKubelet,
    claim_pod,
    dra_device,
    pod,
    write_state,
)
from tests.support.nvml_double import FakeNvml

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RAW = json.loads((DATA_DIR / "allocator_native.json").read_text())["nvml_raw"]
GPU0, GPU1 = (d["uuid"] for d in RAW["devices"])
USED0 = RAW["devices"][0]["memory_v2"]["used"]
PID = RAW["devices"][0]["processes"][0]["pid"]
PID_USED = RAW["devices"][0]["processes"][0]["usedGpuMemory"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    require_tool("prometheus")  # before anything starts: a missing server skips at once
    tmp = tmp_path_factory.mktemp("k8s")
    proc = tmp / "proc" / str(PID)
    proc.mkdir(parents=True)
    # The process holding GPU 0 runs in a pod's container (systemd driver, CRI-O).
    proc.joinpath("cgroup").write_bytes((DATA_DIR / "cgroup" / "v2-systemd-crio.txt").read_bytes())
    # And says it is that pod: its hostname and namespace (exporter.kubernetes.cgroup).
    (proc / "root" / "etc").mkdir(parents=True)
    (proc / "root" / "etc" / "hostname").write_text("llama-0\n")
    state = tmp / "kubelet.json"
    write_state(state, [pod("serving", "llama-0", "server", f"{GPU0}::0")])
    kubelet = StandInKubelet(tmp / "kubelet.sock", state).start()
    # The Kubernetes API (real HTTPS) for the pod reader and the claim reader.
    api = StandInApi(tmp, TOKEN)
    api.pods = [
        api_pod("serving", "llama-0", UID_A, {"server": CRIO_ID}),
        api_pod("research", "notebook-b", UID_B, {"jupyter": "b" * 64}),
    ]
    (tmp / "token").write_text(TOKEN)

    fake = FakeNvml(RAW)
    fake.minor_numbers = {0: 1, 1: 0}  # GPU 0 is /dev/nvidia1: DRA names it gpu-1
    nvml = NvmlSource(fake)
    source = KubeletSource(
        lambda: nvml.last_pids,
        socket_path=str(tmp / "kubelet.sock"),
        refresh_s=0.5,
        proc=str(tmp / "proc"),
        pods=lambda: PodsClient("gpu-node-1", api=api.client_api(tmp / "token")),
        claims=lambda: ClaimsClient(api.client_api(tmp / "token"), "gpu-node-1"),
    )
    try:
        with daemon_under_prometheus(tmp, [nvml, source]) as url:
            yield Cluster(url, state, api)
    finally:
        api.stop()
        kubelet.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_gpu_memory_by_namespace_pod_and_container(cluster):
    by_namespace = cluster.wait('namespace:gpu_memory_used_bytes:sum{namespace="serving"}')
    assert values(by_namespace, "namespace") == {"serving": USED0}
    [row] = cluster.wait("namespace_pod_container:gpu_memory_used_bytes:sum")
    assert row["metric"] | {} == {
        "__name__": "namespace_pod_container:gpu_memory_used_bytes:sum",
        "cluster": "e2e",
        "namespace": "serving",
        "pod": "llama-0",
        "container": "server",
    }
    assert float(row["value"][1]) == USED0
    [process] = cluster.wait("namespace_pod_container:gpu_container_memory_used_bytes:sum")
    assert process["metric"]["pod"] == "llama-0" and float(process["value"][1]) == PID_USED
    # The pod dashboard's panel of its GPUs' memory by container (while the pod holds GPU 0).
    [(title, expr)] = [
        (title, expr)
        for title, expr in iter_panel_queries(REPO_ROOT / "dashboards" / "gpumem-pod.json")
        if "gpu_container_memory_used_bytes" in expr
    ]
    expr = (
        expr.replace("$cluster", ".*").replace("$namespace", "serving").replace("$pod", "llama-0")
    )
    [by_container] = cluster.wait(expr)
    assert by_container["metric"]["container"] == "server", title
    assert float(by_container["value"][1]) == PID_USED
    # The daemon's own series keep their target labels: only the info series carry the
    # kubelet's names (honor_labels), so the device series' identity never changes hands.
    [used] = cluster.query(f'gpu_memory_used_bytes{{gpu_uuid="{GPU0}"}}')
    assert used["metric"]["pod"] == "gpumem-node-x"
    assert not cluster.query("ALERTS{alertname=~'GpuMemoryHeldOutsideAnyPod|GpuNodeDaemonBlind'}")


def test_a_gpu_moving_pods_and_then_to_no_pod(cluster):
    cluster.wait("namespace_pod_container:gpu_memory_used_bytes:sum")
    write_state(cluster.state, [pod("batch", "embed-7", "worker", f"{GPU0}::0")])
    moved = cluster.wait('namespace:gpu_memory_used_bytes:sum{namespace="batch"}', timeout_s=15)
    assert values(moved, "namespace") == {"batch": USED0}

    # The pod gets the other GPU instead: all of GPU 0's memory is held outside any pod.
    write_state(cluster.state, [pod("batch", "embed-7", "worker", GPU1)])
    alerts = cluster.wait(
        'ALERTS{alertname="GpuMemoryHeldOutsideAnyPod", alertstate="firing"}', timeout_s=30
    )
    assert [a["metric"]["gpu_uuid"] for a in alerts] == [GPU0]
    # All of GPU 0 once the daemon has read the move. The alert alone does not say so: it
    # fires as well while embed-7 still holds GPU 0, whose memory is then the llama-0 process's
    # (held outside its pod: counted), and a query right after it read that (a full run here).
    unattributed = f'gpu_memory_unattributed_bytes{{gpu_uuid="{GPU0}"}}'
    [outside] = cluster.wait(f"{unattributed} == {USED0}", timeout_s=15) or cluster.query(
        unattributed
    )
    assert float(outside["value"][1]) == USED0


def test_every_attribution_query_of_the_dashboards_has_data(cluster):
    """After the test above: a GPU in a pod, and one that no pod holds with a process on it."""
    cluster.wait("namespace:gpu_memory_used_bytes:sum")
    cluster.wait("gpu_process_memory_unattributed_bytes")
    queries = [
        (path.name, title, expr)
        for path in sorted((REPO_ROOT / "dashboards").glob("*.json"))
        for title, expr in iter_panel_queries(path)
        # A pod's own GPUs by container: checked above, while a pod holds the GPU; claims:
        # checked below, while claims share a GPU.
        if needs_kubelet(expr)
        and "gpu_container_memory_used_bytes" not in expr
        and "gpu_dra_claim_memory" not in expr
    ]
    assert queries, "the dashboards have no attribution panel"
    empty = []
    for name, title, expr in queries:
        expr = expr.replace('cluster=~"$cluster"', 'cluster=~".*"')
        expr = expr.replace('namespace=~"$namespace"', 'namespace=~".*"')
        if not cluster.wait(expr, timeout_s=10):
            empty.append(f"{name}: {title}: {expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_a_gpu_a_claim_gave_counts_in_the_rules_like_any_other(cluster):
    """Issue 37: on a DRA node every GPU was "held by no pod". The claim's GPU 0 (gpu-1: its
    minor) counts for its pod's namespace; the claim gone, its memory is unattributed."""
    claim = claim_pod("research", "notebook-1", "jupyter", "notebook-gpu", dra_device("gpu-1"))
    write_state(cluster.state, [claim])
    by_namespace = cluster.wait(
        'namespace:gpu_memory_used_bytes:sum{namespace="research"}', timeout_s=15
    )
    assert values(by_namespace, "namespace") == {"research": USED0}
    [info] = cluster.wait("gpu_dra_claim_info")
    assert (info["metric"]["claim"], info["metric"]["gpu_uuid"]) == ("notebook-gpu", GPU0)
    # docs/deploy.md's query of GPU memory by claim.
    deploy = (REPO_ROOT / "docs" / "deploy.md").read_text()
    query = deploy.split("# GPU memory by ResourceClaim", 1)[1].split("\n", 1)[1]
    query = query.split("```", 1)[0]
    [by_claim] = cluster.wait(query)
    assert by_claim["metric"] == {"claim_namespace": "research", "claim": "notebook-gpu"}
    assert float(by_claim["value"][1]) == USED0
    write_state(cluster.state, [])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        [outside] = cluster.query(f'gpu_memory_unattributed_bytes{{gpu_uuid="{GPU0}"}}')
        if float(outside["value"][1]) == USED0:
            break
        time.sleep(0.5)
    assert float(outside["value"][1]) == USED0


def test_claims_sharing_a_gpu_show_claimed_against_used(cluster):
    """Two claims share GPU 0 (consumable capacity): llama-0's process (its pod UID, named by
    the pod reader) uses PID_USED of its 1 MiB claim: the fleet dashboard's panel draws
    both claims, and GpuDraClaimOverMemory's expression finds llama-0's."""
    cluster.api.claims = {
        "serving": [resource_claim("serving", "llama-share", ("gpu-1", "7f3a", "1Mi"))],
        "research": [resource_claim("research", "nb-share", ("gpu-1", "9c1e", "20Gi"))],
    }
    share = {"serving": "7f3a", "research": "9c1e"}
    write_state(
        cluster.state,
        [
            claim_pod(ns, name, container, claim, dra_device("gpu-1", share_id=share[ns]))
            for ns, name, container, claim in (
                ("serving", "llama-0", "server", "llama-share"),
                ("research", "notebook-b", "jupyter", "nb-share"),
            )
        ],
    )
    [(title, claimed), (_, used)] = [
        (title, expr)
        for title, expr in iter_panel_queries(REPO_ROOT / "dashboards" / "gpumem-fleet.json")
        if "gpu_dra_claim_memory" in expr
    ]
    claimed = claimed.replace("$cluster", ".*")
    used = used.replace("$cluster", ".*")
    rows = cluster.wait(claimed, timeout_s=20)
    assert values(rows, "claim") == {"llama-share": 1 << 20, "nb-share": 20 << 30}, title
    rows = cluster.wait(used, timeout_s=20)
    assert values(rows, "claim") == {"llama-share": PID_USED, "nb-share": 0.0}, title
    over = cluster.wait("gpu_dra_claim_memory_used_bytes > gpu_dra_claim_memory_claimed_bytes")
    assert [r["metric"]["claim"] for r in over] == ["llama-share"]
