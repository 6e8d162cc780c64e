"""Every OOM verdict made on purpose in a real CUDA process: the exporter names the cause, and
each deciding number equals torch's and NVML's own readings taken in the same observer call
(tests/support/oom_scenarios.py). Run on the GPU machine: `pytest -m gpu`."""

from __future__ import annotations

import pytest

from tests.conftest import run_support_script

GiB = 1 << 30

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _scenario(name: str, alloc_conf: str = "") -> dict:
    return run_support_script("oom_scenarios.py", name, alloc_conf=alloc_conf)


def _check_numbers(r: dict) -> dict:
    """The verdict's readings against the independent ones; returns the verdict."""
    assert r["raised"], "the scenario did not run out of memory"
    reading, truth = r["reading"], r["truth"]
    oom = reading["last_oom"]
    assert oom is not None, "no verdict on the allocator reading"
    assert oom["requested_bytes"] == truth["requested"]
    assert oom["reserved_bytes"] == truth["reserved"]
    assert oom["allocated_bytes"] == truth["allocated"]
    assert oom["free_in_holes_bytes"] == truth["holes"]
    assert oom["largest_free_block_bytes"] == truth["largest"]
    assert oom["device_free_bytes"] == truth["device_free"]
    assert oom["device_total_bytes"] == truth["total"]
    capped = truth["fraction"] < 1.0
    assert oom["memory_limit_bytes"] == (truth["limit_or_total"] if capped else None)
    assert oom["other_processes_bytes"] == sum(truth["others"].values())
    assert reading["ooms_by_verdict"] == {oom["verdict"]: 1}
    assert reading["counters"]["ooms"] == 1
    # The OOM's snapshot is written, listed with trigger oom and linked from the verdict.
    listed = {s["id"]: s for s in r["snapshots"]}
    assert oom["snapshot"] in listed and listed[oom["snapshot"]]["trigger"] == "oom"
    assert listed[oom["snapshot"]]["meta"]["oom"]["verdict"] == oom["verdict"]
    return oom


def test_a_shattered_cache_under_a_cap_is_fragmentation():
    oom = _check_numbers(_scenario("fragmentation"))
    assert oom["verdict"] == "fragmentation", oom
    assert oom["free_in_holes_bytes"] >= oom["requested_bytes"] > oom["largest_free_block_bytes"]
    assert "expandable_segments:True" in oom["action"]


def test_expandable_segments_prevent_the_fragmentation_oom_as_the_verdict_advises():
    # The same shattered cache with expandable segments: PyTorch's flush unmaps the free pages
    # between live tensors, so the request that failed natively is served.
    r = _scenario("fragmentation", "expandable_segments:True")
    assert not r["raised"]
    assert r["reading"]["last_oom"] is None and r["reading"]["expandable_segments"] is True


def test_a_cap_with_expandable_segments_is_cap():
    oom = _check_numbers(_scenario("cap", "expandable_segments:True"))
    assert oom["expandable_segments"] is True
    assert oom["verdict"] == "cap", oom


def test_a_cap_with_room_on_the_gpu_is_cap():
    oom = _check_numbers(_scenario("cap"))
    assert oom["verdict"] == "cap", oom
    assert oom["device_free_bytes"] >= oom["requested_bytes"]
    assert oom["memory_limit_bytes"] is not None


def test_another_process_filling_the_gpu_is_other_processes():
    r = _scenario("other_processes")
    oom = _check_numbers(r)
    assert oom["verdict"] == "other_processes", oom
    assert oom["other_processes"][0][0] == r["holder_pid"]
    assert f"pid {r['holder_pid']}" in oom["action"]


def test_live_tensors_filling_the_gpu_is_exhaustion():
    oom = _check_numbers(_scenario("exhaustion"))
    assert oom["verdict"] == "exhaustion", oom
    assert oom["free_in_holes_bytes"] < oom["requested_bytes"]
    assert oom["memory_limit_bytes"] is None


def test_memory_stranded_in_a_live_mempool_is_pools():
    """Issue 52: the default pool's request fails under a cap while a MemPool holds free
    memory it cannot use: verdict `pools`, naming the pool, its free bytes the walk's."""
    r = _scenario("pools")
    oom = _check_numbers(r)
    assert oom["verdict"] == "pools", oom
    assert oom["private_pools_free_bytes"] == r["truth"]["pools_free"] >= 4 * GiB
    assert oom["private_pools_free"][r["pool_id"]] >= 4 * GiB
    assert f"pool kv_cache ({r['pool_id']}) " in oom["reason"]  # the name the server gave it
    assert oom["private_pool_names"] == {r["pool_id"]: "kv_cache"}


def test_cupy_filling_the_gpu_in_the_same_process_is_outside_allocator():
    """Issue 52: CuPy's pool in this process holds most of the GPU, then torch's request
    fails: verdict `outside_allocator`, CuPy's bytes within 1 % of what it names outside."""
    r = _scenario("outside_allocator")
    if "skipped" in r:
        pytest.skip(r["skipped"])
    oom = _check_numbers(r)
    assert oom["verdict"] == "outside_allocator", oom
    assert abs(oom["outside_allocator_bytes"] - r["cupy_bytes"]) <= 0.01 * r["cupy_bytes"], oom
