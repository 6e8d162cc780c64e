"""The allocator source against readings captured on an H200 (tests/data/allocator_*.json,
made by scripts/capture_gpu_fixtures.py), and its context rules against a test double."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from exporter.oom_verdict import decide
from exporter.sources.torch_allocator import (
    TorchAllocatorSource,
    allocator_reading_from_stats,
    parse_alloc_conf,
)
from tests.conftest import DATA_DIR
from tests.helpers import FakeCuda, fake_torch


def capture(name: str) -> dict:
    return json.loads((DATA_DIR / f"allocator_{name}.json").read_text())


def reading_of(name: str):
    data = capture(name)
    return data, allocator_reading_from_stats(
        data["memory_stats_as_nested_dict"],
        device=0,
        gpu_uuid="GPU-" + data["device_uuid"],
        backend=data["allocator_backend"],
        expandable_segments="expandable_segments:True" in data["alloc_conf"],
    )


@pytest.mark.parametrize("name", ["native", "expandable", "async"])
def test_current_bytes_match_torch_and_the_flat_stats(name):
    data, reading = reading_of(name)
    flat = data["memory_stats"]
    assert reading.gauges["allocated_bytes"] == data["truth"]["memory_allocated"]
    assert reading.gauges["reserved_bytes"] == data["truth"]["memory_reserved"]
    assert reading.gauges["active_bytes"] == flat["active_bytes.all.current"]
    assert reading.gauges["allocated_peak_bytes"] == flat["allocated_bytes.all.peak"]
    assert reading.gauges["reserved_peak_bytes"] == flat["reserved_bytes.all.peak"]
    # Live tensors are part of what is allocated, never more.
    assert reading.gauges["allocated_bytes"] >= data["truth"]["live_tensor_bytes"]


def test_native_backend_reports_everything_it_tracks():
    data, reading = reading_of("native")
    flat = data["memory_stats"]
    assert reading.backend == "native" and not reading.expandable_segments
    assert reading.gauges["inactive_split_bytes"] == flat["inactive_split_bytes.all.current"] > 0
    assert reading.gauges["requested_bytes"] == flat["requested_bytes.all.current"]
    assert reading.gauges["segments"] == flat["segment.all.current"]
    assert reading.gauges["allocations"] == flat["allocation.all.current"]
    assert reading.counters == {
        "alloc_retries": flat["num_alloc_retries"],
        "ooms": flat["num_ooms"],
        "device_malloc": flat["num_device_alloc"],
        "device_free": flat["num_device_free"],
        "sync_all_streams": flat["num_sync_all_streams"],
    }
    for pool, key in (("large", "large_pool"), ("small", "small_pool")):
        assert reading.pools[pool]["reserved_bytes"] == flat[f"reserved_bytes.{key}.current"]
    pools_reserved = sum(p["reserved_bytes"] for p in reading.pools.values())
    assert pools_reserved == reading.gauges["reserved_bytes"]
    ratio = reading.fragmentation_ratio
    assert ratio == pytest.approx(
        flat["inactive_split_bytes.all.current"] / flat["reserved_bytes.all.current"]
    )
    assert reading.max_split_size_bytes is None  # -1: not set


def test_expandable_segments_hide_what_is_not_tracked():
    data, reading = reading_of("expandable")
    # The allocator reads 0 for these under expandable segments: left out, not exported as 0.
    assert data["memory_stats"]["inactive_split_bytes.all.current"] == 0
    assert data["memory_stats"]["segment.all.current"] == 0
    assert "inactive_split_bytes" not in reading.gauges
    assert "segments" not in reading.gauges
    assert all("inactive_split_bytes" not in p for p in reading.pools.values())
    assert reading.fragmentation_ratio is None
    assert reading.cached_free_ratio == pytest.approx(
        1 - data["truth"]["memory_allocated"] / data["truth"]["memory_reserved"]
    )


def test_cuda_malloc_async_reports_only_its_defined_numbers():
    data, reading = reading_of("async")
    assert data["allocator_backend"] == "cudaMallocAsync"
    assert set(reading.gauges) == {
        "allocated_bytes",
        "reserved_bytes",
        "active_bytes",
        "allocated_peak_bytes",
        "reserved_peak_bytes",
    }
    assert reading.counters == {} and reading.pools == {}
    assert reading.fragmentation_ratio is None
    assert reading.cached_free_ratio is not None


def test_parse_alloc_conf_reads_both_variable_names():
    assert parse_alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True, a:1"}) == {
        "expandable_segments": "True",
        "a": "1",
    }
    assert parse_alloc_conf({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}) == {
        "backend": "cudaMallocAsync"
    }
    assert parse_alloc_conf({}) == {}


def test_nothing_is_touched_before_cuda_is_initialized():
    cuda = FakeCuda(capture("native")["memory_stats_as_nested_dict"], False, set())
    reading = TorchAllocatorSource(fake_torch(cuda), env={}).read()
    assert reading.allocators == [] and cuda.calls == []


def test_only_devices_with_a_context_are_read_with_explicit_indices():
    cuda = FakeCuda(capture("native")["memory_stats_as_nested_dict"], True, {1})
    source = TorchAllocatorSource(fake_torch(cuda), env={})
    reading = source.read()
    assert [a.device for a in reading.allocators] == [1]
    assert [a.gpu_uuid for a in reading.allocators] == ["GPU-0000-1"]
    assert {call[1] for call in cuda.calls} == {1}


def test_the_memory_cap_is_read_as_the_allocator_computes_it_only_where_torch_has_it():
    cuda = FakeCuda(capture("native")["memory_stats_as_nested_dict"], True, {0, 1})
    cuda.get_device_properties = lambda i: SimpleNamespace(  # type: ignore[method-assign]
        uuid=f"0000-{i}", total_memory=80 << 30
    )
    torch = fake_torch(cuda)
    fractions = {0: 0.25, 1: 1.0}  # what set_per_process_memory_fraction left
    torch._C._cuda_getMemoryFraction = lambda i: fractions[i]
    source = TorchAllocatorSource(torch, env={})
    limits = {a.device: a.gauges["memory_limit_bytes"] for a in source.read().allocators}
    assert limits == {0: 20 << 30, 1: 80 << 30}
    fractions.update({0: 0.5, 1: 0.5})  # set again while serving: seen
    assert {a.gauges["memory_limit_bytes"] for a in source.read().allocators} == {40 << 30}
    # cudaMallocAsync without a cap answers 2^64 / total (an H100, torch 2.11): the device's.
    fractions.update({0: (1 << 64) / (80 << 30), 1: 1.0})
    assert {a.gauges["memory_limit_bytes"] for a in source.read().allocators} == {80 << 30}
    del torch._C._cuda_getMemoryFraction  # torch before 2.8: no getter, no series
    source = TorchAllocatorSource(torch, env={})
    assert all("memory_limit_bytes" not in a.gauges for a in source.read().allocators)


def test_expandable_setting_comes_from_the_environment():
    cuda = FakeCuda(capture("expandable")["memory_stats_as_nested_dict"], True, {0}, count=1)
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    (reading,) = TorchAllocatorSource(fake_torch(cuda), env=env).read().allocators
    assert reading.expandable_segments and "inactive_split_bytes" not in reading.gauges


def test_without_the_private_context_api_unused_devices_are_filtered_by_their_stats():
    used = capture("native")["memory_stats_as_nested_dict"]
    untouched = {k: v for k, v in used.items() if not isinstance(v, dict)}
    untouched["reserved_bytes"] = {"all": {"current": 0, "peak": 0}}

    class TwoDevices(FakeCuda):
        def memory_stats_as_nested_dict(self, device=None):
            super().memory_stats_as_nested_dict(device)
            return used if device == 0 else untouched

    cuda = TwoDevices(used, True, set())
    reading = TorchAllocatorSource(fake_torch(cuda, with_context_api=False), env={}).read()
    assert [a.device for a in reading.allocators] == [0]


def test_without_torch_imported_the_source_reports_nothing(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert TorchAllocatorSource(env={}).read().allocators == []


def test_an_allocation_retry_reads_the_layout_at_once_at_most_once_a_second(monkeypatch):
    """The layout behind GpuMemAllocRetries' "fragmentation building" is that of the retry,
    not up to 10 s old; a retry storm reads it at most once a second."""
    import copy

    import exporter.sources.torch_allocator as module

    data = capture("native")
    cuda = FakeCuda(copy.deepcopy(data["memory_stats_as_nested_dict"]), True, {0}, count=1)
    cuda.get_allocator_backend = lambda: "native"  # type: ignore[method-assign]
    torch = fake_torch(cuda)
    snapshots: list[object] = []

    def snapshot(pool: object) -> dict:
        snapshots.append(pool)
        return data["snapshot"]

    torch._C._cuda_memorySnapshot = snapshot
    now = [1000.0]
    monkeypatch.setattr(module.time, "time", lambda: now[0])
    source = TorchAllocatorSource(torch, env={}, layout_interval_s=3600.0)
    source.read()
    assert len(snapshots) == 1  # the first tick reads it; the next is an hour away
    now[0] += 5
    source.read()
    assert len(snapshots) == 1  # no retry: not read
    cuda.stats["num_alloc_retries"] += 1
    now[0] += 5
    reading = source.read().allocators[0]
    assert len(snapshots) == 2 and reading.layout_age_s == 0.0
    cuda.stats["num_alloc_retries"] += 1
    now[0] += 0.5
    source.read()
    assert len(snapshots) == 2  # within a second of the last read
    cuda.stats["num_alloc_retries"] += 1
    now[0] += 1.0
    source.read()
    assert len(snapshots) == 3


def test_the_light_snapshot_at_an_oom_is_refused_over_the_block_limit_or_while_recording():
    """At an OOM the verdict's snapshot must not stall the OOM-ing thread: over
    GPUMEM_LAYOUT_MAX_BLOCKS blocks, or with history recording, it is not taken."""
    import copy

    data = capture("native")
    cuda = FakeCuda(copy.deepcopy(data["memory_stats_as_nested_dict"]), True, {0}, count=1)
    torch = fake_torch(cuda)
    taken: list[object] = []

    def snapshot(pool: object) -> dict:
        taken.append(pool)
        return data["snapshot"]

    torch._C._cuda_memorySnapshot = snapshot
    recording = [False]
    torch._C._cuda_isHistoryEnabled = lambda: recording[0]
    source = TorchAllocatorSource(torch, env={}, layout_interval_s=0, layout_max_blocks=10_000)
    source.read()
    assert source.light_snapshot() is data["snapshot"] and taken == [(0, 0, False)]
    source._layout_max_blocks = 10  # the capture's allocator has more blocks than this
    with pytest.raises(RuntimeError, match="blocks: a snapshot would stall"):
        source.light_snapshot()
    source._layout_max_blocks = 10_000
    recording[0] = True
    with pytest.raises(RuntimeError, match="history recording is on"):
        source.light_snapshot()
    assert len(taken) == 1


def test_a_torch_built_without_cuda_is_said_so_not_waited_for():
    """Issue 54: with a CPU-only torch (this machine's wheel), "no GPU in use by this process
    (yet)" waited for a GPU this torch can never use. The torch source and the NVML source
    of an embedded exporter say what it is."""
    torch = pytest.importorskip("torch")
    if torch.version.cuda or getattr(torch.version, "hip", None):
        pytest.skip("this torch has CUDA (the GPU machine)")
    from exporter.config import Config
    from exporter.runtime import sources_for
    from exporter.sources.torch_allocator import NO_CUDA_BUILD

    made = {source.name: source for source in sources_for("embedded", Config())}
    assert made["torch"].read().unavailable == NO_CUDA_BUILD
    assert made["nvml"].read().unavailable == NO_CUDA_BUILD


def test_a_switch_the_snapshot_finds_shows_in_the_same_reading(monkeypatch):
    """The server turns expandable segments on while it runs (vLLM around its CuMem pool):
    the read whose layout snapshot finds it takes its numbers under the setting in force, so
    the switch shows at once, not one layout interval later (seen on an H200)."""
    import copy
    import time

    data = capture("native")
    cuda = FakeCuda(copy.deepcopy(data["memory_stats_as_nested_dict"]), True, {0}, count=1)
    torch = fake_torch(cuda)
    snapshot = copy.deepcopy(data["snapshot"])
    torch._C._cuda_memorySnapshot = lambda pool: snapshot
    source = TorchAllocatorSource(torch, env={}, layout_interval_s=0.01)
    first = source.read().allocators[0]
    assert first.expandable_segments is False and "inactive_split_bytes" in first.gauges
    snapshot["allocator_settings"]["expandable_segments"] = True
    time.sleep(0.02)
    switched = source.read().allocators[0]
    assert switched.settings["expandable_segments"] == "true"
    assert switched.expandable_segments is True
    assert "inactive_split_bytes" not in switched.gauges  # not tracked with expandable segments
    assert switched.gauges["reserved_bytes"] == first.gauges["reserved_bytes"]


def test_an_oom_verdict_names_a_pool_the_server_named(monkeypatch):
    """Issue 65: a pool the server named (exporter.name_pool) was only in a full-detail series;
    its OOM verdict, which `why`, the page and /stats show, named it by id alone. The
    observer's snapshot here: one segment of the capture moved to pool 0_1, all of it free."""
    import copy

    from exporter import pools

    data = capture("native")
    cuda = FakeCuda(copy.deepcopy(data["memory_stats_as_nested_dict"]), True, {0}, count=1)
    source = TorchAllocatorSource(fake_torch(cuda), env={}, layout_interval_s=0)
    segments = copy.deepcopy(data["snapshot"]["segments"])
    stranded = segments[0]
    stranded["segment_pool_id"] = [0, 1]
    for block in stranded["blocks"]:
        block["state"] = "inactive"
    stranded["allocated_size"] = stranded["active_size"] = 0
    names = pools.PoolNames()
    monkeypatch.setattr(pools, "registry", lambda: names)
    monkeypatch.setattr("exporter.sources.torch_allocator.pool_registry", lambda: names)
    names.name((0, 1), "kv_cache")
    total = stranded["total_size"]
    verdict = decide(source.read_oom(0, 2 * total, 1 << 40, total, segments=segments))
    assert verdict.private_pools_free["0_1"] == total  # beside the capture's own graph pool
    assert verdict.private_pool_names == {"0_1": "kv_cache"}
    assert verdict.verdict == "pools" and "pool kv_cache (0_1) " in verdict.reason, verdict
