"""PyTorch's CUDA caching allocator, read from inside the process that uses it.

The rules that keep this safe for the host process come from measurements (shared/FACTS.md):
- touch device i only when CUDA is initialized and device i already has a primary context,
  because several "read-only" calls create a ~520 MB context on a device that had none;
- always pass an explicit device index: a new thread's current device is 0;
- read with `memory_stats_as_nested_dict(i)` (one C call, ~10 us) rather than
  `memory_stats(i)` (~60 us: it flattens and sorts in Python);
- on cudaMallocAsync and with expandable segments some numbers read 0 because they are not
  tracked, so they are left out instead of exported as 0.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from exporter.sample import AllocatorReading, SourceReading

NATIVE = "native"
ASYNC = "cudaMallocAsync"

# allocator stat family -> metric key, for `.all.current`
_CURRENT = {
    "allocated_bytes": "allocated_bytes",
    "reserved_bytes": "reserved_bytes",
    "active_bytes": "active_bytes",
    "inactive_split_bytes": "inactive_split_bytes",
    "requested_bytes": "requested_bytes",
    "segment": "segments",
    "allocation": "allocations",
}
_PEAK = {
    "allocated_bytes": "allocated_peak_bytes",
    "reserved_bytes": "reserved_peak_bytes",
}
_COUNTERS = {
    "num_alloc_retries": "alloc_retries",
    "num_ooms": "ooms",
    "num_device_alloc": "device_malloc",
    "num_device_free": "device_free",
    "num_sync_all_streams": "sync_all_streams",
}
_POOLS = {"large_pool": "large", "small_pool": "small"}
_POOL_FAMILIES = (
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
# What cudaMallocAsync actually tracks (everything else reads 0 there).
_ASYNC_DEFINED = {"allocated_bytes", "reserved_bytes", "active_bytes"}
# Expandable segments are left out of inactive_split on purpose (pytorch/pytorch#159564) and
# the segment count collapses (read 0 with 280 MB reserved on an H200): 0 there means "not
# tracked", not "no fragmentation".
_NOT_TRACKED_WITH_EXPANDABLE = {"inactive_split_bytes", "segment"}


def parse_alloc_conf(env: Mapping[str, str]) -> dict[str, str]:
    """Parse PYTORCH_CUDA_ALLOC_CONF (or its newer name PYTORCH_ALLOC_CONF) into key -> value."""
    raw = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF") or ""
    settings = {}
    for item in raw.split(","):
        key, sep, value = item.partition(":")
        if sep and key.strip():
            settings[key.strip()] = value.strip()
    return settings


def _current(stats: Mapping[str, Any], family: str, pool: str = "all") -> int | None:
    value = stats.get(family, {}).get(pool, {}).get("current")
    return int(value) if value is not None else None


def allocator_reading_from_stats(
    stats: Mapping[str, Any],
    *,
    device: int,
    gpu_uuid: str,
    backend: str,
    expandable_segments: bool,
) -> AllocatorReading:
    """Turn one `memory_stats_as_nested_dict(i)` result into the numbers defined there."""
    reading = AllocatorReading(
        device=device,
        gpu_uuid=gpu_uuid,
        backend=backend,
        expandable_segments=expandable_segments,
    )
    for family, key in _CURRENT.items():
        if backend == ASYNC and family not in _ASYNC_DEFINED:
            continue
        if family in _NOT_TRACKED_WITH_EXPANDABLE and expandable_segments:
            continue
        value = _current(stats, family)
        if value is not None:
            reading.gauges[key] = value
    for family, key in _PEAK.items():
        peak = stats.get(family, {}).get("all", {}).get("peak")
        if peak is not None:
            reading.gauges[key] = int(peak)
    if backend != ASYNC:
        for stat, key in _COUNTERS.items():
            if stat in stats:
                reading.counters[key] = int(stats[stat])
        for pool_stat, pool in _POOLS.items():
            pool_gauges = {}
            for family in _POOL_FAMILIES:
                if family in _NOT_TRACKED_WITH_EXPANDABLE and expandable_segments:
                    continue
                value = _current(stats, family, pool_stat)
                if value is not None:
                    pool_gauges[family] = value
            if pool_gauges:
                reading.pools[pool] = pool_gauges
    max_split = stats.get("max_split_size")
    if isinstance(max_split, int) and max_split >= 0:
        reading.max_split_size_bytes = max_split
    return reading


class TorchAllocatorSource:
    """Reads every CUDA device this process has already initialized; never initializes one."""

    name = "torch"

    def __init__(self, torch_module: Any = None, env: Mapping[str, str] | None = None) -> None:
        self._torch = torch_module
        self._env = os.environ if env is None else env
        self._backend: str | None = None
        self._expandable: bool | None = None
        self._uuids: dict[int, str] = {}
        self._with_context: set[int] = set()

    def _load_torch(self) -> Any:
        # Never import torch here: a process that has not imported it is not using CUDA
        # through it, and importing it would cost the host seconds and hundreds of MB.
        if self._torch is None:
            self._torch = sys.modules.get("torch")
        return self._torch

    def _has_context(self, torch: Any, index: int) -> bool:
        # A primary context is never torn down by torch, so a positive answer is cached.
        if index in self._with_context:
            return True
        has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
        if has_context is None:
            # Private API gone (it exists in torch 2.4-2.13): reading stats is still safe,
            # an untouched device just reads all zeros and is filtered out by the caller.
            return True
        if has_context(index):
            self._with_context.add(index)
            return True
        return False

    def _gpu_uuid(self, torch: Any, index: int) -> str:
        if index not in self._uuids:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            # NVML spells UUIDs "GPU-<uuid>"; use its form so the two join on gpu_uuid.
            self._uuids[index] = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
        return self._uuids[index]

    def _settings(self, torch: Any) -> tuple[str, bool]:
        if self._backend is None:
            self._backend = str(torch.cuda.get_allocator_backend())
            conf = parse_alloc_conf(self._env)
            self._expandable = conf.get("expandable_segments", "").lower() == "true"
        return self._backend, bool(self._expandable)

    def read(self) -> SourceReading:
        torch = self._load_torch()
        if torch is None or not torch.cuda.is_initialized():
            return SourceReading()
        backend, expandable = self._settings(torch)
        readings = []
        for index in range(torch.cuda.device_count()):
            if not self._has_context(torch, index):
                continue
            stats = torch.cuda.memory_stats_as_nested_dict(index)
            if not stats:
                continue
            reading = allocator_reading_from_stats(
                stats,
                device=index,
                gpu_uuid=self._gpu_uuid(torch, index),
                backend=backend,
                expandable_segments=expandable,
            )
            if index not in self._with_context and not reading.gauges.get("reserved_peak_bytes"):
                continue  # fallback path: a device this process never used
            readings.append(reading)
        return SourceReading(allocators=readings)

    def close(self) -> None:
        pass
