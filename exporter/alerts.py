"""Every in-process alert, declared once: what it is about, its severity, its condition on a
reading, the settings that hold its thresholds and its duration, and the words a person reads.

exporter.detectors evaluates these declarations on every sample (state, hysteresis, events);
the live page takes each alert's value label from here; deploy/prometheus/alerts.yaml holds the
same alerts as Prometheus rules, and tests/test_alerts.py holds every declaration equal to its
rule: severity, duration, every threshold's number and the summary. An alert is added here,
with its settings in exporter/config.py (`detect_*`) and its rule and runbook beside them.

A condition answers a Check: whether the alert's condition is met now, whether it is clearly
gone (the hysteresis: a value back by `detect_clear_margin` past its threshold), and the
value to report; or None where it is not defined for this reading (a firing alert clears).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from exporter.config import Config
from exporter.sample import AllocatorReading, GpuReading, HostProcessReading, HostReading

# What an alert is evaluated for, and so the labels that name its subject (exporter.detectors).
ON = ("allocator", "gpu", "host", "host_process")
UNITS = ("ratio", "count", "bytes", "bytes_per_s")


class Check(NamedTuple):
    # A tuple, not a frozen dataclass: built for every alert and subject on every tick, and a
    # frozen dataclass's __init__ (object.__setattr__ per field) costs several times more.
    met: bool
    cleared: bool
    value: float


class Trend(Protocol):
    """A value's recent points (exporter.detectors keeps one per subject and name)."""

    def add(self, t: float, value: float) -> None: ...
    def slope(self) -> float | None: ...


class Memory(Protocol):
    """What conditions remember between samples, per alert and subject (the detectors)."""

    def rose(self, alert: str, key: Subject, t: float, value: float) -> Check: ...
    def trend(self, name: str, key: Subject, window_s: float) -> Trend: ...
    def changes(self, key: Subject, settings: Mapping[str, str] | None) -> int: ...


# The labels naming what an alert is about, as a hashable, ordered key.
Subject = tuple[tuple[str, str], ...]


@dataclass(slots=True)
class Evaluation:
    """What one alert's condition sees of one subject in one sample."""

    t: float
    settings: Config
    memory: Memory
    key: Subject
    allocator: AllocatorReading | None = None
    gpu: GpuReading | None = None
    gpu_free: int | None = None  # NVML's free bytes of the allocator's GPU, where read
    host: HostReading | None = None
    process: HostProcessReading | None = None
    alert: str = ""  # the alert being evaluated (the detectors set it before each condition)

    def rose(self, value: float) -> Check:
        """Whether this alert's counter for this subject rose within the window."""
        return self.memory.rose(self.alert, self.key, self.t, value)

    def trend(self, name: str, window_s: float) -> Trend:
        """The trend kept for this subject under `name`."""
        return self.memory.trend(name, self.key, window_s)


Condition = Callable[[Evaluation], "Check | None"]


@dataclass(frozen=True)
class Alert:
    name: str
    severity: str  # the `severity` label of its rule
    on: str  # one of ON
    # What its value is, for the live page; {window}: the counter alerts' window, in words
    # (their value is the counter's rise within it, not its total).
    measures: str
    unit: str  # one of UNITS
    summary: str  # its rule's summary annotation
    condition: Condition
    # The settings its condition compares with: each default is a number in its rule's expr.
    thresholds: tuple[str, ...]
    # The setting holding how long the condition must hold; None: it fires at once.
    hold: str | None
    # Evaluated only where this holds (a counter the backend does not have: no state at all);
    # None: everywhere.
    applies: Callable[[Evaluation], bool] | None = None

    @property
    def runbook(self) -> str:
        """Its section of docs/runbooks.md."""
        return self.name.lower()


# -- conditions ----------------------------------------------------------------------------


def _below(ratio: float, floor: float, margin: float) -> Check:
    """A ratio under its floor; clears only once clearly back above it (hysteresis)."""
    return Check(ratio < floor, ratio >= floor * (1 + margin), ratio)


def _fragmentation(e: Evaluation) -> Check | None:
    assert e.allocator is not None
    ratio = e.allocator.fragmentation_ratio
    if ratio is None:  # undefined on this backend: never "no fragmentation"
        return None
    s = e.settings
    reserved = e.allocator.gauges.get("reserved_bytes", 0)
    floor = s.detect_fragmentation_min_reserved_bytes
    return Check(
        ratio > s.detect_fragmentation_ratio and reserved > floor,
        ratio <= s.detect_fragmentation_ratio * (1 - s.detect_clear_margin) or reserved <= floor,
        ratio,
    )


def _counter(name: str) -> Condition:
    def rose(e: Evaluation) -> Check:
        assert e.allocator is not None
        return e.rose(e.allocator.counters[name])

    return rose


def allocator_settings(reading: AllocatorReading) -> dict[str, str]:
    """The allocator's settings as torch_cuda_allocator_info labels them."""
    max_split = reading.max_split_size_bytes
    return {
        "backend": reading.backend,
        "expandable_segments": str(reading.expandable_segments).lower(),
        "max_split_size_bytes": "" if max_split is None else str(max_split),
        "garbage_collection_threshold": reading.settings.get("garbage_collection_threshold", ""),
    }


def _settings_changed(e: Evaluation) -> Check:
    """The allocator's live settings changed while the process ran (vLLM toggles
    expandable_segments around its CuMem pool; torch.cuda.memory._set_allocator_settings).
    Only the settings the allocator reported count: the environment's, read at start, are
    what it was asked for, not what it did."""
    reading = e.allocator
    assert reading is not None
    live = allocator_settings(reading) if reading.settings.get("source") == "live" else None
    return e.rose(e.memory.changes(e.key, live))


def _has_counter(name: str) -> Callable[[Evaluation], bool]:
    return lambda e: e.allocator is not None and name in e.allocator.counters


def _fragmentation_ooms(e: Evaluation) -> Check:
    """OOMs whose verdict was fragmentation: the cache had the bytes, in pieces. Its own
    critical alert, because its fix is a setting, not more memory."""
    assert e.allocator is not None
    return e.rose(e.allocator.ooms_by_verdict.get("fragmentation", 0))


def _cache_gap(e: Evaluation) -> Check | None:
    assert e.allocator is not None
    gap, ratio = e.allocator.cached_free_bytes, e.allocator.cached_free_ratio
    if gap is None or ratio is None:
        return None
    s = e.settings
    keep = 1 - s.detect_clear_margin
    return Check(
        gap > s.detect_cache_gap_bytes and ratio > s.detect_cache_gap_ratio,
        gap <= s.detect_cache_gap_bytes * keep or ratio <= s.detect_cache_gap_ratio * keep,
        gap,
    )


def _shattered(e: Evaluation) -> Check | None:
    """The free cache is in pieces (its largest block is a small share of it) and the GPU
    (or the process's memory cap) has less room than that share of it too: a request the
    free cache could hold in total fits neither a free block nor a new cudaMalloc. While the
    device has room, a shattered cache does no harm. Reports the largest free block in
    bytes, as the Prometheus alert does."""
    reading = e.allocator
    assert reading is not None
    share = reading.largest_free_block_share
    if share is None:  # no layout (cudaMallocAsync, skipped, not read yet): unknown
        return None
    # Room for a new cudaMalloc: the GPU's free memory, and under a per-process cap
    # (set_per_process_memory_fraction) no more than the cap leaves.
    rooms = [e.gpu_free] if e.gpu_free is not None else []
    limit = reading.gauges.get("memory_limit_bytes")
    reserved = reading.gauges.get("reserved_bytes")
    if limit is not None and reserved is not None:
        rooms.append(max(limit - reserved, 0))
    if not rooms:  # neither NVML nor a cap for this GPU: the device side is unknown
        return None
    room = min(rooms)
    s = e.settings
    margin = s.detect_clear_margin
    free = reading.layout["default_pool_free_bytes"]
    largest = reading.layout["largest_free_block_bytes"]
    device_limit = s.detect_shattered_block_share * free
    return Check(
        share < s.detect_shattered_block_share
        and free > s.detect_shattered_min_free_bytes
        and room < device_limit,
        share >= s.detect_shattered_block_share * (1 + margin)
        or free <= s.detect_shattered_min_free_bytes * (1 - margin)
        or room >= device_limit * (1 + margin),
        largest,
    )


def _gpu_free_share(e: Evaluation) -> tuple[GpuReading, int, float]:
    gpu = e.gpu
    assert gpu is not None and gpu.free_bytes is not None and gpu.total_bytes
    return gpu, gpu.free_bytes, gpu.free_bytes / gpu.total_bytes


def _headroom(e: Evaluation) -> Check:
    _, _, share = _gpu_free_share(e)
    s = e.settings
    return _below(share, s.detect_headroom_free_ratio, s.detect_clear_margin)


def _exhaustion(e: Evaluation) -> Check:
    _, free, share = _gpu_free_share(e)
    s = e.settings
    trend = e.trend("free", s.detect_exhaustion_window_s)
    trend.add(e.t, free)
    slope = trend.slope()
    if slope is None:
        return Check(False, True, 0.0)
    predicted = free + slope * s.detect_exhaustion_horizon_s
    floor = s.detect_exhaustion_free_ratio
    return Check(
        share < floor and slope < 0 and predicted < 0,
        slope >= 0 or share >= floor * (1 + s.detect_clear_margin),
        predicted,
    )


def _host_pressure(e: Evaluation) -> Check | None:
    host = e.host
    assert host is not None
    if not host.total_bytes:
        return None
    s = e.settings
    share = host.available_bytes / host.total_bytes
    return _below(share, s.detect_host_available_ratio, s.detect_clear_margin)


def _swap(e: Evaluation) -> Check:
    host = e.host
    assert host is not None
    s = e.settings
    trend = e.trend("swap", s.detect_swap_window_s)
    trend.add(e.t, host.swap_used_bytes)
    slope = trend.slope() or 0.0
    floor = s.detect_swap_min_used_bytes
    return Check(
        host.swap_used_bytes > floor and slope > s.detect_swap_growth_bytes_per_s,
        slope <= 0 or host.swap_used_bytes <= floor,
        slope,
    )


def _held_by_process(e: Evaluation) -> Check | None:
    host, process = e.host, e.process
    assert host is not None and process is not None
    if not host.total_bytes:
        return None
    s = e.settings
    in_use = host.total_bytes - host.available_bytes
    available = host.available_bytes / host.total_bytes
    share = process.resident_bytes / in_use if in_use > 0 else 0.0
    floor = s.detect_host_process_available_ratio
    return Check(
        available < floor and share > s.detect_host_process_share,
        available >= floor * (1 + s.detect_clear_margin)
        or share <= s.detect_host_process_share * (1 - s.detect_clear_margin),
        process.resident_bytes,
    )


# -- the declarations, in the order they are evaluated -----------------------------------

ALERTS: tuple[Alert, ...] = (
    Alert(
        "GpuMemFragmentationHigh",
        "warning",
        "allocator",
        "fragmentation",
        "ratio",
        "PyTorch's CUDA cache is fragmented.",
        _fragmentation,
        ("detect_fragmentation_ratio", "detect_fragmentation_min_reserved_bytes"),
        "detect_fragmentation_for_s",
    ),
    Alert(
        "GpuMemAllocRetries",
        "warning",
        "allocator",
        "retries in the last {window}",
        "count",
        "PyTorch had to free its CUDA cache and retry allocations.",
        _counter("alloc_retries"),
        ("detect_counter_window_s",),
        None,
        applies=_has_counter("alloc_retries"),
    ),
    Alert(
        "GpuMemOutOfMemory",
        "critical",
        "allocator",
        "OOMs in the last {window}",
        "count",
        "PyTorch raised CUDA out-of-memory errors.",
        _counter("ooms"),
        ("detect_counter_window_s",),
        None,
        applies=_has_counter("ooms"),
    ),
    Alert(
        "GpuMemOomFragmentation",
        "critical",
        "allocator",
        "fragmentation OOMs in the last {window}",
        "count",
        "CUDA out-of-memory errors from a fragmented cache, not from a full GPU.",
        _fragmentation_ooms,
        ("detect_counter_window_s",),
        None,
    ),
    Alert(
        "GpuMemCacheGapHigh",
        "warning",
        "allocator",
        "cached, not allocated",
        "bytes",
        "PyTorch holds a large unused CUDA cache.",
        _cache_gap,
        ("detect_cache_gap_bytes", "detect_cache_gap_ratio"),
        "detect_cache_gap_for_s",
    ),
    Alert(
        "GpuMemFreeCacheShattered",
        "warning",
        "allocator",
        "largest free block",
        "bytes",
        "PyTorch's free CUDA cache is in pieces too small for large requests.",
        _shattered,
        ("detect_shattered_block_share", "detect_shattered_min_free_bytes"),
        "detect_shattered_for_s",
    ),
    Alert(
        "GpuMemAllocatorSettingsChanged",
        "warning",
        "allocator",
        "settings changes in the last {window}",
        "count",
        "PyTorch's CUDA allocator settings changed while the process ran.",
        _settings_changed,
        ("detect_counter_window_s",),
        None,
    ),
    Alert(
        "GpuMemHeadroomLow",
        "warning",
        "gpu",
        "GPU free",
        "ratio",
        "GPU memory headroom is low.",
        _headroom,
        ("detect_headroom_free_ratio",),
        "detect_headroom_for_s",
    ),
    Alert(
        "GpuMemExhaustionPredicted",
        "warning",
        "gpu",
        "free in an hour at this rate",
        "bytes",
        "GPU memory is predicted to run out within an hour.",
        _exhaustion,
        (
            "detect_exhaustion_free_ratio",
            "detect_exhaustion_horizon_s",
            "detect_exhaustion_window_s",
        ),
        "detect_exhaustion_for_s",
    ),
    Alert(
        "HostMemoryPressure",
        "critical",
        "host",
        "host memory available",
        "ratio",
        "Host memory is nearly exhausted.",
        _host_pressure,
        ("detect_host_available_ratio",),
        "detect_host_for_s",
    ),
    Alert(
        "HostSwapGrowing",
        "warning",
        "host",
        "swap growth",
        "bytes_per_s",
        "Host swap use is growing.",
        _swap,
        ("detect_swap_min_used_bytes", "detect_swap_growth_bytes_per_s", "detect_swap_window_s"),
        "detect_swap_for_s",
    ),
    Alert(
        "HostMemoryHeldByProcess",
        "warning",
        "host_process",
        "resident",
        "bytes",
        "One process holds most of the host memory while little is available.",
        _held_by_process,
        ("detect_host_process_share", "detect_host_process_available_ratio"),
        "detect_host_process_for_s",
    ),
)

BY_NAME = {alert.name: alert for alert in ALERTS}
