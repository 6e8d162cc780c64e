"""A test double of NVIDIA's NVML binding (module `pynvml`) made only from the real
`nvidia-smi` captures (tests/support/nvidia_smi_capture.py): an H100 or an H200, MIG on or
off, idle or under load, and the in-slice case. It raises the binding's own exceptions.

Every number it answers comes from a named section of a capture (`-q` for memory and
processes, `-L` for MIG profiles and UUIDs, `--version` for the driver); tests/test_mig_captures.py
reads the files again and compares. What the captures cannot show, and how it is modelled
here (said so that nobody mistakes it for a capture):

- NVML's memory info v1 from `-q`'s numbers: v1's used includes the driver's reservation
  (docs FACTS: v1 used = v2 used + reserved), total and free as v2's.
- A MIG device's name is the GPU's name and ` MIG <profile>` (-L's profile), as NVML names
  MIG devices (-L prints that part of it).
- `nvmlDeviceGetMaxMigDeviceCount` answers how many MIG devices -L lists, plus
  `empty_slots`; NVML answers the hardware's maximum and NOT_FOUND for slots without a
  device, which `empty_slots` models.
- Processes of a GPU without MIG carry NVML's "not available" instance IDs.
- In a slice (`in_slice=K`): a container given only MIG device K. The parent GPU's memory
  is refused with NVML_ERROR_NO_PERMISSION (NVIDIA/nvidia-container-toolkit issues 842 and
  1363, k8s-device-plugin issue 1683; not captured), and only device K has a handle.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pynvml

from tests.support.nvidia_smi_capture import MIB, Gpu, MigDevice, driver_version, read
from tests.support.nvml_double import NvmlErrors

NOT_AVAILABLE = int(pynvml.NVML_VALUE_NOT_AVAILABLE_uint.value)  # 0xFFFFFFFF, as records carry it


@dataclass(frozen=True)
class _Parent:
    index: int


@dataclass(frozen=True)
class _Mig:
    parent: int
    index: int


class CapturedNvml(NvmlErrors):
    NVMLError_NotFound = pynvml.NVMLError_NotFound
    NVMLError_InvalidArgument = pynvml.NVMLError_InvalidArgument
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
    NVML_DEVICE_MIG_DISABLE = pynvml.NVML_DEVICE_MIG_DISABLE

    def __init__(
        self, capture: str, state: str, *, in_slice: int | None = None, empty_slots: int = 0
    ) -> None:
        self.capture, self.state = capture, state
        self.gpus: list[Gpu] = read(capture, state)
        self.driver = driver_version(capture)
        self.in_slice = in_slice
        # Fixed, as NVML's is (the hardware's maximum): a device destroyed later leaves its
        # slot NOT_FOUND, the rest keep their indices.
        self.max_count = [len(gpu.mig_devices) + empty_slots for gpu in self.gpus]
        self.calls: list[str] = []

    # -- handles ---------------------------------------------------------------------------

    def _gpu(self, handle: Any) -> Gpu:
        return self.gpus[handle.index if isinstance(handle, _Parent) else handle.parent]

    def _mig(self, handle: Any) -> MigDevice:
        if not isinstance(handle, _Mig):
            raise pynvml.NVMLError_InvalidArgument()
        for mig in self._gpu(handle).mig_devices:
            if mig.index == handle.index:
                return mig
        raise pynvml.NVMLError_NotFound()  # a handle of a MIG device destroyed since

    def _visible(self, gpu: Gpu) -> list[MigDevice]:
        if self.in_slice is None:
            return gpu.mig_devices
        return [m for m in gpu.mig_devices if m.index == self.in_slice]

    # -- the binding's calls ---------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Parent:
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        return _Parent(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        for at, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid:
                return _Parent(at)
            for mig in self._visible(gpu):
                if mig.uuid == uuid:
                    return _Mig(at, mig.index)
        raise pynvml.NVMLError_NotFound()

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> bool:
        return isinstance(handle, _Mig)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Any) -> _Parent:
        self._mig(handle)
        return _Parent(handle.parent)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._mig(handle).uuid if isinstance(handle, _Mig) else self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        name = self._gpu(handle).name
        return f"{name} MIG {self._mig(handle).profile}" if isinstance(handle, _Mig) else name

    def nvmlDeviceGetPciInfo(self, handle: Any) -> SimpleNamespace:
        return SimpleNamespace(busId=self._gpu(handle).pci_bus_id)

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        minor = self._gpu(handle).minor_number
        if minor is None or isinstance(handle, _Mig):
            raise pynvml.NVMLError_NotSupported()
        return minor

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> SimpleNamespace:
        self.calls.append(f"memory:{handle}")
        if isinstance(handle, _Mig):
            memory = self._mig(handle).memory
        else:
            if self.in_slice is not None:
                raise pynvml.NVMLError_NoPermission()
            memory = self._gpu(handle).memory
        total, reserved = memory.total * MIB, memory.reserved * MIB
        used, free = memory.used * MIB, memory.free * MIB
        if version is None:  # v1: used with the driver's reservation in it
            return SimpleNamespace(total=total, used=used + reserved, free=free)
        return SimpleNamespace(total=total, reserved=reserved, used=used, free=free)

    def nvmlDeviceGetMigMode(self, handle: Any) -> tuple[int, int]:
        if isinstance(handle, _Mig):
            raise pynvml.NVMLError_InvalidArgument()
        gpu = self._gpu(handle)
        return int(gpu.mig_current), int(gpu.mig_pending)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        if not self._gpu(handle).mig_current:
            return 0
        return self.max_count[handle.index]

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> _Mig:
        gpu = self._gpu(handle)
        for mig in self._visible(gpu):
            if mig.index == index:
                return _Mig(handle.index, index)
        raise pynvml.NVMLError_NotFound()

    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        return self._mig(handle).gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int:
        return self._mig(handle).compute_instance_id

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[SimpleNamespace]:
        """The parent's list holds every process, with its instance IDs; a MIG device's,
        those of its GPU instance and compute instance."""
        self.calls.append(f"processes:{handle}")
        gpu = self._gpu(handle)
        mig = self._mig(handle) if isinstance(handle, _Mig) else None
        return [
            SimpleNamespace(
                pid=p.pid,
                usedGpuMemory=p.used_mib * MIB,
                gpuInstanceId=NOT_AVAILABLE if p.gpu_instance_id is None else p.gpu_instance_id,
                computeInstanceId=(
                    NOT_AVAILABLE if p.compute_instance_id is None else p.compute_instance_id
                ),
            )
            for p in gpu.processes
            if mig is None
            or (p.gpu_instance_id, p.compute_instance_id)
            == (mig.gpu_instance_id, mig.compute_instance_id)
        ]
