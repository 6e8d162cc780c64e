"""A kubelet answer no node gives (100k GPU assignments, issue 38) against the real node
daemon: refused as a state, the last good assignment kept, and no memory held afterwards."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import running
from tests.support.kubelet_standin import StandInKubelet, pod, write_state

GPU = "GPU-e76e1db6-ac0c-0dc6-7fb6-2f49a86e32fa"


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def wait_for(url: str, check, timeout_s: float = 60.0) -> dict[str, list]:
    deadline = time.monotonic() + timeout_s
    while True:
        families = scrape(url)
        if check(families):
            return families
        why = families.get("gpumem_exporter_kubelet_error_info")
        assert time.monotonic() < deadline, f"never; kubelet error: {why}"
        time.sleep(0.2)


def rss(families) -> float:
    return families["process_resident_memory_bytes"][0].value


@pytest.mark.slow
def test_a_kubelet_answer_of_100k_assignments_is_refused_and_leaves_no_memory(tmp_path):
    state, sock = tmp_path / "state.json", tmp_path / "kubelet.sock"
    one = [pod("serving", "llama-0", "server", GPU)]
    write_state(state, one)
    kubelet = StandInKubelet(sock, state).start()
    env = {
        "GPUMEM_KUBELET_SOCKET": str(sock),
        "GPUMEM_KUBELET_REFRESH_S": "0.2",
        "GPUMEM_KUBELET_TIMEOUT_S": "60",  # the stand-in takes seconds to build 100k rows
    }
    try:
        with running("serve", env=env, wait_for="/healthz") as url:
            families = wait_for(url, lambda f: f.get("gpu_pod_info"))
            for _ in range(3):  # the first scrapes settle the daemon's own allocations
                before = rss(scrape(url))
            flood = [pod("ns", f"pod-{i:06d}", "server", f"{GPU}::{i}") for i in range(100_000)]
            write_state(state, flood)
            # The refusal is on /metrics from the tick after the refused answer.
            families = wait_for(url, lambda f: "gpumem_exporter_kubelet_error_info" in f)
            assert len(families.get("gpu_pod_info", [])) == 1  # the last good assignment
            [error] = families["gpumem_exporter_kubelet_error_info"]
            assert "100000 GPU assignments" in error.labels["error"]
            write_state(state, one)
            families = wait_for(url, lambda f: f["gpumem_exporter_kubelet_up"][0].value == 1)
            after = rss(scrape(url))
            assert after - before < 32 << 20, (before, after)  # it was ~260 MB, kept
    finally:
        kubelet.stop()
