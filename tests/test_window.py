"""The live page's window of recent samples: bounded, incremental (`since`), compact, and right
about what it keeps per GPU in each mode (embedded/demo, node daemon, run)."""

from __future__ import annotations

import dataclasses
import json
import math
import tracemalloc

import pytest

from exporter.config import load_config
from exporter.runtime import build_runtime
from exporter.sample import (
    AllocatorReading,
    GpuReading,
    ProcessGpuReading,
    Sample,
    SourceReading,
)
from exporter.window import FIELDS, MAX_RECORDS, SampleWindow

GiB = 1 << 30
UUID0, UUID1 = (
    "GPU-00000000-0000-0000-0000-000000000000",
    "GPU-11111111-1111-1111-1111-111111111111",
)


def gpu(index: int, uuid: str, *, used: int, free: int, total: int = 80 * GiB) -> GpuReading:
    return GpuReading(
        index=index,
        uuid=uuid,
        name="NVIDIA H100",
        total_bytes=total,
        used_bytes=used,
        free_bytes=free,
    )


def allocator(
    uuid: str,
    *,
    allocated: int,
    reserved: int,
    inactive: int | None = None,
    retries: int = 0,
    ooms: int = 0,
    pid: str = "",
    device: int = 0,
    outside: int | None = None,
) -> AllocatorReading:
    gauges = {"allocated_bytes": allocated, "reserved_bytes": reserved}
    if inactive is not None:
        gauges["inactive_split_bytes"] = inactive
    return AllocatorReading(
        device=device,
        gpu_uuid=uuid,
        backend="native",
        expandable_segments=inactive is None,
        gauges=gauges,
        counters={"alloc_retries": retries, "ooms": ooms},
        process={"pid": pid, "rank": "", "local_rank": "", "role": "worker"} if pid else {},
        non_allocator_bytes=outside,
    )


def series(window: SampleWindow, key: str, since: float | None = None) -> dict[str, list]:
    (entry,) = [g for g in window.to_dict(since)["gpus"] if g["key"] == key]
    return entry["series"]


def test_the_window_keeps_the_last_minutes_and_no_more():
    window = SampleWindow(1.0, window_s=10)
    assert window.capacity == 10
    for t in range(25):
        window(Sample(timestamp=1000.0 + t, gpus=[gpu(0, UUID0, used=t, free=80 * GiB - t)]))
    assert len(window) == 10
    data = window.to_dict()
    assert data["timestamps"] == [1015.0 + i for i in range(10)]
    assert series(window, UUID0)["used_bytes"] == list(range(15, 25))
    # A short interval is capped by count, not by time.
    assert SampleWindow(0.01).capacity == MAX_RECORDS
    assert SampleWindow(1.0).capacity == 600
    with pytest.raises(ValueError):
        SampleWindow(0)


def test_since_returns_only_newer_samples_and_round_trips_through_json():
    window = SampleWindow(0.1)
    # Timestamps like time.time()'s, which a rounded copy would repeat or skip.
    stamps = [1795251201.3278434 + 0.1000731 * i for i in range(30)]
    for t in stamps:
        window(Sample(timestamp=t, gpus=[gpu(0, UUID0, used=1, free=2)]))
    assert window.to_dict()["timestamps"] == stamps
    last = json.loads(json.dumps(window.to_dict()))["timestamps"][-1]
    assert window.to_dict(last)["timestamps"] == []
    assert window.to_dict(last)["gpus"] == []
    assert window.to_dict(stamps[26])["timestamps"] == stamps[27:]
    assert window.to_dict(0)["timestamps"] == stamps
    assert window.to_dict(stamps[-1] + 1000)["timestamps"] == []


def test_allocator_mode_stacks_allocated_cache_non_allocator_other_and_free():
    window = SampleWindow(1.0)
    sample = Sample(
        timestamp=1.0,
        gpus=[gpu(0, UUID0, used=30 * GiB, free=49 * GiB, total=80 * GiB)],
        allocators=[
            # NVML's 29 GiB used - 28 GiB reserved
            allocator(UUID0, allocated=20 * GiB, reserved=28 * GiB, inactive=7 * GiB, outside=GiB)
        ],
        processes=[ProcessGpuReading(0, UUID0, 4242, 29 * GiB)],
        self_pid=4242,
    )
    window(sample)
    values = {name: column[0] for name, column in series(window, UUID0).items()}
    assert values == {
        "allocated_bytes": 20 * GiB,
        "cached_free_bytes": 8 * GiB,
        "non_allocator_bytes": GiB,
        "other_bytes": 80 * GiB - 49 * GiB - 29 * GiB,  # total - free - what this process holds
        "used_bytes": 30 * GiB,
        "free_bytes": 49 * GiB,
        "total_bytes": 80 * GiB,
        "fragmentation_ratio": 0.25,
        "cached_free_ratio": round(8 / 28, 4),
        "alloc_retries": 0,
        "ooms": 0,
        "memory_limit_bytes": None,  # no cap: the page draws none
    }
    (info,) = window.to_dict()["gpus"]
    assert (info["index"], info["device"], info["name"]) == (0, 0, "NVIDIA H100")


def test_the_cap_is_the_tightest_below_the_gpus_memory():
    """A process's limit under the GPU's memory is a cap (the chart draws it); the limit of
    an uncapped process is the whole device, which is no cap."""
    window = SampleWindow(1.0)
    capped = allocator(UUID0, allocated=GiB, reserved=2 * GiB, inactive=0, outside=GiB)
    capped.gauges["memory_limit_bytes"] = 22 * GiB
    uncapped = allocator(UUID0, allocated=GiB, reserved=2 * GiB, inactive=0, outside=GiB)
    uncapped.gauges["memory_limit_bytes"] = 80 * GiB
    gpus = [gpu(0, UUID0, used=30 * GiB, free=49 * GiB, total=80 * GiB)]
    window(Sample(timestamp=1.0, gpus=gpus, allocators=[uncapped, capped]))
    window(Sample(timestamp=2.0, gpus=gpus, allocators=[uncapped]))
    assert series(window, UUID0)["memory_limit_bytes"] == [22 * GiB, None]


def test_undefined_fragmentation_and_missing_non_allocator_are_null_never_zero():
    window = SampleWindow(1.0)
    # expandable segments: no inactive_split; NVML lists another PID (a container without the
    # host PID namespace), so non-allocator bytes are unknown.
    window(
        Sample(
            timestamp=1.0,
            gpus=[gpu(0, UUID0, used=10 * GiB, free=70 * GiB)],
            allocators=[allocator(UUID0, allocated=4 * GiB, reserved=8 * GiB)],
            processes=[ProcessGpuReading(0, UUID0, 1, 9 * GiB)],
            self_pid=2,
        )
    )
    values = series(window, UUID0)
    assert values["fragmentation_ratio"] == [None]
    assert values["non_allocator_bytes"] == [None]
    assert values["cached_free_ratio"] == [0.5]
    assert values["other_bytes"] == [80 * GiB - 70 * GiB - 8 * GiB]


def test_node_mode_keeps_nvml_used_and_free_without_allocator_fields():
    window = SampleWindow(1.0)
    window(
        Sample(
            timestamp=1.0,
            gpus=[gpu(0, UUID0, used=GiB, free=79 * GiB), gpu(1, UUID1, used=0, free=80 * GiB)],
            processes=[ProcessGpuReading(0, UUID0, 77, GiB)],
        )
    )
    data = window.to_dict()
    assert [(g["index"], g["device"]) for g in data["gpus"]] == [(0, None), (1, None)]
    values = series(window, UUID0)
    assert values["used_bytes"] == [GiB] and values["free_bytes"] == [79 * GiB]
    for name in (
        "allocated_bytes",
        "cached_free_bytes",
        "non_allocator_bytes",
        "other_bytes",
        "fragmentation_ratio",
        "alloc_retries",
    ):
        assert values[name] == [None], name


def test_run_mode_sums_the_processes_of_a_gpu_and_keeps_the_worst_ratio():
    window = SampleWindow(1.0)
    window(
        Sample(
            timestamp=1.0,
            gpus=[gpu(0, UUID0, used=40 * GiB, free=39 * GiB)],
            allocators=[
                allocator(
                    UUID0,
                    allocated=10 * GiB,
                    reserved=12 * GiB,
                    inactive=GiB,
                    pid="11",
                    outside=GiB,
                ),
                allocator(
                    UUID0,
                    allocated=5 * GiB,
                    reserved=20 * GiB,
                    inactive=10 * GiB,
                    pid="12",
                    outside=GiB,
                    retries=3,
                    ooms=1,
                ),
            ],
            processes=[
                ProcessGpuReading(0, UUID0, 11, 13 * GiB),
                ProcessGpuReading(0, UUID0, 12, 21 * GiB),
            ],
            self_pid=10,  # the launcher: no GPU memory of its own
        )
    )
    values = {name: column[0] for name, column in series(window, UUID0).items()}
    assert values["allocated_bytes"] == 15 * GiB
    assert values["cached_free_bytes"] == 2 * GiB + 15 * GiB
    assert values["non_allocator_bytes"] == 2 * GiB
    assert values["fragmentation_ratio"] == 0.5  # pid 12's, not the sum's 11/32
    assert values["cached_free_ratio"] == 0.75
    assert (values["alloc_retries"], values["ooms"]) == (3, 1)


def test_a_gpu_that_appears_later_is_null_before_it_and_order_follows_the_index():
    window = SampleWindow(1.0)
    window(Sample(timestamp=1.0, gpus=[gpu(1, UUID1, used=1, free=2)]))
    window(
        Sample(timestamp=2.0, gpus=[gpu(0, UUID0, used=3, free=4), gpu(1, UUID1, used=1, free=2)])
    )
    data = window.to_dict()
    assert [g["key"] for g in data["gpus"]] == [UUID0, UUID1]
    assert data["gpus"][0]["series"]["used_bytes"] == [None, 3]
    assert data["gpus"][1]["series"]["used_bytes"] == [1, 1]


def test_a_gpu_without_nvml_is_named_by_its_cuda_ordinal():
    window = SampleWindow(1.0)
    window(Sample(timestamp=1.0, allocators=[allocator("", allocated=1, reserved=2, device=3)]))
    (info,) = window.to_dict()["gpus"]
    assert (info["key"], info["index"], info["device"], info["name"]) == (
        "cuda:3",
        None,
        3,
        "cuda:3",
    )
    assert info["series"]["free_bytes"] == [None] and info["series"]["other_bytes"] == [None]


def test_points_are_compact():
    """docs/metrics.md gives these sizes: about 90 bytes per GPU point, 200 per sample."""
    window = SampleWindow(1.0)
    gpus = 8
    samples = [
        Sample(
            timestamp=1e9 + t,
            gpus=[gpu(i, f"GPU-{i}", used=5 * GiB + t, free=70 * GiB - t) for i in range(gpus)],
            allocators=[
                allocator(f"GPU-{i}", allocated=GiB + t, reserved=2 * GiB + t, inactive=t, device=i)
                for i in range(gpus)
            ],
        )
        for t in range(window.capacity)
    ]
    tracemalloc.start()
    try:
        for sample in samples:
            window(sample)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per_sample = used / window.capacity
    assert per_sample < 250 + gpus * 8 * len(FIELDS) * 1.1, per_sample
    # The GPUs of consecutive records are one shared tuple, not a copy per sample.
    records = window.since(None)
    assert all(r.gpus is records[0].gpus for r in records)


def test_build_runtime_feeds_every_sample_to_the_window(tmp_path):
    class OneGpu:
        name = "nvml"

        def read(self) -> SourceReading:
            return SourceReading(gpus=[gpu(0, UUID0, used=GiB, free=79 * GiB)])

        def close(self) -> None:
            pass

    config = load_config(env={}, snapshot_dir=str(tmp_path), interval_s=0.5)
    runtime = build_runtime(config, mode="node", sources=[OneGpu()])
    runtime.sampler.tick()
    runtime.sampler.tick()
    assert len(runtime.window) == 2
    assert runtime.window.interval_s == 0.5 and runtime.window.capacity == 1200
    assert not math.isnan(runtime.window.since()[0].values[FIELDS.index("used_bytes")])


def test_the_page_gets_the_window_up_to_the_sample_the_rest_of_its_answer_is_from(tmp_path):
    """Issue 65: under load the GPU card's numbers (the window's last point) and its ledger
    (the sampler's latest sample) came from two samples: the sampler publishes a sample
    before its listeners append it here, and a page read between saw the window a tick
    behind, or, read the other way round, a tick ahead. /api/window now ends its columns
    with the sample it answers from."""
    from exporter.http.page import window_payload

    runtime = build_runtime(
        load_config(env={}, snapshot_dir=str(tmp_path)), mode="demo", sources=[]
    )
    window = runtime.window
    samples = [
        Sample(timestamp=1000.0 + t, gpus=[gpu(0, UUID0, used=t * GiB, free=(80 - t) * GiB)])
        for t in range(4)
    ]
    for sample in samples[:2]:
        window(sample)
    # A tick behind: the sampler has published samples[2], its listeners have not run yet.
    runtime.sampler._state = dataclasses.replace(runtime.sampler.state(), sample=samples[2])
    body = window_payload(runtime, None)
    assert body["timestamps"] == [1000.0, 1001.0, 1002.0]
    assert body["gpus"][0]["series"]["used_bytes"][-1] == 2 * GiB
    assert window_payload(runtime, 1001.0)["timestamps"] == [1002.0]
    assert window_payload(runtime, 1002.0)["timestamps"] == []
    # A tick ahead: the window has samples[3], the state read before it is samples[2].
    window(samples[2])
    window(samples[3])
    assert window_payload(runtime, None)["timestamps"] == [1000.0, 1001.0, 1002.0]
    assert len(window) == 4  # nothing added to the window itself
