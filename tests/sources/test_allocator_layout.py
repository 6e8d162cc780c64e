"""The allocator layout (largest free block, free bytes in used segments, private pools,
pinned host memory) against snapshots captured on an H200 (tests/data/allocator_*.json, made
by scripts/capture_gpu_fixtures.py with a plain walk of every block as the truth), and the
reader's guards against a test double."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from exporter.sources.allocator_layout import (
    MAX_PRIVATE_POOLS,
    LayoutReader,
    bounded_pools,
    layouts_from_segments,
)
from exporter.sources.torch_allocator import TorchAllocatorSource
from tests.conftest import DATA_DIR


def capture(name: str) -> dict:
    return json.loads((DATA_DIR / f"allocator_{name}.json").read_text())


@pytest.mark.parametrize("name", ["native", "expandable"])
def test_layout_equals_a_plain_walk_of_every_block(name):
    data = capture(name)
    (layout,) = layouts_from_segments(data["snapshot"]["segments"]).values()
    walk = data["truth"]["snapshot_walk"]
    assert layout.as_gauges() == {k: walk[k] for k in layout.as_gauges()}
    assert layout.private_pools == walk["private_pools"]
    # What the exporter's own source read live on the GPU, just before the snapshot.
    (live,) = data["exporter_allocators"]
    assert live["layout"] == layout.as_gauges()
    assert live["private_pools"] == walk["private_pools"]


def test_native_free_bytes_in_used_segments_are_inactive_split():
    data = capture("native")
    (layout,) = layouts_from_segments(data["snapshot"]["segments"]).values()
    stats = data["memory_stats_as_nested_dict"]
    assert layout.free_in_used_segments_bytes == stats["inactive_split_bytes"]["all"]["current"]
    assert layout.free_in_used_segments_bytes > 0


def test_expandable_segments_have_free_bytes_in_used_segments_where_inactive_split_is_zero():
    data = capture("expandable")
    (layout,) = layouts_from_segments(data["snapshot"]["segments"]).values()
    assert data["memory_stats_as_nested_dict"]["inactive_split_bytes"]["all"]["current"] == 0
    assert layout.free_in_used_segments_bytes > 0
    assert all(s["is_expandable"] for s in data["snapshot"]["segments"])


@pytest.mark.parametrize("name", ["native", "expandable"])
def test_graph_and_mempool_bytes_are_under_their_pool_ids(name):
    data = capture(name)
    (layout,) = layouts_from_segments(data["snapshot"]["segments"]).values()
    graph = "_".join(map(str, data["truth"]["private_pools"]["graph"]["pool_id"]))
    mempool = data["truth"]["private_pools"]["mempool"]
    assert graph == "1_0"
    assert layout.private_pools[graph]["allocated_bytes"] > 0
    label = "_".join(map(str, mempool["pool_id"]))
    assert layout.private_pools[label]["allocated_bytes"] == mempool["tensor_bytes"]
    # Private pools are part of reserved, not of the default pool's free bytes.
    reserved = data["memory_stats_as_nested_dict"]["reserved_bytes"]["all"]["current"]
    assert sum(p["reserved_bytes"] for p in layout.private_pools.values()) < reserved


def test_the_largest_free_block_is_one_of_the_default_pools_free_blocks():
    data = capture("native")
    (layout,) = layouts_from_segments(data["snapshot"]["segments"]).values()
    free_blocks = [
        b["size"]
        for s in data["snapshot"]["segments"]
        if tuple(s["segment_pool_id"]) == (0, 0)
        for b in s["blocks"]
        if b["state"] == "inactive"
    ]
    assert layout.largest_free_block_bytes == max(free_blocks)
    assert layout.largest_free_block_bytes < layout.default_pool_free_bytes


def test_pinned_host_memory_is_what_torch_reports():
    for name in ("native", "expandable", "async"):
        data = capture(name)
        (pinned,) = data["exporter_pinned_host"]
        assert pinned["held_bytes"] == data["truth"]["pinned_tensor_bytes"]
        assert pinned["held_bytes"] == data["host_memory_stats"]["allocated_bytes"]["current"]
        assert pinned["in_use_bytes"] == data["host_memory_stats"]["active_bytes"]["current"]


def test_cuda_malloc_async_has_no_layout():
    data = capture("async")
    assert data["snapshot"] is None
    (live,) = data["exporter_allocators"]
    assert live["layout"] == {} and live["private_pools"] == {}


def test_private_pools_beyond_the_limit_are_summed_as_other():
    pools = {f"1_{i}": {"reserved_bytes": i + 1, "allocated_bytes": 1} for i in range(20)}
    bounded = bounded_pools(pools)
    assert len(bounded) == MAX_PRIVATE_POOLS + 1
    assert "1_19" in bounded and "1_0" not in bounded  # the biggest are kept
    assert bounded["other"] == {"reserved_bytes": 1 + 2 + 3 + 4, "allocated_bytes": 4}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class CountingReader(LayoutReader):
    calls: list[int]  # one entry per snapshot taken


def reader(clock: Clock, snapshot=None, history: bool = False, **kwargs) -> CountingReader:
    data = capture("native")["snapshot"]
    calls: list[int] = []

    def take():
        calls.append(1)
        if snapshot is not None:
            return snapshot()
        return data

    result = CountingReader(take, history_enabled=lambda: history, clock=clock, **kwargs)
    result.calls = calls
    return result


def test_the_reader_keeps_its_cadence():
    clock = Clock()
    r = reader(clock, interval_s=10.0)
    assert r.due()
    r.read(blocks=100)
    assert not r.due()
    clock.now += 9.9
    assert not r.due()
    clock.now += 0.2
    assert r.due()
    assert not reader(clock, interval_s=0).due()  # 0 turns it off


def test_too_many_blocks_or_history_recording_skip_the_snapshot():
    clock = Clock()
    r = reader(clock, max_blocks=1000)
    read = r.read(blocks=1001)
    assert read.skipped == "too_many_blocks" and read.layouts == {}
    assert r.calls == []
    r2 = reader(clock, history=True)
    assert r2.read(blocks=10).skipped == "history_recording"
    assert r2.calls == []
    assert reader(clock).read(blocks=1000).skipped == ""


def test_a_snapshot_that_fails_is_a_skip_with_its_error_not_an_exception():
    def broken():
        raise RuntimeError("snapshot changed shape")

    read = reader(Clock(), snapshot=broken).read(blocks=1)
    assert read.skipped == "error" and "changed shape" in read.error


def test_live_settings_are_text_and_scalars_only():
    read = reader(Clock()).read(blocks=1)
    assert read.settings["expandable_segments"] == "false"
    assert read.settings["max_split_size"] == "-1"
    assert "roundup_power2_divisions" not in read.settings  # a dict, not a label value


class FakeCuda:
    def __init__(self, data: dict) -> None:
        self.data = data

    def is_initialized(self):
        return True

    def device_count(self):
        return 1

    def memory_stats_as_nested_dict(self, device):
        return self.data["memory_stats_as_nested_dict"]

    def get_allocator_backend(self):
        return self.data["allocator_backend"]

    def get_device_properties(self, index):
        return SimpleNamespace(uuid=self.data["device_uuid"])


def fake_torch(data: dict, stats: dict | None = None, history: bool = False):
    snapshot_calls: list = []

    def snapshot(arg):
        snapshot_calls.append(arg)
        if data["snapshot"] is None:
            raise RuntimeError("Calling snapshot with backend:cudaMallocAsync is not meaningful")
        return data["snapshot"]

    c = SimpleNamespace(
        _cuda_hasPrimaryContext=lambda i: True,
        _cuda_memoryStats=lambda i: stats or data["memory_stats_as_nested_dict"],
        _cuda_memorySnapshot=snapshot,
        _cuda_isHistoryEnabled=lambda: history,
        _cuda_hostMemoryStats=lambda: data["host_memory_stats"],
    )
    return SimpleNamespace(cuda=FakeCuda(data), _C=c), snapshot_calls


@pytest.mark.parametrize("name", ["native", "expandable", "async"])
def test_the_source_attaches_the_layout_and_pinned_memory_it_read_on_the_gpu(name):
    data = capture(name)
    torch, calls = fake_torch(data)
    reading = TorchAllocatorSource(
        torch, env={"PYTORCH_CUDA_ALLOC_CONF": data["alloc_conf"]}
    ).read()
    (allocator,) = reading.allocators
    (live,) = data["exporter_allocators"]
    assert allocator.layout == live["layout"]
    assert allocator.private_pools == live["private_pools"]
    assert [(p.held_bytes, p.in_use_bytes) for p in reading.pinned_host] == [
        (p["held_bytes"], p["in_use_bytes"]) for p in data["exporter_pinned_host"]
    ]
    # cudaMallocAsync has no snapshot: never asked for one. Elsewhere: every pool, no trace.
    assert calls == ([] if name == "async" else [(0, 0, False)])


def test_a_torch_that_takes_no_trace_argument_is_asked_for_its_whole_snapshot_from_then_on():
    """Before torch 2.11 the snapshot's C call takes a pool id or None: the layout is read
    with None, and the refused form is not tried again at every read."""
    data = capture("native")
    torch, calls = fake_torch(data)
    taking = torch._C._cuda_memorySnapshot

    def older(arg):
        if arg is not None and len(arg) == 3:
            calls.append(arg)
            raise TypeError("mempool_id must be a tuple of two ints")
        return taking(arg)

    torch._C._cuda_memorySnapshot = older
    source = TorchAllocatorSource(torch, env={}, layout_interval_s=0.001)
    first = source.read().allocators[0]
    assert source._layout is not None
    source._layout._next = 0.0  # due again
    second = source.read().allocators[0]
    assert calls == [(0, 0, False), None, None]
    assert first.layout == second.layout == data["exporter_allocators"][0]["layout"]


def test_the_source_reads_the_snapshot_only_at_its_cadence_and_says_how_old_it_is():
    data = capture("native")
    torch, calls = fake_torch(data)
    source = TorchAllocatorSource(torch, env={}, layout_interval_s=3600)
    first = source.read().allocators[0]
    second = source.read().allocators[0]
    assert len(calls) == 1
    assert second.layout == first.layout and second.layout_age_s is not None
    assert 0 <= second.layout_age_s < 60


def test_live_settings_replace_the_environments_and_switch_what_is_tracked():
    data = capture("expandable")
    torch, _ = fake_torch(data)
    # Started without the variable; the allocator says expandable segments are on.
    source = TorchAllocatorSource(torch, env={})
    source.read()
    reading = source.read().allocators[0]
    assert reading.settings["source"] == "live"
    assert reading.expandable_segments is True
    assert "inactive_split_bytes" not in reading.gauges


def test_a_skipped_layout_is_reported_and_not_replaced_by_old_numbers():
    data = capture("native")
    torch, calls = fake_torch(data, history=True)
    (reading,) = TorchAllocatorSource(torch, env={}).read().allocators
    assert reading.layout == {} and reading.layout_skipped == "history_recording"
    assert calls == []
    torch, calls = fake_torch(data)
    (reading,) = TorchAllocatorSource(torch, env={}, layout_max_blocks=10).read().allocators
    assert reading.layout_skipped == "too_many_blocks" and calls == []


def test_private_pool_reserved_bytes_from_the_stats_are_read_every_tick():
    # torch 2.13+ reports reserved bytes per private pool in memory_stats, keyed by pool id
    # tuples (its docstring); the snapshot adds allocated bytes at its cadence.
    data = capture("native")
    stats = dict(data["memory_stats_as_nested_dict"])
    stats["reserved_bytes_by_private_pools"] = {(1, 0): {"all": {"current": 123 << 20}}}
    torch, _ = fake_torch(data, stats=stats)
    (reading,) = TorchAllocatorSource(torch, env={}).read().allocators
    snapshot_pool = data["truth"]["snapshot_walk"]["private_pools"]["1_0"]
    assert reading.private_pools["1_0"] == {
        "reserved_bytes": 123 << 20,
        "allocated_bytes": snapshot_pool["allocated_bytes"],
    }


def test_fully_free_and_partly_used_segments_of_a_serving_process():
    """The demo's snapshot (recorded on an H200 mid-incident, with every kind of segment:
    full, partly used, entirely free; a CUDA graph's pool) against a plain walk."""
    import gzip
    import pickle

    from exporter.actions.replay import demo_snapshot_path

    with gzip.open(demo_snapshot_path(), "rb") as f:
        snapshot = pickle.load(f)
    segments = snapshot["segments"]
    assert any(s["active_size"] == 0 for s in segments), "no entirely free segment to check"
    assert any(0 < s["active_size"] < s["total_size"] for s in segments)
    (layout,) = layouts_from_segments(segments).values()
    default = [s for s in segments if tuple(s["segment_pool_id"]) == (0, 0)]
    free_blocks = [b["size"] for s in default for b in s["blocks"] if b["state"] == "inactive"]
    used = [s for s in segments if any(b["state"] != "inactive" for b in s["blocks"])]
    in_used = sum(b["size"] for s in used for b in s["blocks"] if b["state"] == "inactive")
    assert layout.largest_free_block_bytes == max(free_blocks)
    assert layout.default_pool_free_bytes == sum(free_blocks)
    assert layout.free_in_used_segments_bytes == in_used
    graph = [s for s in segments if tuple(s["segment_pool_id"]) == (1, 0)]
    assert layout.private_pools["1_0"]["reserved_bytes"] == sum(s["total_size"] for s in graph)
