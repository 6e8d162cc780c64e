"""GPU memory by namespace on a MIG node, end to end with a real Prometheus server.

A node daemon (the real runtime, sources, collector and HTTP server, in this process) reads
NVML through the double made only from the real H100 MIG capture under load
(tests/support/mig_nvml.py: GPU instances 2, 3, 9 and 10, 11091, 17, 9 and 9 MiB used) and
asks a stand-in kubelet (a real gRPC server) which pod holds each MIG device, by the device
plugin's MIG-<uuid>. Prometheus scrapes it as the chart's ServiceMonitor does and evaluates
the shipped rules: each namespace gets its own GPU instances' memory, not the whole GPU's once
per namespace.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from exporter.sources.kubelet import KubeletSource
from exporter.sources.nvml import NvmlSource
from tests.conftest import require_tool
from tests.helpers import Cluster, daemon_under_prometheus, values
from tests.support.kubelet_standin import StandInKubelet, pod, write_state
from tests.support.mig_nvml import CapturedNvml
from tests.support.nvidia_smi_capture import MIB, read

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

[GPU] = read("h100-mig", "load")
BY_INSTANCE = {m.gpu_instance_id: m for m in GPU.mig_devices}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("mig")
    state = tmp / "kubelet.json"
    write_state(
        state,
        [
            pod("llm", "vllm-0", "server", BY_INSTANCE[2].uuid, resource="nvidia.com/mig-3g.40gb"),
            pod(
                "search", "rerank-0", "app", BY_INSTANCE[3].uuid, resource="nvidia.com/mig-2g.20gb"
            ),
            pod(
                "search", "rerank-1", "app", BY_INSTANCE[9].uuid, resource="nvidia.com/mig-1g.10gb"
            ),
        ],
    )
    kubelet = StandInKubelet(tmp / "kubelet.sock", state).start()
    nvml = NvmlSource(CapturedNvml("h100-mig", "load"))
    source = KubeletSource(
        lambda: nvml.last_pids, socket_path=str(tmp / "kubelet.sock"), refresh_s=0.5
    )
    try:
        with daemon_under_prometheus(tmp, [nvml, source]) as url:
            yield Cluster(url, state, None)
    finally:
        kubelet.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_memory_by_namespace_counts_each_pods_gpu_instance(cluster):
    cluster.wait('namespace:gpu_memory_used_bytes:sum{namespace="search"}')  # rules evaluated
    found = cluster.query("namespace:gpu_memory_used_bytes:sum")
    expected = {
        "llm": BY_INSTANCE[2].memory.used * MIB,
        "search": (BY_INSTANCE[3].memory.used + BY_INSTANCE[9].memory.used) * MIB,
    }
    assert values(found, "namespace") == expected
    by_pod = values(cluster.wait("namespace_pod:gpu_memory_used_bytes:sum"), "pod")
    assert by_pod == {
        "vllm-0": 11091 * MIB,  # the capture's GPU instance 2, not the whole GPU's 11125
        "rerank-0": 17 * MIB,
        "rerank-1": 9 * MIB,
    }
    # The whole GPU's series stay, exact: every instance's memory and its own.
    [whole] = cluster.query("gpu_memory_used_bytes")
    assert float(whole["value"][1]) == GPU.memory.used * MIB
    [row] = cluster.query('gpu_mig_non_process_memory_bytes{gpu_instance="2"}')
    assert float(row["value"][1]) == 39 * MIB  # 11091 used, 11052 by its three processes
