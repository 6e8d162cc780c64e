"""The probe on a real GPU: each tick's record carries exactly the numbers the full allocator
source reads (gauges, the memory cap, pools, counters; pinned host memory travels in the full
sample), it finds nothing and initializes nothing before the process uses CUDA, and it touches
no other device.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_probe.py`.
"""

from __future__ import annotations

import pytest

from tests.conftest import run_support_script

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_a_record_carries_what_the_full_source_reads():
    r = run_support_script("gpu_scenarios.py", "probe_records", "0")
    assert r["before"] == 0 and r["initialized_before"] is False
    for pair in r["pairs"]:
        assert len(pair["full"]) == 1 and pair["records"] == pair["full"], pair
        assert pair["record_pinned"] == [[]] and pair["full_pinned"][0][0] > 0, pair
    gauges = r["pairs"][0]["records"][0]["gauges"]
    assert gauges["allocated_bytes"] > 0 and gauges["memory_limit_bytes"] > 0


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_probe_reads_only_the_device_in_use():
    r = run_support_script("gpu_scenarios.py", "probe_records", "1")
    assert r["has_context"][:2] == [False, True]
    assert [record["device"] for record in r["pairs"][-1]["records"]] == [1]
