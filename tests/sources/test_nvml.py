"""The NVML source against NVML values captured on 2x H200 (tests/data/allocator_native.json),
served by a test double that raises NVIDIA's own pynvml exception classes."""

from __future__ import annotations

import json

import pynvml
import pytest

from exporter.sources.nvml import INIT_RETRY_S, NvmlSource, NvmlUnavailable
from tests.conftest import DATA_DIR
from tests.support.nvml_double import FakeNvml


@pytest.fixture
def raw():
    return json.loads((DATA_DIR / "allocator_native.json").read_text())["nvml_raw"]


def test_reading_matches_nvml_v2_and_the_process_list(raw):
    reading = NvmlSource(FakeNvml(raw)).read()
    assert [g.index for g in reading.gpus] == list(range(len(raw["devices"])))
    for gpu, dev in zip(reading.gpus, raw["devices"], strict=True):
        v2 = dev["memory_v2"]
        assert (gpu.uuid, gpu.name, gpu.pci_bus_id) == (dev["uuid"], dev["name"], dev["pci_bus_id"])
        assert gpu.driver_version == raw["driver_version"]
        assert (gpu.total_bytes, gpu.used_bytes, gpu.free_bytes, gpu.driver_reserved_bytes) == (
            v2["total"],
            v2["used"],
            v2["free"],
            v2["reserved"],
        )
        # The v2 split is complete: total = used + free + driver reserved (seen on H200).
        assert gpu.used_bytes is not None and gpu.free_bytes is not None
        assert gpu.driver_reserved_bytes is not None
        assert gpu.total_bytes == gpu.used_bytes + gpu.free_bytes + gpu.driver_reserved_bytes
        # v1's used is v2's used plus what the driver reserves.
        assert dev["memory_v1"]["used"] == v2["used"] + v2["reserved"]
    expected = [
        (d["uuid"], p["pid"], p["usedGpuMemory"]) for d in raw["devices"] for p in d["processes"]
    ]
    assert [(p.gpu_uuid, p.pid, p.used_bytes) for p in reading.processes] == expected


def test_a_lost_gpu_is_reported_down_and_no_longer_polled(raw):
    nvml = FakeNvml(raw)
    nvml.failures[("memory_v2", 0)] = pynvml.NVMLError_GpuIsLost()
    source = NvmlSource(nvml)
    first = source.read()
    assert first.gpus[0].up is False and first.gpus[0].total_bytes is None
    assert all(g.up for g in first.gpus[1:])
    nvml.calls.clear()
    second = source.read()
    assert second.gpus[0].up is False
    assert not any(call.endswith(":0") for call in nvml.calls)


def test_v1_is_used_where_v2_is_not_supported(raw):
    nvml = FakeNvml(raw)
    nvml.failures[("memory_v2", 0)] = pynvml.NVMLError_NotSupported()
    gpu = NvmlSource(nvml).read().gpus[0]
    v1 = raw["devices"][0]["memory_v1"]
    assert (gpu.total_bytes, gpu.used_bytes, gpu.free_bytes) == (
        v1["total"],
        v1["used"],
        v1["free"],
    )
    assert gpu.driver_reserved_bytes is None and gpu.up


def test_per_process_refusal_is_a_state_not_a_failure(raw):
    nvml = FakeNvml(raw)
    nvml.failures[("processes", 0)] = pynvml.NVMLError_NoPermission()
    source = NvmlSource(nvml)
    reading = source.read()
    assert reading.gpus[0].up and reading.gpus[0].total_bytes is not None
    assert all(p.gpu_index != 0 for p in reading.processes)
    nvml.calls.clear()
    source.read()
    assert "processes:0" not in nvml.calls  # not asked again


def test_processes_without_a_reading_are_left_out(raw):
    raw["devices"][0]["processes"] = [
        {"pid": 1, "usedGpuMemory": None},
        {"pid": 2, "usedGpuMemory": 5},
    ]
    reading = NvmlSource(FakeNvml(raw)).read()
    assert [(p.pid, p.used_bytes) for p in reading.processes if p.gpu_index == 0] == [(2, 5)]


def test_init_failure_is_retried_slowly(raw):
    nvml = FakeNvml(raw)
    nvml.init_error = pynvml.NVMLError_Unknown()  # a driver that is there but fails
    now = [1000.0]
    source = NvmlSource(nvml, clock=lambda: now[0])
    with pytest.raises(NvmlUnavailable, match="NVML unavailable"):
        source.read()
    with pytest.raises(NvmlUnavailable):
        source.read()
    assert nvml.calls.count("init") == 1
    nvml.init_error = None
    now[0] += INIT_RETRY_S
    assert len(source.read().gpus) == len(raw["devices"])
    source.close()
    assert nvml.calls[-1] == "shutdown"


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (pynvml.NVMLError_LibraryNotFound(), "NVML Shared Library Not Found"),
        (pynvml.NVMLError_DriverNotLoaded(), "Driver Not Loaded"),
    ],
)
def test_a_host_without_nvml_is_no_data_with_its_reason_not_an_error(raw, error, reason):
    nvml = FakeNvml(raw)
    nvml.init_error = error
    now = [1000.0]
    source = NvmlSource(nvml, clock=lambda: now[0])
    for _ in range(3):  # every tick: no exception, the reason, nothing read
        reading = source.read()
        assert reading.unavailable == reason and not reading.gpus
        now[0] += 1
    assert nvml.calls.count("init") == 1  # not retried every tick
    nvml.init_error = None  # the driver was installed meanwhile
    now[0] += INIT_RETRY_S
    reading = source.read()
    assert reading.unavailable == "" and len(reading.gpus) == len(raw["devices"])


def test_a_host_without_a_gpu_is_no_data(raw):
    raw["devices"] = []
    nvml = FakeNvml(raw)
    reading = NvmlSource(nvml).read()
    assert reading.unavailable == "no GPU" and not reading.gpus
    assert nvml.calls[-1] == "shutdown"


def test_a_driver_that_answered_and_then_fails_is_an_error(raw):
    nvml = FakeNvml(raw)
    source = NvmlSource(nvml)
    source.read()
    nvml.failures[("memory_v2", 0)] = pynvml.NVMLError_Unknown()
    with pytest.raises(pynvml.NVMLError_Unknown):
        source.read()


def test_the_process_list_is_read_at_its_own_slower_pace(raw):
    nvml = FakeNvml(raw)
    now = [1000.0]
    source = NvmlSource(nvml, clock=lambda: now[0], process_interval_s=10.0)
    first = source.read()
    assert not first.processes_cached and first.processes
    for _ in range(9):
        now[0] += 1.0
        nvml.calls.clear()
        reading = source.read()
        assert reading.processes_cached and reading.processes == first.processes
        assert not any(call.startswith("processes") for call in nvml.calls)
        assert "memory_v2:0" in nvml.calls  # device memory is still read every tick
    now[0] += 1.0
    nvml.calls.clear()
    assert not source.read().processes_cached
    assert "processes:0" in nvml.calls


def test_only_the_gpus_asked_for_are_read(raw):
    """Embedded in a server: only the GPUs the process holds a context on."""
    assert len(raw["devices"]) >= 2
    nvml = FakeNvml(raw)
    wanted: set[str] = set()
    source = NvmlSource(nvml, only_uuids=lambda: wanted)
    nvml.calls.clear()
    reading = source.read()  # no context anywhere yet: nothing read, not even init
    assert not reading.gpus and not reading.processes and not nvml.calls
    assert reading.unavailable == "no GPU in use by this process (yet)"
    wanted.add(raw["devices"][1]["uuid"])
    reading = source.read()
    assert [g.uuid for g in reading.gpus] == [raw["devices"][1]["uuid"]]
    assert {p.gpu_uuid for p in reading.processes} <= wanted
    assert not any(call.endswith(":0") for call in nvml.calls)
    # A GPU the process starts using later gets its process list at once, not on the
    # next slow round, read with the others' (one reading, from which the non-allocator
    # bytes of every GPU are derived together).
    wanted.add(raw["devices"][0]["uuid"])
    nvml.calls.clear()
    reading = source.read()
    assert not reading.processes_cached and "processes:0" in nvml.calls
    assert "processes:1" in nvml.calls
    assert source.read().processes_cached


def test_a_new_user_of_a_gpu_gets_the_process_list_read_at_once(raw):
    """Under `run`, a process that joins gets its non-allocator bytes on its first tick,
    not up to process_interval_s later."""
    nvml = FakeNvml(raw)
    users: set[tuple[str, str]] = set()
    source = NvmlSource(nvml, clock=lambda: 1000.0, users=lambda: frozenset(users))
    assert not source.read().processes_cached
    assert source.read().processes_cached
    users.add(("4242", raw["devices"][0]["uuid"]))  # a rank reported its allocator
    assert not source.read().processes_cached
    assert source.read().processes_cached


def test_the_process_list_is_read_on_the_tick_after_a_gpu_s_memory_moved(raw):
    """Per-process memory is at most one tick old after memory moves: the device reading
    (every tick) says when, not the slow round."""
    nvml = FakeNvml(raw)
    now = [1000.0]
    source = NvmlSource(nvml, clock=lambda: now[0], process_interval_s=10.0)
    source.read()
    memory = raw["devices"][1]["memory_v2"]
    (entry,) = raw["devices"][0]["processes"]

    def tick() -> bool:
        now[0] += 1.0
        return not source.read().processes_cached

    assert not tick()
    # A process allocates 1 GiB on the second GPU.
    memory["used"] += 1 << 30
    raw["devices"][1]["processes"] = [{"pid": 77, "usedGpuMemory": 1 << 30}]
    assert tick()
    assert source.read().processes[-1].used_bytes == 1 << 30
    assert not tick()
    # Below NVML's 2 MiB page: no new list until the slow round.
    memory["used"] += 1 << 19
    assert not tick()
    # Its memory goes; the list is read at once and the process is gone from it.
    memory["used"] -= 1 << 30
    raw["devices"][1]["processes"] = []
    assert tick()
    reading = source.read()
    assert [p.pid for p in reading.processes] == [entry["pid"]]
