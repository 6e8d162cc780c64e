"""NVML: device memory, per-process memory and device identity.

Uses NVIDIA's `nvidia-ml-py` binding (module `pynvml`). NVML never creates a CUDA context, so
it is safe to read every GPU the container can see. Errors that describe the device rather
than a bug (lost, not supported, no permission) become states on the reading, not failures:
a node with one lost GPU still reports the others. A host without the NVML library, without
a loaded driver or without a GPU is "no data" with its reason (SourceReading.unavailable),
not an error every tick; a driver that answered once and then fails is an error.

Costs (2x H200, measured): memory info ~5 us per GPU, the process list ~35 us per GPU. The
memory info is read every tick; the process list on the tick after memory moved, and every
`process_interval_s` while it stands still (then reused, and the sample says so).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Hashable
from typing import Any

from exporter.sample import GpuReading, MigInstanceReading, ProcessGpuReading, SourceReading
from exporter.sources import DEVICE_MEMORY, PROCESS_MEMORY

log = logging.getLogger(__name__)

# nvmlInit costs ~10 ms and fails fast where there is no driver; retry at this pace.
INIT_RETRY_S = 60.0
# NVML's process list (~35 us per GPU) is read again on the tick that sees a GPU's used
# memory move by more than this (the device reading, ~5 us, is taken every tick), and at
# least every PROCESS_INTERVAL_S: a process that freed what another took leaves used
# unchanged. Below NVML's 2 MiB page, so that any allocation counts.
CHANGE_BYTES = 1 << 20
PROCESS_INTERVAL_S = 10.0


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
        self.minor_number = _minor_number(nvml, self.handle)
        self.mig_mode: tuple[str, str] = ("", "")
        self._mode_said: tuple[str, str] = ("", "")  # a pending mode change logged once
        self.migs: list[_MigDevice] = []
        # One MIG device per GPU instance: its compute instances report the same memory.
        self.instances: dict[int, list[_MigDevice]] = {}
        self.find_migs(nvml)
        self.lost = False
        self.migs_stale = False  # an instance did not answer: read the MIG devices again
        self.refused_logged = False  # the parent's memory refused (in a MIG slice): said once
        self.memory_v2 = True
        self.processes_supported = True

    @property
    def mig_uuids(self) -> list[str]:
        return [mig.uuid for mig in self.migs]

    def find_migs(self, nvml: Any) -> None:
        """The GPU's MIG mode and devices, read again whenever they may have changed (an
        instance that vanished, the process list's read): MIG can be reconfigured live."""
        self.mig_mode = _mig_mode(nvml, self.handle)
        current, pending = self.mig_mode
        if pending != current and self.mig_mode != self._mode_said:
            log.info(
                "GPU %s: MIG mode is %s, %s pending (takes effect after a GPU reset)",
                self.index,
                current,
                pending,
            )
        self._mode_said = self.mig_mode
        self.migs = _mig_devices(nvml, self.handle) if current == "enabled" else []
        self.instances = {}
        for mig in self.migs:
            self.instances.setdefault(mig.gpu_instance_id, []).append(mig)


def _minor_number(nvml: Any, handle: Any) -> int | None:
    """The N of /dev/nvidiaN, which GKE's device plugin names GPUs by; None where NVML has
    none (not Linux, or a binding that lacks the call)."""
    try:
        return int(nvml.nvmlDeviceGetMinorNumber(handle))
    except (nvml.NVMLError, AttributeError):
        return None


def _mig_mode(nvml: Any, handle: Any) -> tuple[str, str]:
    """(current, pending) MIG mode, "enabled"/"disabled"; ("", "") where there is no MIG."""
    try:
        current, pending = nvml.nvmlDeviceGetMigMode(handle)
    except (nvml.NVMLError, AttributeError):
        return "", ""
    enabled = nvml.NVML_DEVICE_MIG_ENABLE
    return (
        "enabled" if current == enabled else "disabled",
        "enabled" if pending == enabled else "disabled",
    )


class _MigDevice:
    """One MIG device (a compute instance of a GPU instance), read once."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.handle = handle
        self.uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        self.gpu_instance_id = int(nvml.nvmlDeviceGetGpuInstanceId(handle))
        try:
            self.profile = gpu_instance_profile(_text(nvml.nvmlDeviceGetName(handle)))
        except nvml.NVMLError:
            self.profile = ""


def gpu_instance_profile(name: str) -> str:
    """The GPU instance's profile from a MIG device's NVML name ("NVIDIA H100 80GB HBM3 MIG
    3g.40gb"): `3g.40gb`, also for a compute instance of it (`1c.3g.71gb` -> `3g.71gb`, as
    nvidia-smi -L lists one of several); "" where the name has none. Never from sizes."""
    _, found, profile = name.rpartition(" MIG ")
    if not found:
        return ""
    parts = profile.split(".")
    return ".".join(parts[1:]) if len(parts) == 3 and parts[0].endswith("c") else profile


def _mig_devices(nvml: Any, handle: Any) -> list[_MigDevice]:
    """The GPU's MIG devices (MIG mode on), whose UUIDs (MIG-...) the device plugin assigns
    to pods under the MIG strategies; [] where NVML cannot list them."""
    try:
        count = nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except (nvml.NVMLError, AttributeError):
        return []
    found = []
    for index in range(count):
        try:
            found.append(_MigDevice(nvml, nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)))
        except nvml.NVMLError:  # NotFound: that slot holds no MIG device
            continue
    return found


def _instance_of(entry: Any, device: _Device) -> int | None:
    """The MIG GPU instance a process record runs in; None off MIG (NVML's "not
    available" ID) or for an instance this reader does not know (yet)."""
    instance = getattr(entry, "gpuInstanceId", None)
    return instance if isinstance(instance, int) and instance in device.instances else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlSource:
    name = "nvml"
    provides = frozenset({DEVICE_MEMORY, PROCESS_MEMORY})

    def __init__(
        self,
        nvml_module: Any = None,
        clock: Any = time.monotonic,
        *,
        only_uuids: Callable[[], Collection[str]] | None = None,
        why_idle: Callable[[], str] | None = None,
        process_interval_s: float = PROCESS_INTERVAL_S,
        users: Callable[[], Hashable] | None = None,
    ) -> None:
        self._nvml = nvml_module
        self._clock = clock
        # Embedded in a server: only the GPUs this process holds a context on (their UUIDs,
        # from the allocator source). Every GPU of the node is the node daemon's job.
        self._only_uuids = only_uuids
        # Why the process uses no GPU, in its allocator source's words (a CPU-only torch).
        self._why_idle = why_idle
        self._process_interval_s = process_interval_s
        # Who uses the GPUs (under `run`: each reporting process and its GPUs). When that
        # changes, the list is read at once: a process that just joined gets its
        # non-allocator bytes on its first tick, not up to process_interval_s later.
        self._users = users
        self._users_at_read: Hashable = None
        self._devices: list[_Device] | None = None
        self._driver_version = ""
        self._next_init = 0.0
        self._absent = ""  # why there is no NVML here, while there is none
        self._processes: dict[str, list[ProcessGpuReading]] = {}  # by GPU UUID
        # What each MIG GPU instance's processes hold, by GPU UUID, as of the last list.
        self._instance_processes: dict[str, dict[int, int]] = {}
        self._processes_due = 0.0
        self._used_at_read: dict[str, int] = {}  # each GPU's used memory then
        # Host PIDs with memory on some GPU at the last read (the node daemon reads their
        # host memory too: exporter.sources.process_memory).
        self.last_pids: frozenset[int] = frozenset()

    def _init(self) -> list[_Device] | None:
        """The devices, or None while NVML is absent (self._absent says why)."""
        if self._devices is not None:
            return self._devices
        now = self._clock()
        if now < self._next_init:
            if self._absent:
                return None
            raise NvmlUnavailable("NVML unavailable (retrying later)")
        self._next_init = now + INIT_RETRY_S
        if self._nvml is None:
            import pynvml  # nvidia-ml-py

            self._nvml = pynvml
        nvml = self._nvml
        try:
            nvml.nvmlInit()
            self._driver_version = _text(nvml.nvmlSystemGetDriverVersion())
            devices = [_Device(nvml, i) for i in range(nvml.nvmlDeviceGetCount())]
        except (nvml.NVMLError_LibraryNotFound, nvml.NVMLError_DriverNotLoaded) as exc:
            # A host without a GPU stack: nothing to read, and nothing wrong.
            self._set_absent(str(exc))
            return None
        except nvml.NVMLError as exc:
            self._absent = ""
            raise NvmlUnavailable(f"NVML unavailable: {exc}") from exc
        if not devices:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlShutdown()
            self._set_absent("no GPU")
            return None
        if self._absent:
            log.info("NVML is available now (%d GPUs)", len(devices))
        self._absent = ""
        self._devices = devices
        return devices

    def _set_absent(self, reason: str) -> None:
        if reason != self._absent:
            log.info(
                "no GPU data from NVML on this host: %s (checked again every %.0f s)",
                reason,
                INIT_RETRY_S,
            )
        self._absent = reason

    def read(self) -> SourceReading:
        wanted = self._only_uuids() if self._only_uuids is not None else None
        if wanted is not None and not wanted:  # NVML is not even loaded then
            why = self._why_idle() if self._why_idle is not None else ""
            return SourceReading(unavailable=why or "no GPU in use by this process (yet)")
        devices = self._init()
        if devices is None:
            return SourceReading(unavailable=self._absent)
        if wanted is not None:
            devices = [d for d in devices if d.uuid in wanted]
        now = self._clock()
        # Who uses which GPUs, as far as this source knows: the GPUs it reads (an embedded
        # process that just initialized one more) and the users it is told of. A change
        # reads the whole list at once, so that the sample's processes stay one reading.
        users = (
            frozenset(d.uuid for d in devices),
            self._users() if self._users is not None else None,
        )
        # MIG can be reconfigured while the daemon runs: its devices are read again with the
        # process list's period, and at once where an instance stopped answering.
        periodic = now >= self._processes_due
        for device in devices:
            if (device.migs_stale or (periodic and device.mig_mode[0])) and not device.lost:
                device.migs_stale = False
                device.find_migs(self._nvml)
        gpus = [self._read_device(device) for device in devices]
        used = {gpu.uuid: gpu.used_bytes for gpu in gpus if gpu.used_bytes is not None}
        read_processes = (
            now >= self._processes_due or users != self._users_at_read or self._moved(used)
        )
        if read_processes:
            self._processes_due = now + self._process_interval_s
            self._users_at_read = users
            self._used_at_read = used
            self._processes = {}
        reading = SourceReading(processes_cached=not read_processes, gpus=gpus)
        for device, gpu in zip(devices, gpus, strict=True):
            if read_processes:
                self._processes[device.uuid] = self._read_processes(device) if gpu.up else []
            reading.processes.extend(self._processes[device.uuid])
            if device.instances and not device.lost:
                reading.mig_instances.extend(self._read_instances(device))
        self.last_pids = frozenset(p.pid for p in reading.processes)
        return reading

    def _moved(self, used: dict[str, int]) -> bool:
        """Whether some GPU's used memory moved (or the GPUs answering changed) since the
        process list was read: then the list is read on this tick, not up to
        process_interval_s later."""
        before = self._used_at_read
        if used.keys() != before.keys():
            return True
        return any(abs(value - before[uuid]) > CHANGE_BYTES for uuid, value in used.items())

    def _read_device(self, device: _Device) -> GpuReading:
        nvml = self._nvml
        gpu = GpuReading(
            index=device.index,
            uuid=device.uuid,
            name=device.name,
            driver_version=self._driver_version,
            pci_bus_id=device.pci_bus_id,
            minor_number=device.minor_number,
            mig_uuids=device.mig_uuids,
            mig_mode=device.mig_mode[0],
            mig_mode_pending=device.mig_mode[1],
        )
        if device.lost:
            gpu.up = False
            return gpu
        try:
            self._read_memory(device, gpu)
        except nvml.NVMLError_GpuIsLost:
            log.error("GPU %s (%s) is lost; no longer polling it", device.index, device.uuid)
            device.lost = True
            gpu.up = False
        except nvml.NVMLError_NoPermission as exc:
            if not device.migs:
                log.debug("memory info of GPU %s: %s", device.index, exc)
                gpu.up = False
                return gpu
            # Inside a MIG slice: the parent's memory is refused while its MIG devices
            # answer. The GPU is there (never "down", never 0): its instance's memory is in
            # the MIG series, and the whole GPU's are absent, saying why.
            gpu.memory_unavailable = (
                f"NVML refused the whole GPU's memory ({exc}): this container sees only MIG "
                f"device(s) {', '.join(device.mig_uuids)}, whose GPU instance's memory is in "
                "gpu_mig_memory_*"
            )
            if not device.refused_logged:
                log.info("GPU %s: %s", device.index, gpu.memory_unavailable)
                device.refused_logged = True
        except nvml.NVMLError_NotSupported as exc:
            log.debug("memory info of GPU %s: %s", device.index, exc)
            gpu.up = False
        return gpu

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

    def _read_instances(self, device: _Device) -> list[MigInstanceReading]:
        """Each GPU instance's memory, read through one of its MIG devices (~5 us each)."""
        nvml = self._nvml
        by_instance = self._instance_processes.get(device.uuid)
        found = []
        for instance_id, migs in sorted(device.instances.items()):
            instance = MigInstanceReading(
                gpu_index=device.index,
                gpu_uuid=device.uuid,
                gpu_instance_id=instance_id,
                profile=migs[0].profile,
                mig_uuids=[mig.uuid for mig in migs],
                process_bytes=None if by_instance is None else by_instance.get(instance_id, 0),
            )
            try:
                if device.memory_v2:
                    mem = nvml.nvmlDeviceGetMemoryInfo(migs[0].handle, version=nvml.nvmlMemory_v2)
                else:
                    mem = nvml.nvmlDeviceGetMemoryInfo(migs[0].handle)
            except nvml.NVMLError as exc:
                # Its MIG device is gone (MIG reconfigured) or refused: no number for it on
                # this tick, and the GPU's MIG devices are read again for the next.
                log.info(
                    "GPU %s: GPU instance %s did not answer (%s); reading its MIG devices again",
                    device.index,
                    instance_id,
                    exc,
                )
                device.migs_stale = True
            else:
                instance.total_bytes = int(mem.total)
                instance.used_bytes = int(mem.used)
                instance.free_bytes = int(mem.free)
            found.append(instance)
        return found

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
        if device.instances:  # which GPU instance each runs in: the instance's share
            by_instance: dict[int, int] = {}
            for entry in entries:
                instance = _instance_of(entry, device)
                if instance is not None and entry.usedGpuMemory is not None:
                    by_instance[instance] = by_instance.get(instance, 0) + int(entry.usedGpuMemory)
            self._instance_processes[device.uuid] = by_instance
        return [
            ProcessGpuReading(
                gpu_index=device.index,
                gpu_uuid=device.uuid,
                pid=int(entry.pid),
                used_bytes=int(entry.usedGpuMemory),
                gpu_instance_id=_instance_of(entry, device),
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
