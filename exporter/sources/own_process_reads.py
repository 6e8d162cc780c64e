"""The two NVML reads a serving process makes for its bytes outside the allocator, each one
C call into buffers made once.

nvidia-ml-py's `nvmlDeviceGetComputeRunningProcesses` asks the driver twice (how many, then
the list), makes a ctypes array and a Python object per process each time; its
`nvmlDeviceGetMemoryInfo` makes a struct per call. In the serving process, once every detail
interval on cold caches, that was 314 us of a 973 us full sample on an H200
(`python -m bench.probe_ticks --cold-parts 2`, docs/performance.md). Here the binding's own
function pointers and struct types are called directly: one driver call for the list (a
second only when the buffer is too small, which then grows), the PID looked up in place.

Where the binding lacks what this needs (an old binding, a test double), the binding's
public calls answer the same questions.
"""

from __future__ import annotations

import ctypes
from typing import Any

# Processes the list's buffer holds at first; it grows to what the driver asks for.
FIRST_CAPACITY = 64
NVML_SUCCESS = 0
NVML_ERROR_INSUFFICIENT_SIZE = 7
# NVML's "not available" (usedGpuMemory under WDDM, or not reported): 2^64 - 1.
NOT_AVAILABLE = ctypes.c_ulonglong(-1).value


class OwnProcessReads:
    """Device used memory and one process's used memory, from NVML; one thread at a time
    (the buffers are this object's)."""

    def __init__(self, nvml: Any) -> None:
        """`nvml`: the binding, initialized (its function pointers need the loaded library)."""
        self._nvml = nvml
        self._list: Any = None
        self._memory_info: Any = None
        try:
            pointer = nvml._nvmlGetFunctionPointer
            self._list = pointer("nvmlDeviceGetComputeRunningProcesses_v3")
            self._memory_info = pointer("nvmlDeviceGetMemoryInfo")
            self._entry_type = nvml.c_nvmlProcessInfo_v3_t
            self._memory = nvml.c_nvmlMemory_t()
        except Exception:  # no such private parts (a double, an older binding): public calls
            self._list = self._memory_info = None
            return
        self._entries = (self._entry_type * FIRST_CAPACITY)()
        self._count = ctypes.c_uint(0)

    @property
    def direct(self) -> bool:
        """Whether the C functions are called directly (else the binding's public calls)."""
        return self._list is not None

    def device_used(self, handle: Any) -> int:
        """The device's used memory (nvmlDeviceGetMemoryInfo's `used`)."""
        if self._memory_info is None:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(handle).used)
        code = self._memory_info(handle, ctypes.byref(self._memory))
        if code != NVML_SUCCESS:
            raise self._nvml.NVMLError(code)
        return int(self._memory.used)

    def used_by(self, handle: Any, pid: int) -> int | None:
        """What NVML's compute process list gives process `pid` on this device; None where it
        lists no such process, or lists it without a number."""
        if self._list is None:
            entries = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            used = [e.usedGpuMemory for e in entries if e.pid == pid]
            return int(used[0]) if used and used[0] is not None else None
        self._count.value = len(self._entries)
        code = self._list(handle, ctypes.byref(self._count), self._entries)
        if code == NVML_ERROR_INSUFFICIENT_SIZE:  # more processes than the buffer holds
            self._entries = (self._entry_type * (self._count.value * 2 + 5))()
            self._count.value = len(self._entries)
            code = self._list(handle, ctypes.byref(self._count), self._entries)
        if code != NVML_SUCCESS:
            raise self._nvml.NVMLError(code)
        entries = self._entries
        for index in range(self._count.value):
            entry = entries[index]
            if entry.pid == pid:
                used = entry.usedGpuMemory
                return None if used == NOT_AVAILABLE else int(used)
        return None
