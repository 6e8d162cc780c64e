"""In-process detectors: edge triggering, durations, hysteresis, and the recorded incident."""

from __future__ import annotations

import json
import logging

import pytest

from exporter.actions.base import Target
from exporter.actions.stats import latest_stats
from exporter.alerts import BY_NAME
from exporter.config import ConfigError, load_config
from exporter.detectors import AlertEvent, Detectors
from exporter.oom_pending import PendingOoms
from exporter.sample import (
    AllocatorReading,
    GpuReading,
    HostProcessReading,
    HostReading,
    Sample,
)
from exporter.sources.replay import demo_trace_path
from exporter.trace import read_trace
from tests.conftest import DATA_DIR
from tests.helpers import captured_oom_samples

GiB = 1 << 30
DEVICE0 = {"device": "0", "gpu_uuid": "GPU-a"}  # an allocator alert's subject
GPU1 = {"gpu": "1", "gpu_uuid": "GPU-b"}  # a GPU alert's: the NVML index, never `device`


def allocator(reserved: int, allocated: int, inactive: int | None, retries=0, ooms=0):
    gauges = {"reserved_bytes": reserved, "allocated_bytes": allocated}
    if inactive is not None:
        gauges["inactive_split_bytes"] = inactive
    return AllocatorReading(
        device=0,
        gpu_uuid="GPU-a",
        backend="native",
        expandable_segments=inactive is None,
        gauges=gauges,
        counters={"alloc_retries": retries, "ooms": ooms},
    )


def run(detectors: Detectors, readings, step_s: float = 60.0, key="allocators", gpus=()):
    """Feed one reading per step, with `gpus` (NVML readings) in every sample; time carries
    on across calls for the same detectors."""
    for reading in readings:
        t = getattr(detectors, "test_clock", 1000.0)
        detectors.test_clock = t + step_s  # type: ignore[attr-defined]
        sample = Sample(timestamp=t)
        sample.gpus.extend(gpus)
        if key == "host":
            sample.host = reading
        else:
            getattr(sample, key).append(reading)
        detectors(sample)


def collect() -> tuple[Detectors, list[AlertEvent]]:
    events: list[AlertEvent] = []
    return Detectors(listeners=[events.append]), events


def test_fragmentation_fires_after_its_duration_and_clears_with_hysteresis():
    detectors, events = collect()
    high = allocator(10 * GiB, 5 * GiB, 4 * GiB)  # ratio 0.4
    run(detectors, [high] * 10)  # 9 minutes of high fragmentation: still pending
    assert not detectors.is_firing("GpuMemFragmentationHigh", DEVICE0)
    run(detectors, [high] * 12)
    assert detectors.is_firing("GpuMemFragmentationHigh", DEVICE0)
    assert [(e.alert, e.state, e.device) for e in events] == [
        ("GpuMemFragmentationHigh", "firing", "0")
    ]
    assert events[0].value == pytest.approx(0.4) and events[0].labels == DEVICE0
    # Just under the threshold (0.28 > 0.3 * 0.8): keeps firing, no flapping.
    run(detectors, [allocator(10 * GiB, 5 * GiB, int(2.8 * GiB))] * 3)
    assert detectors.is_firing("GpuMemFragmentationHigh", DEVICE0) and len(events) == 1
    run(detectors, [allocator(10 * GiB, 5 * GiB, 1 * GiB)])
    assert [e.state for e in events] == ["firing", "resolved"]


def test_fragmentation_never_fires_where_it_is_undefined():
    detectors, events = collect()
    run(detectors, [allocator(10 * GiB, 1 * GiB, None)] * 30)  # expandable segments
    assert not any(e.alert == "GpuMemFragmentationHigh" for e in events)


def test_a_small_cache_does_not_count_as_fragmented():
    detectors, _ = collect()
    run(detectors, [allocator(GiB // 2, GiB // 4, GiB // 4)] * 30)
    assert not detectors.is_firing("GpuMemFragmentationHigh", DEVICE0)


def test_retries_and_ooms_fire_at_once_and_clear_after_a_quiet_window():
    detectors, events = collect()
    readings = [
        allocator(GiB, GiB, 0, retries=r, ooms=o)
        for r, o in [(0, 0), (0, 0), (2, 0), (3, 1), (3, 1)]
    ]
    run(detectors, readings)
    assert detectors.is_firing("GpuMemAllocRetries", DEVICE0)
    assert detectors.is_firing("GpuMemOutOfMemory", DEVICE0)
    run(detectors, [allocator(GiB, GiB, 0, retries=3, ooms=1)] * 11, step_s=60)
    assert not detectors.is_firing("GpuMemAllocRetries", DEVICE0)
    fired = [(e.alert, e.state) for e in events]
    assert fired == [
        ("GpuMemAllocRetries", "firing"),
        ("GpuMemOutOfMemory", "firing"),
        ("GpuMemAllocRetries", "resolved"),
        ("GpuMemOutOfMemory", "resolved"),
    ]


def test_a_counter_already_above_zero_at_start_fires():
    detectors, _ = collect()
    run(detectors, [allocator(GiB, GiB, 0, ooms=1)])
    assert detectors.is_firing("GpuMemOutOfMemory", DEVICE0)


def test_cache_gap_fires_only_when_held_long():
    detectors, _ = collect()
    gap = allocator(20 * GiB, 4 * GiB, None)  # 16 GiB cached and unused, 80%
    run(detectors, [gap] * 30)
    assert not detectors.is_firing("GpuMemCacheGapHigh", DEVICE0)
    run(detectors, [gap] * 2)
    assert detectors.is_firing("GpuMemCacheGapHigh", DEVICE0)


def layout_reading(largest: int, free: int, backend: str = "native") -> AllocatorReading:
    """A reading with the allocator's layout (expandable segments: no inactive_split)."""
    reading = allocator(free + 10 * GiB, 10 * GiB, None)
    reading.backend = backend
    reading.layout = {
        "largest_free_block_bytes": largest,
        "default_pool_free_bytes": free,
        "free_in_used_segments_bytes": free - largest,
    }
    reading.layout_age_s = 5.0
    return reading


def gpu_a(free: float | None, total: float = 141 * GiB) -> GpuReading:
    """NVML's reading of the GPU that the allocator readings are on (GPU-a)."""
    return GpuReading(
        index=0,
        uuid="GPU-a",
        total_bytes=int(total),
        free_bytes=None if free is None else int(free),
        used_bytes=None if free is None else int(total - free),
    )


FULL_GPU = [gpu_a(GiB)]  # 1 GiB free on the device: under a quarter of any pool above 4 GiB


def test_shattered_free_cache_fires_after_its_duration_and_clears_with_hysteresis():
    detectors, events = collect()
    shattered = layout_reading(768 << 20, 8 * GiB)  # largest block 768 MiB of 8 GiB free
    run(detectors, [shattered] * 15, gpus=FULL_GPU)  # 14 minutes: still pending
    assert not detectors.is_firing("GpuMemFreeCacheShattered", DEVICE0)
    run(detectors, [shattered], gpus=FULL_GPU)
    assert detectors.is_firing("GpuMemFreeCacheShattered", DEVICE0)
    fired = [e for e in events if e.alert == "GpuMemFreeCacheShattered"]
    assert [(e.state, e.value, e.labels) for e in fired] == [("firing", 768 << 20, DEVICE0)]
    # A share of 0.28 (above 0.25, under 0.25 * 1.2): keeps firing, no flapping.
    run(detectors, [layout_reading(int(0.28 * 8 * GiB), 8 * GiB)] * 3, gpus=FULL_GPU)
    assert detectors.is_firing("GpuMemFreeCacheShattered", DEVICE0)
    run(detectors, [layout_reading(6 * GiB, 8 * GiB)], gpus=FULL_GPU)
    assert [e.state for e in events if e.alert == "GpuMemFreeCacheShattered"] == [
        "firing",
        "resolved",
    ]


def test_shattered_free_cache_clears_once_the_gpu_has_clearly_room():
    detectors, events = collect()
    shattered = layout_reading(768 << 20, 8 * GiB)  # a quarter of the free cache: 2 GiB
    run(detectors, [shattered] * 16, gpus=FULL_GPU)
    assert detectors.is_firing("GpuMemFreeCacheShattered", DEVICE0)
    # 2.2 GiB free on the device: above the quarter, under 2 GiB * 1.2: keeps firing.
    run(detectors, [shattered] * 3, gpus=[gpu_a(2.2 * GiB)])
    assert detectors.is_firing("GpuMemFreeCacheShattered", DEVICE0)
    run(detectors, [shattered], gpus=[gpu_a(2.5 * GiB)])
    assert not detectors.is_firing("GpuMemFreeCacheShattered", DEVICE0)
    assert [e.state for e in events if e.alert == "GpuMemFreeCacheShattered"] == [
        "firing",
        "resolved",
    ]


def test_shattered_free_cache_with_plenty_free_on_the_gpu_stays_quiet():
    """The real H200 trace: 400 MB largest of 8 GiB free while serving normally, with more
    than 100 GiB free on the device, where a big request simply gets a new cudaMalloc."""
    for free_on_gpu in (100 * GiB, 2 * GiB):  # 2 GiB: exactly a quarter, not below it
        detectors, events = collect()
        run(detectors, [layout_reading(400_000_000, 8 * GiB)] * 30, gpus=[gpu_a(free_on_gpu)])
        assert not any(e.alert == "GpuMemFreeCacheShattered" for e in events), free_on_gpu
        assert not detectors.is_firing("GpuMemFreeCacheShattered", DEVICE0)


def test_shattered_free_cache_fires_under_a_memory_cap_although_the_gpu_has_room():
    """The demos (H100: 60 GB free on the device; H200: 117 GB), but the process may reserve
    only 22 GiB (set_per_process_memory_fraction): its room is what the cap leaves."""
    capped = layout_reading(768 << 20, 8 * GiB)  # reserved: 18 GiB
    capped.gauges["memory_limit_bytes"] = 19 * GiB  # 1 GiB of room, under a quarter of 8
    roomy = layout_reading(768 << 20, 8 * GiB)
    roomy.gauges["memory_limit_bytes"] = 80 * GiB
    for reading, gpus, fires in (
        (capped, [gpu_a(60 * GiB)], True),
        (capped, [], True),  # no NVML: the cap alone says the room
        (roomy, [gpu_a(60 * GiB)], False),
    ):
        detectors, _ = collect()
        run(detectors, [reading] * 16, gpus=gpus)
        assert detectors.is_firing("GpuMemFreeCacheShattered", DEVICE0) is fires, (gpus, fires)


def test_shattered_free_cache_never_fires_without_an_nvml_reading_of_its_gpu():
    other_gpu = GpuReading(index=1, uuid="GPU-b", total_bytes=80 * GiB, free_bytes=0)
    shattered = layout_reading(768 << 20, 8 * GiB)
    for gpus in ([], [other_gpu], [gpu_a(None)]):  # none, another GPU's, no free bytes
        detectors, events = collect()
        run(detectors, [shattered] * 30, gpus=gpus)
        assert not any(e.alert == "GpuMemFreeCacheShattered" for e in events), gpus
    # The reading goes missing while firing: the alert resolves (unknown), as it would in
    # Prometheus when the NVML series vanishes.
    detectors, events = collect()
    run(detectors, [shattered] * 16, gpus=FULL_GPU)
    assert detectors.is_firing("GpuMemFreeCacheShattered", DEVICE0)
    run(detectors, [shattered], gpus=[gpu_a(None)])
    assert not detectors.is_firing("GpuMemFreeCacheShattered", DEVICE0)


def test_shattered_free_cache_needs_more_than_the_floor_and_a_small_largest_block():
    for largest, free in (
        (64 << 20, 2 * GiB),  # in 64 MiB pieces, but only 2 GiB free: at the floor
        (2 * GiB, 8 * GiB),  # exactly a quarter, not below it
        (30 * GiB, 32 * GiB),  # one big free block
    ):
        detectors, events = collect()
        run(detectors, [layout_reading(largest, free)] * 30, gpus=[gpu_a(0)])  # device full
        assert not any(e.alert == "GpuMemFreeCacheShattered" for e in events), (largest, free)
        assert not detectors.is_firing("GpuMemFreeCacheShattered", DEVICE0)


def test_shattered_free_cache_never_fires_without_a_layout():
    detectors, events = collect()
    no_layout = allocator(40 * GiB, 2 * GiB, None)  # cudaMallocAsync: no snapshot
    no_layout.backend = "cudaMallocAsync"
    skipped = allocator(40 * GiB, 2 * GiB, 1 * GiB)  # read skipped (too many blocks)
    skipped.layout_skipped = "too_many_blocks"
    run(detectors, [no_layout] * 30 + [skipped] * 30, gpus=FULL_GPU)
    assert not any(e.alert == "GpuMemFreeCacheShattered" for e in events)
    # A layout that stops being read resolves the alert, as the series vanishing does in
    # Prometheus, rather than keep it firing on numbers no longer refreshed.
    run(detectors, [layout_reading(GiB, 16 * GiB)] * 16, gpus=FULL_GPU)
    assert detectors.is_firing("GpuMemFreeCacheShattered", DEVICE0)
    run(detectors, [skipped], gpus=FULL_GPU)
    assert not detectors.is_firing("GpuMemFreeCacheShattered", DEVICE0)


def gpu(free: float, total: float = 80 * GiB) -> GpuReading:
    return GpuReading(
        index=1,
        uuid="GPU-b",
        total_bytes=int(total),
        free_bytes=int(free),
        used_bytes=int(total - free),
    )


def test_headroom_low_and_exhaustion_predicted():
    detectors, _ = collect()
    run(detectors, [gpu(2 * GiB)] * 12, key="gpus")
    assert detectors.is_firing("GpuMemHeadroomLow", GPU1)
    detectors, _ = collect()
    # Free memory falling by 400 MB a minute from 15 GiB: gone within the hour.
    run(detectors, [gpu(15 * GiB - i * 400e6) for i in range(20)], key="gpus")
    assert detectors.is_firing("GpuMemExhaustionPredicted", GPU1)
    # A single step down (a KV cache reserved at start-up) is not a trend.
    detectors, _ = collect()
    run(detectors, [gpu(40 * GiB)] * 5 + [gpu(10 * GiB)] * 30, key="gpus")
    assert not detectors.is_firing("GpuMemExhaustionPredicted", GPU1)


def test_host_memory_pressure_and_swap_growth():
    detectors, _ = collect()
    total = 64 * GiB
    run(detectors, [HostReading(total, int(total * 0.03), 8 * GiB, 0)] * 7, key="host")
    assert detectors.is_firing("HostMemoryPressure")
    detectors, _ = collect()
    run(
        detectors,
        [HostReading(total, total // 2, 8 * GiB, 2 * GiB + i * 60 * (1 << 20)) for i in range(12)],
        key="host",
    )
    assert detectors.is_firing("HostSwapGrowing")


def test_alert_lines_are_structured_and_callbacks_cannot_break_detection(caplog):
    def broken(event):
        raise RuntimeError("callback bug")

    detectors = Detectors(listeners=[broken])
    with caplog.at_level(logging.INFO, logger="exporter.alerts"):
        run(detectors, [allocator(GiB, GiB, 0, ooms=1)])
    line = next(r.getMessage() for r in caplog.records if "gpumem_alert" in r.getMessage())
    assert json.loads(line) == {
        "event": "gpumem_alert",
        "alert": "GpuMemOutOfMemory",
        "state": "firing",
        "device": "0",
        "value": 1,
        "gpu_uuid": "GPU-a",
    }
    assert "callback bug" in caplog.text
    assert detectors.is_firing("GpuMemOutOfMemory", DEVICE0)


def process_allocator(pid: str, retries: int) -> AllocatorReading:
    reading = allocator(GiB, GiB, 0, retries=retries)
    reading.process = {"pid": pid, "rank": "", "local_rank": "", "role": "worker"}
    return reading


def test_two_processes_on_one_device_keep_their_own_alerts():
    """Idle processes with retry counters 5 and 2 on one CUDA ordinal: no rise, no alert
    after the window (the first version read 5 -> 2 -> 5 as a rise on every tick)."""
    detectors, events = collect()
    t = 1000.0
    for step in range(40):  # 40 quiet minutes
        sample = Sample(timestamp=t + 60 * step)
        sample.allocators = [process_allocator("11", 5), process_allocator("12", 2)]
        detectors(sample)
    a = {**DEVICE0, "pid": "11", "rank": "", "local_rank": "", "role": "worker"}
    b = {**a, "pid": "12"}
    assert not detectors.is_firing("GpuMemAllocRetries", a)
    assert not detectors.is_firing("GpuMemAllocRetries", b)
    # Process 12 retries: only its alert fires, and it carries its process labels.
    sample = Sample(timestamp=t + 60 * 40)
    sample.allocators = [process_allocator("11", 5), process_allocator("12", 3)]
    detectors(sample)
    assert detectors.is_firing("GpuMemAllocRetries", b)
    assert not detectors.is_firing("GpuMemAllocRetries", a)
    fired = [e for e in events if e.state == "firing" and e.alert == "GpuMemAllocRetries"]
    assert fired[-1].labels == b and fired[-1].device == "0"
    firing = {(alert, labels["pid"]) for alert, labels, on in detectors.firing() if on}
    assert ("GpuMemAllocRetries", "12") in firing and ("GpuMemAllocRetries", "11") not in firing
    # What /metrics and /stats read: the firing ones alone, in the same order, and /stats
    # limited to the process asked for.
    assert detectors.firing_subjects() == [(a, ids) for a, ids, on in detectors.firing() if on]
    for target, expected in ((Target(), [b]), (Target(pid=12), [b]), (Target(pid=11), [])):
        stats = latest_stats(
            sample, target, mode="run", detectors=detectors, pending_ooms=PendingOoms()
        )
        retrying = [f for f in stats["alerts_firing"] if f["alert"] == "GpuMemAllocRetries"]
        assert [{k: v for k, v in f.items() if k != "alert"} for f in retrying] == expected
    # A process that exits resolves and forgets its alerts (no stale series, pids reused).
    gone = Sample(timestamp=t + 60 * 40.5)
    gone.allocators = [process_allocator("11", 5)]
    detectors(gone)
    assert not any(labels.get("pid") == "12" for _, labels, _ in detectors.firing())
    assert [e.state for e in events if e.labels.get("pid") == "12"][-1] == "resolved"
    # ... and clears after a quiet window, for that process.
    for step in range(41, 52):
        sample = Sample(timestamp=t + 60 * step)
        sample.allocators = [process_allocator("11", 5), process_allocator("12", 3)]
        detectors(sample)
    assert not detectors.is_firing("GpuMemAllocRetries", b)
    assert [e.state for e in events if e.labels.get("pid") == "12"][-2:] == ["firing", "resolved"]


def test_host_memory_held_by_one_process_names_that_process():
    """The incident: a validation worker holds most of the host's RAM while the profiler
    (another process) grows GPU memory; only the worker is named."""
    detectors, events = collect()
    total, low = 252 * GiB, int(0.58 * GiB)
    worker = HostProcessReading(pid=4242, role="validate", rank="", resident_bytes=200 * GiB)
    profiler = HostProcessReading(pid=4100, role="profiler", rank="0", resident_bytes=3 * GiB)
    for step in range(4):
        sample = Sample(
            timestamp=1000.0 + 60 * step, host=HostReading(total, low, 16 * GiB, 12 * GiB)
        )
        sample.host_processes = [worker, profiler]
        detectors(sample)
    subject = {"pid": "4242", "role": "validate", "rank": ""}
    assert detectors.is_firing("HostMemoryHeldByProcess", subject)
    assert not detectors.is_firing(
        "HostMemoryHeldByProcess", {"pid": "4100", "role": "profiler", "rank": "0"}
    )
    fired = [e for e in events if e.alert == "HostMemoryHeldByProcess"]
    assert [(e.state, e.labels["pid"], e.value) for e in fired] == [("firing", "4242", 200 * GiB)]
    # The worker exits: its alert resolves and its state goes with it.
    sample = Sample(timestamp=2000.0, host=HostReading(total, 200 * GiB, 16 * GiB, 0))
    sample.host_processes = [profiler]
    detectors(sample)
    assert [e.state for e in events if e.alert == "HostMemoryHeldByProcess"][-1] == "resolved"
    assert not any(labels.get("pid") == "4242" for _, labels, _ in detectors.firing())


def test_memory_spread_over_many_processes_names_none():
    detectors, _ = collect()
    total = 64 * GiB
    spread = [
        HostProcessReading(pid=100 + i, role="w", rank="", resident_bytes=6 * GiB)
        for i in range(10)
    ]
    for step in range(5):
        sample = Sample(timestamp=1000.0 + 60 * step, host=HostReading(total, GiB, 0, 0))
        sample.host_processes = spread
        detectors(sample)
    assert not any(on for alert, _, on in detectors.firing() if alert == "HostMemoryHeldByProcess")


def test_thresholds_are_settings_from_the_environment():
    """GPUMEM_DETECT_* are ordinary settings (exporter.config): checked with the rest, and in
    the agents' settings file under `run`."""
    assert (
        load_config({"GPUMEM_DETECT_FRAGMENTATION_RATIO": "0.5"}).detect_fragmentation_ratio == 0.5
    )
    env = {"GPUMEM_DETECT_SHATTERED_BLOCK_SHARE": "0.1", "GPUMEM_DETECT_SHATTERED_FOR_S": "60"}
    settings = load_config(env)
    assert (settings.detect_shattered_block_share, settings.detect_shattered_for_s) == (0.1, 60)
    with pytest.raises(ConfigError, match="GPUMEM_DETECT_HOST_FOR_S: expected seconds between"):
        load_config({"GPUMEM_DETECT_HOST_FOR_S": "-1"})
    with pytest.raises(ConfigError, match="GPUMEM_DETECT_HEADROOM_FREE_RATIO: expected a share"):
        load_config({"GPUMEM_DETECT_HEADROOM_FREE_RATIO": "5"})


def test_a_threshold_set_in_the_settings_moves_the_alert():
    """The detectors read the threshold from the settings they are given."""
    sample = Sample(timestamp=1000.0, host=HostReading(100 * GiB, 8 * GiB, 0, 0))  # 8% free
    for ratio, fires in ((0.05, False), (0.1, True)):
        detectors = Detectors(
            load_config({}, detect_host_available_ratio=ratio, detect_host_for_s=0)
        )
        detectors(sample)
        assert detectors.is_firing("HostMemoryPressure") is fires, ratio


def test_the_recorded_incident_fires_retries_and_oom_under_its_cap():
    """The real H100 trace (a decoder serving under a 22 GiB cap), with durations shortened
    to fit its 220 s: its batches retry allocations and run out of memory; its fragmentation
    (inactive_split up to a fifth of reserved) stays under the 0.3 threshold, as a real
    server's usually does, and the host is never short."""
    _, samples = read_trace(demo_trace_path())
    short = load_config({}, detect_fragmentation_for_s=5, detect_counter_window_s=30)
    events: list[AlertEvent] = []
    detectors = Detectors(short, listeners=[events.append])
    for sample in samples:
        detectors(sample)
    fired = {e.alert for e in events if e.state == "firing"}
    assert {"GpuMemAllocRetries", "GpuMemOutOfMemory"} <= fired
    assert not {"HostMemoryPressure", "HostSwapGrowing", "GpuMemHeadroomLow"} & fired
    limits = {r.gauges.get("memory_limit_bytes") for s in samples for r in s.allocators}
    assert limits == {22 * GiB}  # the cap the OOMs come from, read from torch


def test_slope_matches_least_squares_over_the_window():
    import random

    from exporter.detectors import _Series

    rng = random.Random(3)
    series = _Series(window_s=100)
    points: list[tuple[float, float]] = []
    for i in range(500):
        t, v = 1.7e9 + i * 0.5, 1e10 - i * 3e6 + rng.uniform(-1e6, 1e6)
        series.add(t, v)
        points = [(pt, pv) for pt, pv in [*points, (t, v)] if pt >= t - 100]
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    expected = sum((t - mt) * (v - mv) for t, v in points) / sum((t - mt) ** 2 for t, _ in points)
    assert len(series.points) == n
    assert series.slope() == pytest.approx(expected, rel=1e-6)


def test_quiet_detectors_call_listeners_without_logging(caplog):
    """The agents detect only for remediation; the launcher logs each alert once."""
    events: list[AlertEvent] = []
    detectors = Detectors(listeners=[events.append], log_events=False)
    with caplog.at_level(logging.INFO, logger="exporter.alerts"):
        run(detectors, [allocator(GiB, GiB, 0, ooms=1)])
    assert [e.alert for e in events] == ["GpuMemOutOfMemory"]
    assert "gpumem_alert" not in caplog.text


def test_firing_alerts_come_critical_first_with_their_start_and_value():
    detectors, _ = collect()
    readings = [
        allocator(GiB, GiB, 0),
        allocator(GiB, GiB, 0, retries=3),  # t=1060: retries start firing
        allocator(GiB, GiB, 0, retries=3, ooms=2),  # t=1120: OOMs, later but critical
    ]
    run(detectors, readings, step_s=60)
    firing = detectors.firing_now()
    assert [(a.alert, a.severity, a.since, a.value) for a in firing] == [
        ("GpuMemOutOfMemory", "critical", 1120.0, 2.0),
        ("GpuMemAllocRetries", "warning", 1060.0, 3.0),
    ]


def test_a_fragmentation_oom_fires_its_own_critical_alert_and_other_verdicts_do_not():
    """From the readings of OOMs made on an H100: only the fragmentation one fires it."""
    fired = {}
    for sample in captured_oom_samples():
        detectors = Detectors()
        detectors(sample)
        reading = sample.allocators[0]
        if reading.last_oom is None:
            continue  # expandable segments served the request that failed natively
        labels = {"device": str(reading.device), "gpu_uuid": reading.gpu_uuid}
        assert detectors.is_firing("GpuMemOutOfMemory", labels)
        fired[(reading.last_oom.verdict, reading.expandable_segments)] = detectors.is_firing(
            "GpuMemOomFragmentation", labels
        )
    assert fired[("fragmentation", False)] is True
    assert not any(v for (verdict, _), v in fired.items() if verdict != "fragmentation")
    assert BY_NAME["GpuMemOomFragmentation"].severity == "critical"


def _with_settings(expandable: bool, source: str = "live", pid: str = "") -> AllocatorReading:
    reading = allocator(4 * GiB, 2 * GiB, None if expandable else 0)
    reading.expandable_segments = expandable
    reading.settings = {"source": source}
    if pid:
        reading.process = {"pid": pid}
    return reading


def test_a_live_settings_change_fires_at_once_says_what_changed_and_clears_after_a_window(
    caplog,
):
    """vLLM turns expandable_segments off around its CuMem pool: the settings the allocator
    reports change while the process runs. The first live read is no change; each change is
    said once, from what to what, and the alert clears after a quiet window."""
    caplog.set_level(logging.WARNING, logger="exporter.alerts")
    detectors, events = collect()
    run(detectors, [_with_settings(True)] * 3)
    assert not detectors.is_firing("GpuMemAllocatorSettingsChanged", DEVICE0)
    assert list(detectors.settings_changes()) == []
    run(detectors, [_with_settings(False)])
    assert [(e.alert, e.state, e.value) for e in events] == [
        ("GpuMemAllocatorSettingsChanged", "firing", 1.0)
    ]
    [(labels, seen)] = detectors.settings_changes()
    assert labels == DEVICE0 and seen.changes == 1
    assert seen.last == {"expandable_segments": ("true", "false")}
    [line] = [
        json.loads(r.getMessage()) for r in caplog.records if "settings_changed" in r.getMessage()
    ]
    assert line["changed"] == {"expandable_segments": {"from": "true", "to": "false"}}
    assert line["device"] == "0" and line["gpu_uuid"] == "GPU-a"
    run(detectors, [_with_settings(False)] * 9)  # unchanged: said once, firing for the window
    assert detectors.is_firing("GpuMemAllocatorSettingsChanged", DEVICE0) and len(events) == 1
    run(detectors, [_with_settings(True)])  # and back: the last change of each setting kept
    [(_, seen)] = detectors.settings_changes()
    assert seen.changes == 2 and seen.last == {"expandable_segments": ("false", "true")}
    run(detectors, [_with_settings(True)] * 11)
    assert [e.state for e in events] == ["firing", "resolved"]


def test_settings_from_the_environment_then_from_the_allocator_are_no_change():
    """At start the settings are what PYTORCH_CUDA_ALLOC_CONF asked for; the allocator's own
    report may differ (a setting the environment did not name). Only live to live counts."""
    detectors, events = collect()
    run(detectors, [_with_settings(False, source="environment")] * 2)
    run(detectors, [_with_settings(True), _with_settings(True, source="environment")])
    run(detectors, [_with_settings(True)] * 2)
    assert events == [] and list(detectors.settings_changes()) == []


def test_a_process_that_exits_takes_its_settings_with_it():
    detectors, _ = collect()
    run(detectors, [_with_settings(True, pid="7"), _with_settings(False, pid="7")])
    assert [labels["pid"] for labels, _ in detectors.settings_changes()] == ["7"]
    run(detectors, [_with_settings(True, pid="8")])  # pid 7 is gone
    assert list(detectors.settings_changes()) == []


def test_the_recorded_h200_trace_turns_expandable_segments_on_and_that_is_one_change():
    """The H200 OOM-storm trace (recorded on the GPU) turns expandable_segments on while its
    process runs, as vLLM does around its pools: one change, false to true, said at the read
    that shows it, and served with both values."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from exporter.metrics import ExporterState, SampleCollector
    from exporter.modes import MODES

    _, samples = read_trace(DATA_DIR / "h200_oom_storm_trace.jsonl.gz")
    detectors, events = collect()
    changed_at: list[int] = []
    for i, sample in enumerate(samples):
        detectors(sample)
        if list(detectors.settings_changes()) and not changed_at:
            changed_at.append(i)
    [(_, seen)] = detectors.settings_changes()
    assert changed_at == [302] and seen.changes == 1
    assert seen.last == {"expandable_segments": ("false", "true")}
    assert ("GpuMemAllocatorSettingsChanged", "firing") in [(e.alert, e.state) for e in events]
    registry = CollectorRegistry()
    state = ExporterState(samples[-1], {})
    collector = SampleCollector(
        lambda: state,
        const_labels={},
        version="0",
        traits=MODES["embedded"].traits,
        alerts=detectors,
    )
    registry.register(collector)
    served = {
        (s.name, s.labels.get("setting", ""), s.labels.get("from"), s.labels.get("to"), s.value)
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
        if s.name.startswith("gpumem_exporter_allocator_settings_change")
    }
    assert served == {
        ("gpumem_exporter_allocator_settings_changes_total", "", None, None, 1.0),
        (
            "gpumem_exporter_allocator_settings_change_info",
            "expandable_segments",
            "false",
            "true",
            1.0,
        ),
    }


def test_a_counter_alerts_value_is_its_increase_over_the_window_as_its_label_says():
    """Issue 65: the page's row read "OOMs in the last 10 min 1" beside a banner of 5 OOMs:
    the value was the latest rise alone. It is the counter's increase over the window
    (detect_counter_window_s, 10 min), as the Prometheus rule's increase() over its range."""
    detectors, _ = collect()
    # OOMs at 0, 1, 3 and 5 minutes in: 1 + 1 + 2 + 1 in the window.
    run(detectors, [allocator(GiB, GiB, 0, ooms=o) for o in (1, 2, 2, 4, 4, 5)])
    (firing,) = [a for a in detectors.firing_now() if a.alert == "GpuMemOutOfMemory"]
    assert firing.value == 5
    # Seven minutes on, the first two rises (at 0 and 1 min) are out of the window.
    run(detectors, [allocator(GiB, GiB, 0, ooms=5)] * 7)
    (firing,) = [a for a in detectors.firing_now() if a.alert == "GpuMemOutOfMemory"]
    assert firing.value == 3
