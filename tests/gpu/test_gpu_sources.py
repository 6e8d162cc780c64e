"""The accelerator seam on a real GPU: the torch.accelerator allocator source gives the same
numbers as the torch.cuda one, on every allocator backend (all but the memory cap, which only
torch.cuda reports), and touches no other device."""

from __future__ import annotations

import pytest

from tests.conftest import run_support_script

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True", "backend:cudaMallocAsync"])
def test_the_accelerator_source_reads_what_the_cuda_source_reads(alloc_conf):
    r = run_support_script("gpu_scenarios.py", "accelerator_source", "0", alloc_conf=alloc_conf)
    for cuda_readings, accelerator_readings in r["pairs"]:
        assert len(cuda_readings) == 1 and cuda_readings == accelerator_readings, r
    # The cap (torch.cuda's fraction x total memory) comes from the cuda source alone.
    assert all(cuda == r["total"] and accelerator is None for cuda, accelerator in r["caps"])
    reading = r["pairs"][0][0][0]
    assert reading["gauges"]["allocated_bytes"] > 0 and reading["gpu_uuid"] == r["used_uuid"]
    assert r["uuids_in_use"] == [[r["used_uuid"]], [r["used_uuid"]]]


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_accelerator_source_reads_only_the_device_in_use():
    r = run_support_script("gpu_scenarios.py", "accelerator_source", "1")
    assert r["has_context"] == [False, True]
    assert r["pid_on_gpus"] == [r["used_uuid"]]
    assert [reading["device"] for reading in r["pairs"][-1][1]] == [1]
