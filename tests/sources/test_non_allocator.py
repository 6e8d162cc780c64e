"""Non-allocator bytes taken by the process itself, only from readings that agree, against
NVML values and allocator stats captured on an H200 (tests/data/allocator_native.json). The
real NVML and allocator: tests/gpu/test_gpu_freshness.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from exporter.sample import AllocatorReading
from exporter.sources.non_allocator import NonAllocatorReader
from exporter.sources.torch_allocator import TorchAllocatorSource
from tests.conftest import DATA_DIR
from tests.helpers import FakeCuda, fake_torch
from tests.support.nvml_double import FakeNvml

MiB = 1 << 20


@pytest.fixture
def capture():
    return json.loads((DATA_DIR / "allocator_native.json").read_text())


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _setup(capture):
    raw = capture["nvml_raw"]
    nvml = FakeNvml(raw)
    clock = Clock()
    probe = NonAllocatorReader(nvml, clock=clock, pid=lambda: capture["pid"], refresh_s=10.0)
    device = raw["devices"][0]
    (listed,) = device["processes"]
    reserved = capture["memory_stats_as_nested_dict"]["reserved_bytes"]["all"]["current"]
    return nvml, clock, probe, device, listed, reserved


def _reading(device: dict, reserved: int) -> AllocatorReading:
    return AllocatorReading(0, device["uuid"], "native", False, gauges={"reserved_bytes": reserved})


def _process_reads(nvml: FakeNvml) -> int:
    return sum(call.startswith("processes") for call in nvml.calls)


def test_taken_from_a_process_list_between_two_equal_reservations(capture):
    nvml, _clock, probe, device, listed, reserved = _setup(capture)
    reading = _reading(device, reserved)
    probe.apply([reading], lambda index: (reserved, None, None))
    assert reading.non_allocator_bytes == listed["usedGpuMemory"] - reserved
    assert reading.non_allocator_age_s == 0.0
    assert _process_reads(nvml) == 1


def test_readings_that_disagree_are_never_published_and_the_last_value_ages(capture):
    nvml, clock, probe, device, listed, reserved = _setup(capture)
    first = _reading(device, reserved)
    probe.apply([first], lambda index: (reserved, None, None))
    expected = listed["usedGpuMemory"] - reserved

    # The server grows its cache by 512 MiB while the list is read: NVML's used may or may
    # not include it, so nothing is taken from this tick; the last value stays, older.
    listed["usedGpuMemory"] += 512 * MiB
    device["memory_v1"]["used"] += 512 * MiB
    clock.now += 1.0
    nvml.calls.clear()
    moving = _reading(device, reserved)
    probe.apply([moving], lambda index: (reserved + 512 * MiB, None, None))
    assert _process_reads(nvml) == 1  # the list was read: memory moved
    assert moving.non_allocator_bytes == expected  # not expected + 512 MiB
    assert moving.non_allocator_age_s == 1.0

    # Next tick the allocator reads the new reserved, and it holds across the list.
    clock.now += 1.0
    settled = _reading(device, reserved + 512 * MiB)
    probe.apply([settled], lambda index: (reserved + 512 * MiB, None, None))
    assert settled.non_allocator_bytes == expected
    assert settled.non_allocator_age_s == 0.0


def test_a_segment_that_came_and_went_while_the_list_was_read_is_no_agreement(capture):
    """A server emptying its cache: a segment cudaMalloc'd and cudaFree'd between the two
    reads leaves reserved equal while NVML's list may have seen it; the allocator's counts of
    those calls say so (an H100 under such churn served values 92 MiB off without this)."""
    nvml, _clock, probe, device, listed, reserved = _setup(capture)
    reading = _reading(device, reserved)
    reading.counters = {"device_malloc": 40, "device_free": 30}
    listed["usedGpuMemory"] += 92 * MiB  # the list saw the passing segment
    probe.apply([reading], lambda index: (reserved, 41, 31))
    assert reading.non_allocator_bytes is None
    assert _process_reads(nvml) == 1
    listed["usedGpuMemory"] -= 92 * MiB
    again = _reading(device, reserved)
    again.counters = {"device_malloc": 41, "device_free": 31}
    probe.apply([again], lambda index: (reserved, 41, 31))  # nothing came or went
    assert again.non_allocator_bytes == listed["usedGpuMemory"] - reserved


def test_without_a_first_agreeing_reading_there_is_no_value(capture):
    _nvml, _clock, probe, device, _listed, reserved = _setup(capture)
    reading = _reading(device, reserved)
    probe.apply([reading], lambda index: (reserved + 2 * MiB, None, None))
    assert reading.non_allocator_bytes is None and reading.non_allocator_age_s is None


def test_the_list_is_read_when_memory_moves_and_otherwise_every_refresh(capture):
    nvml, clock, probe, device, listed, reserved = _setup(capture)
    probe.apply([_reading(device, reserved)], lambda index: (reserved, None, None))
    for _ in range(5):  # nothing moved: the device reading only
        clock.now += 1.0
        nvml.calls.clear()
        reading = _reading(device, reserved)
        probe.apply([reading], lambda index: (reserved, None, None))
        assert _process_reads(nvml) == 0 and "memory_v1:0" in nvml.calls
        assert reading.non_allocator_age_s == clock.now - 1000.0

    # NCCL takes 900 MiB outside the allocator: the device's used moves, reserved does not.
    listed["usedGpuMemory"] += 900 * MiB
    device["memory_v1"]["used"] += 900 * MiB
    clock.now += 1.0
    nvml.calls.clear()
    reading = _reading(device, reserved)
    probe.apply([reading], lambda index: (reserved, None, None))
    assert _process_reads(nvml) == 1
    assert reading.non_allocator_bytes == listed["usedGpuMemory"] - reserved
    assert reading.non_allocator_age_s == 0.0

    # Half a MiB is below NVML's page: no new list.
    device["memory_v1"]["used"] += MiB // 2
    clock.now += 1.0
    nvml.calls.clear()
    probe.apply([_reading(device, reserved)], lambda index: (reserved, None, None))
    assert _process_reads(nvml) == 0

    # Reserved moving is a reason too.
    reserved += 2 * MiB

    def reads_after(seconds: float) -> int:
        clock.now += seconds
        nvml.calls.clear()
        probe.apply([_reading(device, reserved)], lambda index: (reserved, None, None))
        return _process_reads(nvml)

    assert reads_after(1.0) == 1
    # The refresh period, while the GPU's used memory has moved at all since the list (by
    # less than a page here, which alone is no reason) ...
    device["memory_v1"]["used"] += MiB // 2
    assert reads_after(9.0) == 0 and reads_after(1.0) == 1
    # ... and STEADY_REFRESHES of it while it stands exactly still: nothing on the GPU took
    # or gave back a byte, so this process's share has not moved.
    assert reads_after(10.0) == 0 and reads_after(49.0) == 0 and reads_after(1.0) == 1
    # A byte moving brings the ordinary period back.
    device["memory_v1"]["used"] += 4096
    assert reads_after(9.0) == 0 and reads_after(1.0) == 1


def test_a_process_nvml_does_not_list_gets_no_value(capture):
    """Another PID namespace: NVML lists other PIDs; nothing is guessed."""
    _nvml, _clock, probe, device, listed, reserved = _setup(capture)
    listed["pid"] += 1
    reading = _reading(device, reserved)
    probe.apply([reading], lambda index: (reserved, None, None))
    assert reading.non_allocator_bytes is None


def test_a_process_nvml_lists_late_gets_its_value_soon_and_one_never_listed_is_read_rarely(
    capture,
):
    """Right after a process makes its context NVML may not list it yet: the list is read
    again after FIRST_RETRY_S, then after twice as long each time, up to refresh_s (a process
    in another PID namespace is never listed: no read every tick)."""
    from exporter.sources.non_allocator import FIRST_RETRY_S

    nvml, clock, probe, device, listed, reserved = _setup(capture)
    listed["pid"] += 1  # not (yet) this process
    probe.apply([_reading(device, reserved)], lambda index: (reserved, None, None))
    assert probe.retry_in() == FIRST_RETRY_S
    waits = []
    for _ in range(7):
        nvml.calls.clear()
        clock.now += probe.retry_in() - 0.01
        probe.apply([_reading(device, reserved)], lambda index: (reserved, None, None))
        assert _process_reads(nvml) == 0  # not before its time
        clock.now += 0.01
        assert probe.retry_in() == 0.0
        probe.apply([_reading(device, reserved)], lambda index: (reserved, None, None))
        assert _process_reads(nvml) == 1
        waits.append(probe.retry_in())
    assert waits == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]  # up to refresh_s
    listed["pid"] -= 1  # now NVML lists it
    clock.now += probe.retry_in()
    reading = _reading(device, reserved)
    probe.apply([reading], lambda index: (reserved, None, None))
    assert reading.non_allocator_bytes == listed["usedGpuMemory"] - reserved
    assert probe.retry_in() is None


def test_without_nvml_nothing_is_raised_and_init_is_retried_slowly(capture):
    import pynvml

    nvml, clock, probe, device, _listed, reserved = _setup(capture)
    nvml.init_error = pynvml.NVMLError_LibraryNotFound()
    reading = _reading(device, reserved)
    probe.apply([reading], lambda index: (reserved, None, None))
    probe.apply([reading], lambda index: (reserved, None, None))
    assert reading.non_allocator_bytes is None
    assert nvml.calls.count("init") == 1
    nvml.init_error = None
    clock.now += 61.0
    probe.apply([reading], lambda index: (reserved, None, None))
    assert reading.non_allocator_bytes is not None


def test_a_failing_gpu_leaves_the_others_their_value(capture):
    import pynvml

    nvml, _clock, probe, device, _listed, reserved = _setup(capture)
    nvml.failures[("processes", 0)] = pynvml.NVMLError_GpuIsLost()
    reading = _reading(device, reserved)
    probe.apply([reading], lambda index: (reserved, None, None))  # must not raise
    assert reading.non_allocator_bytes is None


class MovingCuda(FakeCuda):
    """The allocator as a server that grows its cache between the stats reads of one tick."""

    def __init__(self, stats: dict, uuid: str) -> None:
        super().__init__(stats, True, {0}, count=1)
        self.uuid = uuid
        self.grow_after_read = 0

    def memory_stats_as_nested_dict(self, device=None):
        stats = json.loads(json.dumps(super().memory_stats_as_nested_dict(device)))
        self.stats["reserved_bytes"]["all"]["current"] += self.grow_after_read
        return stats

    def get_device_properties(self, index):
        return SimpleNamespace(uuid=self.uuid)


def test_the_allocator_source_reads_reserved_again_after_the_list(capture):
    """Wired in the real source: a cache that grows between the tick's stats read and the
    read after the list gives no new value."""
    raw = capture["nvml_raw"]
    device = raw["devices"][0]
    cuda = MovingCuda(capture["memory_stats_as_nested_dict"], device["uuid"])
    nvml = FakeNvml(raw)
    probe = NonAllocatorReader(nvml, pid=lambda: capture["pid"])
    source = TorchAllocatorSource(fake_torch(cuda), env={}, non_allocator=probe)
    cuda.grow_after_read = 64 * MiB
    (reading,) = source.read().allocators
    assert reading.non_allocator_bytes is None
    cuda.grow_after_read = 0
    (reading,) = source.read().allocators
    reserved = reading.gauges["reserved_bytes"]
    assert reading.non_allocator_bytes == device["processes"][0]["usedGpuMemory"] - reserved
    source.close()
    assert "shutdown" in nvml.calls
