"""The serving process's two NVML reads as single C calls (exporter.sources.own_process_reads),
called through ctypes as NVML's own functions are: the stand-ins here are C function pointers
(ctypes callbacks) filling the binding's real structs, so the buffers, the growth and the
PID lookup run as they do against libnvidia-ml. The real library is read by the GPU tests
(tests/gpu/test_gpu.py::test_non_allocator_bytes_is_nvml_used_minus_reserved)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from exporter.sources.own_process_reads import FIRST_CAPACITY, NOT_AVAILABLE, OwnProcessReads

GiB = 1 << 30

_LIST = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_uint),
    ctypes.POINTER(pynvml.c_nvmlProcessInfo_v3_t),
)
_MEMORY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(pynvml.c_nvmlMemory_t))


def c_library(processes: list[tuple[int, int]], used: int = 5 * GiB) -> Any:
    """A binding whose two functions are C function pointers answering as NVML does: the
    list into the caller's buffer, or INSUFFICIENT_SIZE with the count needed."""
    calls: dict[str, Any] = {"list": [], "memory": 0}

    @_LIST
    def running_processes(handle: Any, count: Any, entries: Any) -> int:
        calls["list"].append(count[0])
        if count[0] < len(processes):
            count[0] = len(processes)
            return 7  # NVML_ERROR_INSUFFICIENT_SIZE
        for index, (pid, bytes_) in enumerate(processes):
            entries[index].pid = pid
            entries[index].usedGpuMemory = bytes_
        count[0] = len(processes)
        return 0

    @_MEMORY
    def memory_info(handle: Any, memory: Any) -> int:
        calls["memory"] += 1
        memory[0].used = used
        return 0

    functions = {
        "nvmlDeviceGetComputeRunningProcesses_v3": running_processes,
        "nvmlDeviceGetMemoryInfo": memory_info,
    }
    return SimpleNamespace(
        _nvmlGetFunctionPointer=functions.__getitem__,
        c_nvmlProcessInfo_v3_t=pynvml.c_nvmlProcessInfo_v3_t,
        c_nvmlMemory_t=pynvml.c_nvmlMemory_t,
        NVMLError=pynvml.NVMLError,
        calls=calls,
    )


def test_one_call_reads_the_list_and_finds_the_process():
    nvml = c_library([(10, 1 * GiB), (42, 3 * GiB), (77, 2 * GiB)])
    reads = OwnProcessReads(nvml)
    assert reads.direct
    assert reads.used_by(None, 42) == 3 * GiB
    assert reads.used_by(None, 5) is None  # not listed
    assert reads.device_used(None) == 5 * GiB
    assert nvml.calls["list"] == [FIRST_CAPACITY, FIRST_CAPACITY]  # one driver call a read


def test_a_list_longer_than_the_buffer_grows_it_and_asks_again_once():
    processes = [(1000 + i, i * 1024) for i in range(FIRST_CAPACITY + 10)]
    nvml = c_library(processes)
    reads = OwnProcessReads(nvml)
    assert reads.used_by(None, 1000 + FIRST_CAPACITY + 9) == (FIRST_CAPACITY + 9) * 1024
    grown = (FIRST_CAPACITY + 10) * 2 + 5
    assert nvml.calls["list"] == [FIRST_CAPACITY, grown]
    assert reads.used_by(None, 1003) == 3 * 1024
    assert nvml.calls["list"][-1] == grown  # the grown buffer stays


def test_a_process_listed_without_a_number_has_none():
    reads = OwnProcessReads(c_library([(42, NOT_AVAILABLE)]))
    assert reads.used_by(None, 42) is None


def test_an_nvml_error_is_raised_as_the_bindings_error():
    nvml = c_library([])

    @_MEMORY
    def lost(handle: Any, memory: Any) -> int:
        return 15  # NVML_ERROR_GPU_IS_LOST

    nvml._nvmlGetFunctionPointer = {
        "nvmlDeviceGetComputeRunningProcesses_v3": nvml._nvmlGetFunctionPointer(
            "nvmlDeviceGetComputeRunningProcesses_v3"
        ),
        "nvmlDeviceGetMemoryInfo": lost,
    }.__getitem__
    reads = OwnProcessReads(nvml)
    with pytest.raises(pynvml.NVMLError) as raised:
        reads.device_used(None)
    assert raised.value.value == 15


def test_a_binding_without_the_private_parts_is_asked_through_its_public_calls():
    """The same answers from the binding's public calls (an older binding, a test double)."""
    entries = [
        SimpleNamespace(pid=10, usedGpuMemory=GiB),
        SimpleNamespace(pid=42, usedGpuMemory=None),
    ]
    public = SimpleNamespace(
        nvmlDeviceGetComputeRunningProcesses=lambda handle: entries,
        nvmlDeviceGetMemoryInfo=lambda handle: SimpleNamespace(used=5 * GiB),
    )
    reads = OwnProcessReads(public)
    assert not reads.direct
    assert reads.used_by("h", 10) == GiB
    assert reads.used_by("h", 42) is None  # listed without a number
    assert reads.used_by("h", 5) is None
    assert reads.device_used("h") == 5 * GiB
