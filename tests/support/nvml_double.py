"""A test double of NVIDIA's NVML binding (module `pynvml`) serving NVML values captured on
a real GPU machine (tests/data/allocator_native.json, "nvml_raw"), raising the binding's own
exception classes. The real NVML is tested on the GPU machine (tests/gpu/test_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml


class NvmlErrors:
    """The binding's exception classes and constants a source looks up on its module."""

    NVMLError = pynvml.NVMLError
    NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_NoPermission = pynvml.NVMLError_NoPermission
    NVMLError_ArgumentVersionMismatch = pynvml.NVMLError_ArgumentVersionMismatch
    NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
    NVMLError_DriverNotLoaded = pynvml.NVMLError_DriverNotLoaded
    nvmlMemory_v2 = pynvml.nvmlMemory_v2


class FakeNvml(NvmlErrors):
    def __init__(self, raw: dict):
        self.raw = raw
        self.failures: dict[tuple[str, int], Exception] = {}
        self.calls: list[str] = []
        self.init_error: Exception | None = None
        # /dev/nvidia<minor> of each NVML index, where a test models it (DRA names GPUs by
        # it; on a real node it need not equal the index). Unset: NVML says NotSupported.
        self.minor_numbers: dict[int, int] = {}

    def _fail(self, name: str, index: int) -> None:
        self.calls.append(f"{name}:{index}")
        if (name, index) in self.failures:
            raise self.failures[(name, index)]

    def nvmlInit(self):
        self.calls.append("init")
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlSystemGetDriverVersion(self):
        return self.raw["driver_version"]

    def nvmlDeviceGetCount(self):
        return len(self.raw["devices"])

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for index, device in enumerate(self.raw["devices"]):
            if device["uuid"] == uuid:
                return index
        raise pynvml.NVMLError_NotFound()

    def nvmlDeviceGetMinorNumber(self, h):
        if h not in self.minor_numbers:
            raise pynvml.NVMLError_NotSupported()
        return self.minor_numbers[h]

    def nvmlDeviceGetUUID(self, h):
        return self.raw["devices"][h]["uuid"]

    def nvmlDeviceGetName(self, h):
        return self.raw["devices"][h]["name"].encode()  # older bindings return bytes

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.raw["devices"][h]["pci_bus_id"])

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        if version is None:
            self._fail("memory_v1", h)
            return SimpleNamespace(**self.raw["devices"][h]["memory_v1"])
        self._fail("memory_v2", h)
        return SimpleNamespace(**self.raw["devices"][h]["memory_v2"])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        self._fail("processes", h)
        return [SimpleNamespace(**p) for p in self.raw["devices"][h]["processes"]]
