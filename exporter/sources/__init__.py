"""Sources: one module per thing the exporter reads. A source reads; it never writes metrics.

Each source is a small class with a `name` and a `read()` that returns a SourceReading (empty
when there is nothing to report, which is not an error) and raises only when the read itself
failed. The sampler times every read, counts failures and keeps one failing source from
stopping the others.

A source says what it `provides` (the names below), and its neighbours find it by that, never
by its class: the NVML source reads the GPUs the ALLOCATOR source's process uses, the kubelet
and process-memory sources follow the PIDs the PROCESS_MEMORY source saw, the OOM verdicts come
from the OOM_VERDICTS source. A new allocator (torch.accelerator: ROCm, XPU) or a new device
source (another vendor's SMI) is one module here and one SourceKind in exporter.sources.kinds.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Protocol, TypeVar

from exporter.sample import SourceReading

# What a source provides, with what its neighbours read of it beside its readings.
ALLOCATOR = "allocator"  # AllocatorReading per device; `uuids_in_use`: the GPUs it read
OOM_VERDICTS = "oom_verdicts"  # `read_oom`, `light_snapshot`, `ooms` (exporter.actions.oom)
DEVICE_MEMORY = "device_memory"  # GpuReading per GPU
PROCESS_MEMORY = "process_memory"  # ProcessGpuReading; `last_pids`: PIDs with GPU memory
HOST_MEMORY = "host_memory"  # HostReading
HOST_PROCESSES = "host_processes"  # HostProcessReading of the processes on GPUs
KUBERNETES = "kubernetes"  # KubeletReading: who the GPUs belong to
CAPABILITIES = (
    ALLOCATOR,
    OOM_VERDICTS,
    DEVICE_MEMORY,
    PROCESS_MEMORY,
    HOST_MEMORY,
    HOST_PROCESSES,
    KUBERNETES,
)


class Source(Protocol):
    name: str

    def read(self) -> SourceReading: ...

    def close(self) -> None: ...


S = TypeVar("S")


def providing(sources: Iterable[S], capability: str) -> list[S]:
    """The sources that provide `capability` (a source without `provides` provides none)."""
    return [s for s in sources if capability in getattr(s, "provides", ())]


def provides(source: object) -> Collection[str]:
    return getattr(source, "provides", ())
