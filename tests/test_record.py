"""Recording a running exporter: scrape -> sample is the inverse of sample -> exposition."""

from __future__ import annotations

import dataclasses

import pytest

from exporter.record import RecordError, record_url, sample_from_exposition, scrape
from exporter.sources.replay import demo_trace_path, derive_recorded_non_allocator
from exporter.trace import TraceWriter, read_trace
from tests.helpers import captured_sample, render


@pytest.mark.parametrize("which", ["native", "expandable", "async"])
def test_round_trip_of_captured_samples(which):
    sample = captured_sample(which)
    back = sample_from_exposition(render(sample), timestamp=sample.timestamp)
    assert back.allocators == sample.allocators
    assert back.gpus == sample.gpus
    assert back.processes == sample.processes
    assert back.self_pid == sample.self_pid  # recovered from non_allocator_bytes


def test_round_trip_of_the_demo_trace():
    _, samples = read_trace(demo_trace_path())
    derive_recorded_non_allocator(samples)  # as the replay does
    assert any(s.processes_cached for s in samples)  # the trace reuses NVML's process list
    assert any(r.non_allocator_age_s for s in samples for r in s.allocators)
    for sample in samples[:: max(len(samples) // 20, 1)]:
        assert sample.host is not None
        back = sample_from_exposition(render(sample, replay=True), timestamp=sample.timestamp)
        # A scrape does not say whether the exporter reused its process list, nor the GPU's
        # minor number (kept for Kubernetes attribution, not a series), nor a MIG mode that is
        # off (gpu_mig_mode is served only where MIG is enabled or pending); a replay serves the
        # recorded process's RSS as host_process_* (from the sample's host_processes), never
        # under the `process_` names of its own process.
        expected = dataclasses.replace(
            sample,
            processes_cached=False,
            gpus=[
                dataclasses.replace(g, minor_number=None, mig_mode="", mig_mode_pending="")
                for g in sample.gpus
            ],
            host=dataclasses.replace(
                sample.host, process_resident_bytes=None, process_resident_peak_bytes=None
            ),
        )
        # What a scrape says of the latest OOM: its verdict, time and numbers (the demo serves
        # them), and the reason and action decided again from them; not the snapshot's id,
        # the other processes' pids, what was missing or the observer's time.
        if sample.allocators[0].last_oom is not None:
            got, recorded = back.allocators[0].last_oom, sample.allocators[0].last_oom
            assert got is not None
            for field in ("verdict", "timestamp", "reason", "action", "requested_bytes"):
                assert getattr(got, field) == getattr(recorded, field), field
            assert got.deciding_bytes() == recorded.deciding_bytes()
            back.allocators[0].last_oom = recorded
        assert back == expected


def test_scrape_errors_are_one_line():
    with pytest.raises(RecordError, match="cannot scrape"):
        scrape("http://127.0.0.1:9/metrics", timeout_s=2)


def test_record_url_writes_samples(tmp_path, monkeypatch):
    sample = captured_sample("native")
    monkeypatch.setattr("exporter.record.scrape", lambda url, **transport: render(sample))
    writer = TraceWriter(tmp_path / "t.gz")
    count = record_url(
        "http://x/metrics", writer, duration_s=0.05, interval_s=0.01, clock=lambda: 5.0
    )
    writer.close()
    _, samples = read_trace(tmp_path / "t.gz")
    assert count == len(samples) >= 2
    assert samples[0].allocators == sample.allocators


def test_own_pid_is_recovered_on_a_tick_that_reuses_the_process_list():
    """Between two reads of NVML's process list the exporter keeps the non-allocator bytes
    derived with the last list while reserved moves on: used = reserved + non-allocator no
    longer holds exactly, and the nearest process on the GPU is the exporter's."""
    from exporter.sample import AllocatorReading, GpuReading, ProcessGpuReading, Sample

    sample = Sample(
        timestamp=1.0,
        allocators=[
            AllocatorReading(
                0,
                "GPU-a",
                "native",
                False,
                gauges={"allocated_bytes": 900, "reserved_bytes": 1200},
            )
        ],
        gpus=[GpuReading(0, "GPU-a", total_bytes=10_000, used_bytes=4500, free_bytes=5500)],
        processes=[
            ProcessGpuReading(0, "GPU-a", 41, 1500),
            ProcessGpuReading(0, "GPU-a", 99, 3000),
        ],
        self_pid=41,
        processes_cached=True,
    )
    sample.allocators[0].non_allocator_bytes = 500  # taken when reserved was 1000
    back = sample_from_exposition(render(sample), timestamp=sample.timestamp)
    assert back.self_pid == 41


def test_named_components_round_trip_and_the_ledger_is_derived_not_read_back():
    sample = captured_sample("native")
    reading = sample.allocators[0]
    allocated = reading.gauges["allocated_bytes"]
    reading.components = {"weights": allocated // 2, "kv_cache": allocated // 4}
    text = render(sample)
    ledger_rows = [
        line for line in text.splitlines() if line.startswith("torch_cuda_memory_ledger_bytes{")
    ]
    parts = {
        row.split('component="')[1].split('"')[0]: float(row.split()[-1]) for row in ledger_rows
    }
    assert list(parts) == [
        "weights",
        "kv_cache",
        "private_pools",
        "other_live",
        "cached_free",
        "outside_allocator",
    ]
    assert reading.non_allocator_bytes is not None
    assert sum(parts.values()) == reading.gauges["reserved_bytes"] + reading.non_allocator_bytes
    back = sample_from_exposition(text, timestamp=sample.timestamp)
    assert back.allocators == sample.allocators
