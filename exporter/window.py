"""The live page's memory: a bounded window of recent samples, kept as compact per-GPU points.

A sampler listener. Each sample becomes one record: its timestamp, the GPUs it saw (a tuple
shared with the previous record while the GPUs stay the same) and one flat array of doubles
holding FIELDS for each GPU, NaN where a value is not known. Whole samples are not kept: a
sample of a `run` server holds every process's allocator and pool readings, and the page
draws only these few numbers per GPU.

Under `gpumem-exporter run` several processes share a GPU: their allocator bytes and counters
are summed per GPU (the chart stacks the GPU's total), and each ratio is the worst (highest)
process's, as alerts fire per process. The per-process breakdown is the page's process table.
"""

from __future__ import annotations

import math
import threading
from array import array
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from exporter.sample import Sample

# The number of minutes the page shows, and a cap on records for short intervals.
WINDOW_S = 600.0
MAX_RECORDS = 3000

# Per GPU and sample. Bytes and counters are whole numbers (exact in a double up to 2**53).
FIELDS = (
    "allocated_bytes",  # summed over the GPU's allocators
    "cached_free_bytes",  # reserved - allocated, summed
    "non_allocator_bytes",  # AllocatorReading.non_allocator_bytes, summed: context, NCCL
    "other_bytes",  # total - free - the three above: other processes, driver reserve
    "used_bytes",  # NVML
    "free_bytes",  # NVML
    "total_bytes",  # NVML
    "fragmentation_ratio",  # worst allocator's; NaN where no allocator defines it
    "cached_free_ratio",  # worst allocator's
    "alloc_retries",  # counters, summed over the GPU's allocators
    "ooms",
    # The tightest per-process cap (torch.cuda.set_per_process_memory_fraction) below the
    # GPU's memory; NaN where no process is capped (an uncapped limit is the whole device).
    "memory_limit_bytes",
)
_RATIOS = frozenset({"fragmentation_ratio", "cached_free_ratio"})
_NAN = math.nan


@dataclass(frozen=True)
class GpuInfo:
    """How the page names one GPU. `key` is its UUID (or `cuda:N` without one)."""

    key: str
    index: int | None  # NVML index, None without NVML
    device: int | None  # CUDA ordinal in the (first) process that uses it, None in node mode
    name: str

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "index": self.index, "device": self.device, "name": self.name}


class Record(NamedTuple):
    timestamp: float
    gpus: tuple[GpuInfo, ...]
    values: array[float]  # len(gpus) * len(FIELDS), GPU after GPU


class SampleWindow:
    """The last `window_s` of samples at `interval_s` (at most `max_records`)."""

    def __init__(
        self, interval_s: float, *, window_s: float = WINDOW_S, max_records: int = MAX_RECORDS
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.capacity = max(1, min(max_records, math.ceil(window_s / interval_s)))
        self._records: deque[Record] = deque(maxlen=self.capacity)
        self._lock = threading.Lock()
        self._gpus: tuple[GpuInfo, ...] = ()
        self.__name__ = "window"  # how the sampler names a failing listener in its log

    def __call__(self, sample: Sample) -> None:
        gpus, values = gpu_points(sample)
        if gpus == self._gpus:
            gpus = self._gpus  # one tuple for every record while the GPUs stay the same
        self._gpus = gpus
        with self._lock:
            self._records.append(Record(sample.timestamp, gpus, values))

    def __len__(self) -> int:
        return len(self._records)

    def since(self, timestamp: float | None = None) -> list[Record]:
        """Records newer than `timestamp` (all of them for None), oldest first."""
        with self._lock:
            records = list(self._records)
        if timestamp is None:
            return records
        # Timestamps rise; look from the newest end, as a poll asks for the last few.
        start = len(records)
        while start > 0 and records[start - 1].timestamp > timestamp:
            start -= 1
        return records[start:]

    def to_dict(self, timestamp: float | None = None, upto: Sample | None = None) -> dict[str, Any]:
        """The records newer than `timestamp` as columns: one list of timestamps, and per GPU
        one list per field, aligned with them (None where the GPU or the value is missing).

        `upto`: the sample the rest of an answer comes from (the sampler's latest): the
        columns end with it, so that a page's numbers and its ledger, processes and alerts are
        of one sample. The sampler publishes a sample before its listeners run, so under load
        this window was a tick behind it, or, read after it, a tick ahead: the page's card
        mixed two samples."""
        records = self.since(timestamp)
        if upto is not None:
            while records and records[-1].timestamp > upto.timestamp:
                records.pop()
            newest = records[-1].timestamp if records else None
            if newest != upto.timestamp and (timestamp is None or upto.timestamp > timestamp):
                records.append(Record(upto.timestamp, *gpu_points(upto)))
        return columns(records)


def columns(records: list[Record]) -> dict[str, Any]:
    width = len(FIELDS)
    infos: dict[str, GpuInfo] = {}
    series: dict[str, dict[str, list[float | None]]] = {}
    for row, record in enumerate(records):
        for position, info in enumerate(record.gpus):
            infos[info.key] = info  # the newest naming wins
            if info.key not in series:
                series[info.key] = {name: [None] * len(records) for name in FIELDS}
            columns_of_gpu = series[info.key]
            base = position * width
            for offset, name in enumerate(FIELDS):
                columns_of_gpu[name][row] = _json_number(name, record.values[base + offset])
    ordered = sorted(infos.values(), key=_gpu_order)
    return {
        # Unrounded: a caller passes the last one back as `since`, which must match exactly.
        "timestamps": [r.timestamp for r in records],
        "gpus": [{**info.to_dict(), "series": series[info.key]} for info in ordered],
    }


def _gpu_order(info: GpuInfo) -> tuple[int, int, str]:
    return (
        info.index if info.index is not None else 1 << 20,
        info.device if info.device is not None else 1 << 20,
        info.key,
    )


def _json_number(name: str, value: float) -> float | int | None:
    if math.isnan(value):
        return None
    if name in _RATIOS:
        return round(value, 4)
    return int(value)


def gpu_points(sample: Sample) -> tuple[tuple[GpuInfo, ...], array[float]]:
    """One sample's GPUs and their FIELDS, flat (see Record)."""
    infos: dict[str, GpuInfo] = {}
    points: dict[str, dict[str, float]] = {}
    for gpu in sample.gpus:
        key = gpu.uuid or f"gpu:{gpu.index}"
        infos[key] = GpuInfo(key, gpu.index, None, gpu.name)
        points[key] = {
            "used_bytes": _number(gpu.used_bytes),
            "free_bytes": _number(gpu.free_bytes),
            "total_bytes": _number(gpu.total_bytes),
        }
    for reading in sample.allocators:
        key = reading.gpu_uuid or f"cuda:{reading.device}"
        info = infos.get(key)
        if info is None:
            infos[key] = GpuInfo(key, None, reading.device, f"cuda:{reading.device}")
        elif info.device is None:
            infos[key] = GpuInfo(key, info.index, reading.device, info.name)
        point = points.setdefault(key, {})
        _add(point, "allocated_bytes", reading.gauges.get("allocated_bytes"))
        _add(point, "cached_free_bytes", reading.cached_free_bytes)
        _add(point, "non_allocator_bytes", reading.non_allocator_bytes)
        for counter in ("alloc_retries", "ooms"):
            _add(point, counter, reading.counters.get(counter))
        _worst(point, "fragmentation_ratio", reading.fragmentation_ratio)
        _worst(point, "cached_free_ratio", reading.cached_free_ratio)
        _cap(point, reading.gauges.get("memory_limit_bytes"))
    values: array[float] = array("d")
    for key in infos:
        point = points[key]
        point["other_bytes"] = _other(point)
        values.extend(point.get(name, _NAN) for name in FIELDS)
    return tuple(infos.values()), values


def _number(value: int | None) -> float:
    return _NAN if value is None else float(value)


def _add(point: dict[str, float], name: str, value: float | None) -> None:
    if value is not None:
        point[name] = point.get(name, 0.0) + value


def _worst(point: dict[str, float], name: str, value: float | None) -> None:
    if value is not None:
        point[name] = max(point.get(name, value), value)


def _cap(point: dict[str, float], limit: int | None) -> None:
    total = point.get("total_bytes", _NAN)
    if limit is not None and (math.isnan(total) or limit < total):
        point["memory_limit_bytes"] = min(point.get("memory_limit_bytes", limit), limit)


def _other(point: dict[str, float]) -> float:
    """What NVML counts as not free that none of this server's allocators explain."""
    total, free = point.get("total_bytes", _NAN), point.get("free_bytes", _NAN)
    parts = [point.get(n) for n in ("allocated_bytes", "cached_free_bytes", "non_allocator_bytes")]
    if math.isnan(total) or math.isnan(free) or all(p is None for p in parts):
        return _NAN
    return max(total - free - sum(_known(parts)), 0.0)


def _known(values: Iterable[float | None]) -> Iterable[float]:
    return (v for v in values if v is not None)
