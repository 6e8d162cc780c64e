"""PyTorch's caching allocator read through torch.accelerator, the device-generic API (CUDA,
ROCm through HIP, XPU, and what torch adds), from inside the process that uses it.

On CUDA it reads the very statistics exporter.sources.torch_allocator reads (torch's
`_accelerator_getDeviceStats` and `_cuda_memoryStats` return the same allocator's dict) and
turns them into a reading with the same code, so the two give the same numbers
(tests/gpu/test_gpu_sources.py checks it on a GPU). What only torch.cuda offers stays with
that source: the allocator's layout (snapshot), OOM verdicts, the memory cap and pinned host
memory. The same safety rules hold: never import torch, never touch a device this process
has not initialized (a device type's has-primary-context check where torch has one, else
only devices whose allocator ever reserved memory).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from exporter.sample import SourceReading
from exporter.sources import ALLOCATOR
from exporter.sources.non_allocator import NonAllocatorReader, memory_state
from exporter.sources.torch_allocator import (
    NATIVE,
    allocator_reading_from_stats,
    has_context,
    nvml_uuid,
    parse_alloc_conf,
)

# The parts of an allocator reading it fills: what the allocator's statistics hold, as the
# torch.cuda source fills them (which adds the layout, the cap, settings and OOM verdicts).
PARTS = (
    "device",
    "gpu_uuid",
    "backend",
    "expandable_segments",
    "gauges",
    "counters",
    "pools",
    "max_split_size_bytes",
    "private_pools",
)


class AcceleratorAllocatorSource:
    name = "accelerator"
    provides = frozenset({ALLOCATOR})

    def __init__(
        self,
        torch_module: Any = None,
        env: Mapping[str, str] | None = None,
        *,
        non_allocator: NonAllocatorReader | None = None,
    ) -> None:
        self._torch = torch_module
        self._env = os.environ if env is None else env
        self._non_allocator = non_allocator
        self._uuids: dict[int, str] = {}
        self._with_context: set[int] = set()
        # The GPUs read last time: the ones this process uses (an embedded exporter's NVML
        # source reads only these).
        self.uuids_in_use: frozenset[str] = frozenset()

    def _load_torch(self) -> Any:
        if self._torch is None:  # never imported here: see exporter.sources.torch_allocator
            self._torch = sys.modules.get("torch")
        return self._torch

    def allocator_settings(self) -> tuple[str, bool] | None:
        """None: `run`'s probe reads CUDA's allocator only, so this source's processes send
        the full sample every tick (exporter.transport.agent)."""
        return None

    def non_allocator_retry_s(self) -> float | None:
        """When the bytes outside the allocator want another read (NonAllocatorReader)."""
        return self._non_allocator.retry_in() if self._non_allocator is not None else None

    def read(self) -> SourceReading:
        torch = self._load_torch()
        if torch is None:  # not imported: this process uses no accelerator through torch
            return SourceReading()
        accelerator = getattr(torch, "accelerator", None)
        stats_of = getattr(getattr(torch, "_C", None), "_accelerator_getDeviceStats", None)
        if accelerator is None or stats_of is None:
            return SourceReading(unavailable="this torch has no torch.accelerator memory stats")
        initialized = getattr(torch._C, "_accelerator_isAllocatorInitialized", None)
        if initialized is not None and not initialized():
            return SourceReading()  # nothing allocated yet: the allocator is not even made
        device = accelerator.current_accelerator()
        if device is None:
            return SourceReading()
        kind = device.type
        backend = self._backend(torch, kind)
        expandable = parse_alloc_conf(self._env).get("expandable_segments", "").lower() == "true"
        readings = []
        for index in range(accelerator.device_count()):
            if not has_context(torch, kind, index, self._with_context):
                continue
            stats = stats_of(index)
            reading = allocator_reading_from_stats(
                stats,
                device=index,
                gpu_uuid=self._gpu_uuid(torch, kind, index),
                backend=backend,
                expandable_segments=expandable,
            )
            if index not in self._with_context and not reading.gauges.get("reserved_peak_bytes"):
                continue  # no context check on this device type: one it never used
            readings.append(reading)
        self.uuids_in_use = frozenset(r.gpu_uuid for r in readings if r.gpu_uuid)
        if self._non_allocator is not None:
            self._non_allocator.apply(readings, lambda i: memory_state(stats_of(i)))
        return SourceReading(allocators=readings)

    def _backend(self, torch: Any, kind: str) -> str:
        module = getattr(torch, kind, None)
        get = getattr(module, "get_allocator_backend", None)
        return str(get()) if get is not None else NATIVE

    def _gpu_uuid(self, torch: Any, kind: str, index: int) -> str:
        """NVML's spelling of the device's UUID where the device type reports one, else ""."""
        if index not in self._uuids:
            module = getattr(torch, kind, None)
            properties = getattr(module, "get_device_properties", None)
            uuid = getattr(properties(index), "uuid", None) if properties is not None else None
            self._uuids[index] = nvml_uuid(uuid) if uuid else ""
        return self._uuids[index]

    def close(self) -> None:
        if self._non_allocator is not None:
            self._non_allocator.close()
