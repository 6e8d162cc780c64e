"""NVML: device memory, per-process memory and device identity.

Uses NVIDIA's `nvidia-ml-py` binding (module `pynvml`). NVML never creates a CUDA context, so
it is safe to read every GPU the container can see. Errors that describe the device rather
than a bug (lost, not supported, no permission) become states on the reading, not failures:
a node with one lost GPU still reports the others.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from exporter.sample import GpuReading, ProcessGpuReading, SourceReading

log = logging.getLogger(__name__)

# nvmlInit costs ~10 ms and fails fast where there is no driver; retry at this pace.
INIT_RETRY_S = 60.0


class NvmlUnavailable(RuntimeError):
    """NVML could not be initialized (no driver, no library): a state, retried later."""


class _Device:
    """Static facts about one GPU, read once, and whether it still answers."""

    def __init__(self, nvml: Any, index: int) -> None:
        self.index = index
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.uuid = _text(nvml.nvmlDeviceGetUUID(self.handle))
        self.name = _text(nvml.nvmlDeviceGetName(self.handle))
        try:
            self.pci_bus_id = _text(nvml.nvmlDeviceGetPciInfo(self.handle).busId)
        except nvml.NVMLError:
            self.pci_bus_id = ""
        self.lost = False
        self.memory_v2 = True
        self.processes_supported = True


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlSource:
    name = "nvml"

    def __init__(self, nvml_module: Any = None, clock: Any = time.monotonic) -> None:
        self._nvml = nvml_module
        self._clock = clock
        self._devices: list[_Device] | None = None
        self._driver_version = ""
        self._next_init = 0.0
        # Host PIDs with memory on some GPU at the last read (the node daemon reads their
        # host memory too: exporter.sources.process_memory).
        self.last_pids: frozenset[int] = frozenset()

    def _init(self) -> list[_Device]:
        if self._devices is not None:
            return self._devices
        now = self._clock()
        if now < self._next_init:
            raise NvmlUnavailable("NVML unavailable (retrying later)")
        self._next_init = now + INIT_RETRY_S
        if self._nvml is None:
            import pynvml  # nvidia-ml-py

            self._nvml = pynvml
        nvml = self._nvml
        try:
            nvml.nvmlInit()
            self._driver_version = _text(nvml.nvmlSystemGetDriverVersion())
            self._devices = [_Device(nvml, i) for i in range(nvml.nvmlDeviceGetCount())]
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML unavailable: {exc}") from exc
        return self._devices

    def read(self) -> SourceReading:
        devices = self._init()
        reading = SourceReading()
        for device in devices:
            gpu, processes = self._read_device(device)
            reading.gpus.append(gpu)
            reading.processes.extend(processes)
        self.last_pids = frozenset(p.pid for p in reading.processes)
        return reading

    def _read_device(self, device: _Device) -> tuple[GpuReading, list[ProcessGpuReading]]:
        nvml = self._nvml
        gpu = GpuReading(
            index=device.index,
            uuid=device.uuid,
            name=device.name,
            driver_version=self._driver_version,
            pci_bus_id=device.pci_bus_id,
        )
        if device.lost:
            gpu.up = False
            return gpu, []
        try:
            self._read_memory(device, gpu)
        except nvml.NVMLError_GpuIsLost:
            log.error("GPU %s (%s) is lost; no longer polling it", device.index, device.uuid)
            device.lost = True
            gpu.up = False
            return gpu, []
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_NoPermission) as exc:
            log.debug("memory info of GPU %s: %s", device.index, exc)
            gpu.up = False
            return gpu, []
        return gpu, self._read_processes(device)

    def _read_memory(self, device: _Device, gpu: GpuReading) -> None:
        nvml = self._nvml
        if device.memory_v2:
            try:
                mem = nvml.nvmlDeviceGetMemoryInfo(device.handle, version=nvml.nvmlMemory_v2)
            except (nvml.NVMLError_NotSupported, nvml.NVMLError_ArgumentVersionMismatch):
                device.memory_v2 = False
            else:
                gpu.total_bytes = int(mem.total)
                gpu.used_bytes = int(mem.used)
                gpu.free_bytes = int(mem.free)
                gpu.driver_reserved_bytes = int(mem.reserved)
                return
        # v1: `used` includes what the driver reserves, which v1 cannot tell apart.
        mem = nvml.nvmlDeviceGetMemoryInfo(device.handle)
        gpu.total_bytes = int(mem.total)
        gpu.used_bytes = int(mem.used)
        gpu.free_bytes = int(mem.free)

    def _read_processes(self, device: _Device) -> list[ProcessGpuReading]:
        if not device.processes_supported:
            return []
        nvml = self._nvml
        try:
            entries = nvml.nvmlDeviceGetComputeRunningProcesses(device.handle)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_NoPermission) as exc:
            log.info("per-process memory of GPU %s unavailable: %s", device.index, exc)
            device.processes_supported = False
            return []
        return [
            ProcessGpuReading(
                gpu_index=device.index,
                gpu_uuid=device.uuid,
                pid=int(entry.pid),
                used_bytes=int(entry.usedGpuMemory),
            )
            for entry in entries
            # None when the driver withholds it (e.g. without the host PID namespace).
            if entry.usedGpuMemory is not None
        ]

    def close(self) -> None:
        if self._devices is not None and self._nvml is not None:
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()
            self._devices = None
