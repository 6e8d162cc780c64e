"""The sampler: isolation of failing sources and listeners, merging, timing, thread life."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from exporter.sample import AllocatorReading, HostReading, Sample, SourceReading
from exporter.sampler import Sampler


class StaticSource:
    def __init__(self, name: str, reading: SourceReading | None = None, error: bool = False):
        self.name = name
        self.reading = reading or SourceReading()
        self.error = error
        self.reads = 0
        self.closed = False

    def read(self) -> SourceReading:
        self.reads += 1
        if self.error:
            raise RuntimeError(f"{self.name} broke")
        return self.reading

    def close(self) -> None:
        self.closed = True


def host_reading() -> SourceReading:
    return SourceReading(host=HostReading(100, 50, 10, 1))


def test_a_failing_source_is_down_and_the_others_still_report(caplog):
    good = StaticSource("host", host_reading())
    bad = StaticSource("nvml", error=True)
    sampler = Sampler([bad, good], clock=lambda: 42.0)
    with caplog.at_level(logging.ERROR):
        sample = sampler.tick()
        sampler.tick()
    assert sample.host is not None and sample.timestamp == 42.0
    state = sampler.state()
    assert state.sources["nvml"].up is False and state.sources["nvml"].errors == 2
    assert state.sources["host"].up is True and state.sources["host"].errors == 0
    # Rate-limited: two failures, one log line.
    assert len([r for r in caplog.records if "nvml broke" in r.getMessage()]) == 1


def test_readings_of_all_sources_are_merged():
    allocator = AllocatorReading(
        device=0,
        gpu_uuid="GPU-x",
        backend="native",
        expandable_segments=False,
        gauges={"reserved_bytes": 1},
    )
    sampler = Sampler(
        [
            StaticSource("torch", SourceReading(allocators=[allocator])),
            StaticSource("host", host_reading()),
        ]
    )
    sample = sampler.tick()
    assert sample.allocators == [allocator] and sample.host is not None
    assert sample.self_pid is not None  # this process, for NVML's per-process join
    assert sampler.latest is sample


def test_a_failing_listener_does_not_stop_sampling():
    seen: list[Sample] = []

    def broken(sample):
        raise ValueError("listener bug")

    sampler = Sampler([StaticSource("host", host_reading())], listeners=[broken, seen.append])
    sampler.tick()
    sampler.tick()
    assert len(seen) == 2


def test_the_thread_ticks_at_the_interval_and_stops_cleanly():
    source = StaticSource("host", host_reading())
    sampler = Sampler([source], interval_s=0.02)
    sampler.start()
    sampler.start()  # idempotent
    time.sleep(0.25)
    sampler.stop()
    reads = source.reads
    assert 5 <= reads <= 20
    assert source.closed
    time.sleep(0.05)
    assert source.reads == reads
    assert not any(t.name == "gpumem-sampler" for t in threading.enumerate())


def test_sample_age_uses_the_clock():
    now = [100.0]
    sampler = Sampler([StaticSource("host", host_reading())], clock=lambda: now[0])
    assert sampler.sample_age_s() is None
    sampler.tick()
    now[0] = 107.5
    assert sampler.sample_age_s() == pytest.approx(7.5)


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        Sampler([], interval_s=0)
