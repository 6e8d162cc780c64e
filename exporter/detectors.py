"""In-process alert logic, evaluated on every sample.

The same conditions as deploy/prometheus/alerts.yaml (names, thresholds and durations mirror
it; change both together), for servers that are not scraped yet, for a callback the server can
act on (`on_alert`), and for the optional remediation policy. Each alert is edge-triggered: one
structured log line when it starts firing and one when it clears. Hysteresis keeps a value
hovering at a threshold from flapping: an alert clears only when the value is clearly back on
the safe side (`clear_margin`), or when a counter has not moved for a whole window.

State is kept per alert and subject, where the subject is every label that names it: the CUDA
ordinal (`device`) and `gpu_uuid` plus the process labels (pid, rank, local_rank, role) for
allocator alerts, so that two processes on one GPU never share a counter or a timer; the NVML
index (`gpu`) and `gpu_uuid` for GPU alerts; the process (pid, role, rank) for per-process host
memory; nothing for the host.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from exporter.config import ConfigError
from exporter.sample import (
    AllocatorReading,
    GpuReading,
    HostProcessReading,
    HostReading,
    Sample,
)

log = logging.getLogger("exporter.alerts")

GiB = 1 << 30
ENV_PREFIX = "GPUMEM_DETECT_"


@dataclass(frozen=True)
class Thresholds:
    """Defaults mirror deploy/prometheus/alerts.yaml. Env: GPUMEM_DETECT_<FIELD>=<number>."""

    fragmentation_ratio: float = 0.3
    fragmentation_min_reserved_bytes: float = 1 * GiB
    fragmentation_for_s: float = 600
    counter_window_s: float = 600  # retries and OOMs: firing while the counter rose this recently
    cache_gap_bytes: float = 4 * GiB
    cache_gap_ratio: float = 0.5
    cache_gap_for_s: float = 1800
    # GpuMemFreeCacheShattered: the default pool's largest free block is under this share of
    # its free bytes, with more than shattered_min_free_bytes free (allocator layout only), and
    # the GPU's own free memory (NVML) is under this share of those free bytes too.
    shattered_block_share: float = 0.25
    shattered_min_free_bytes: float = 2 * GiB
    shattered_for_s: float = 900
    headroom_free_ratio: float = 0.05
    headroom_for_s: float = 600
    exhaustion_free_ratio: float = 0.20
    exhaustion_horizon_s: float = 3600
    exhaustion_window_s: float = 600
    exhaustion_for_s: float = 900
    host_available_ratio: float = 0.05
    host_for_s: float = 300
    swap_min_used_bytes: float = 1 * GiB
    swap_growth_bytes_per_s: float = 256 * 1024
    swap_window_s: float = 900
    swap_for_s: float = 300
    # One process holds more than this share of the memory in use (total - available) while
    # available memory is under host_process_available_ratio of the total.
    host_process_share: float = 0.5
    host_process_available_ratio: float = 0.1
    host_process_for_s: float = 120
    # An alert clears only once its value is this much on the safe side of the threshold.
    clear_margin: float = 0.2


def load_thresholds(env: Mapping[str, str] | None = None, **overrides: float) -> Thresholds:
    env = os.environ if env is None else env
    values: dict[str, float] = {}
    for f in fields(Thresholds):
        key = ENV_PREFIX + f.name.upper()
        raw = overrides.get(f.name, env.get(key))
        if raw is None or raw == "":
            continue
        try:
            number = float(raw)
        except (TypeError, ValueError):
            number = float("nan")
        if not number >= 0:
            raise ConfigError(f"{key}: expected a non-negative number, got {raw!r}")
        values[f.name] = number
    unknown = set(overrides) - {f.name for f in fields(Thresholds)}
    if unknown:
        raise ConfigError(f"unknown detector threshold(s): {', '.join(sorted(unknown))}")
    return Thresholds(**values)


@dataclass(frozen=True)
class AlertEvent:
    """What `on_alert` receives when an alert starts firing or clears. `labels` name its
    subject: `device` (CUDA ordinal) and `gpu_uuid` (+ pid, rank, local_rank, role under
    `gpumem-exporter run`) for allocator alerts, `gpu` (NVML index) and `gpu_uuid` for GPU
    alerts, pid, role and rank for a process's host memory, none for the host."""

    alert: str
    state: str  # "firing" or "resolved"
    value: float
    timestamp: float
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def device(self) -> str:
        """The CUDA ordinal of an allocator alert, else ""."""
        return self.labels.get("device", "")


@dataclass
class _State:
    pending_since: float | None = None
    firing: bool = False
    firing_since: float | None = None  # the sample time it started firing at
    value: float = 0.0


# Each in-process alert's severity: the `severity` label of its rule in
# deploy/prometheus/alerts.yaml (tests/test_detectors.py keeps the two equal).
SEVERITY = {
    "GpuMemFragmentationHigh": "warning",
    "GpuMemAllocRetries": "warning",
    "GpuMemOutOfMemory": "critical",
    "GpuMemOomFragmentation": "critical",
    "GpuMemCacheGapHigh": "warning",
    "GpuMemFreeCacheShattered": "warning",
    "GpuMemHeadroomLow": "warning",
    "GpuMemExhaustionPredicted": "warning",
    "HostMemoryPressure": "critical",
    "HostSwapGrowing": "warning",
    "HostMemoryHeldByProcess": "warning",
}


# What each alert's value is (AlertEvent.value, FiringAlert.value), for the live page:
# (what it measures, unit: ratio, count, bytes or bytes_per_s).
VALUE_OF = {
    "GpuMemFragmentationHigh": ("fragmentation", "ratio"),
    "GpuMemAllocRetries": ("new retries", "count"),
    "GpuMemOutOfMemory": ("new OOMs", "count"),
    "GpuMemOomFragmentation": ("new fragmentation OOMs", "count"),
    "GpuMemCacheGapHigh": ("cached, not allocated", "bytes"),
    "GpuMemFreeCacheShattered": ("largest free block", "bytes"),
    "GpuMemHeadroomLow": ("GPU free", "ratio"),
    "GpuMemExhaustionPredicted": ("free in an hour at this rate", "bytes"),
    "HostMemoryPressure": ("host memory available", "ratio"),
    "HostSwapGrowing": ("swap growth", "bytes_per_s"),
    "HostMemoryHeldByProcess": ("resident", "bytes"),
}


@dataclass
class FiringAlert:
    alert: str
    labels: dict[str, str]
    severity: str  # as the shipped Prometheus rule labels it (SEVERITY)
    since: float | None  # when it started firing (sample time, Unix seconds)
    value: float  # the value of the latest evaluation (a ratio, bytes, a count of rises)


@dataclass
class _Check:
    """One evaluation: is the condition met, is it clearly gone, and the value to report."""

    met: bool
    cleared: bool
    value: float


class _Series:
    """(timestamp, value) points over a sliding window, with running sums so that the slope
    costs O(1) per sample whatever the window holds (600 points at 1 Hz, 6000 at 10 Hz)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.points: deque[tuple[float, float]] = deque()
        self._origin: float | None = None  # times are kept relative to it, for precision
        self._n = 0
        self._st = self._sv = self._stt = self._stv = 0.0

    def _account(self, t: float, v: float, sign: int) -> None:
        self._n += sign
        self._st += sign * t
        self._sv += sign * v
        self._stt += sign * t * t
        self._stv += sign * t * v

    def add(self, t: float, value: float) -> None:
        if self._origin is None:
            self._origin = t
        rel = t - self._origin
        self.points.append((rel, value))
        self._account(rel, value, +1)
        while self.points and self.points[0][0] < rel - self.window_s:
            old_t, old_v = self.points.popleft()
            self._account(old_t, old_v, -1)

    def slope(self) -> float | None:
        """Least-squares slope per second, like PromQL's deriv(); None with too few points."""
        n = self._n
        if n < 3:
            return None
        var = self._stt - self._st * self._st / n
        if var <= 1e-12 * max(self._stt, 1.0):
            return None
        return (self._stv - self._st * self._sv / n) / var


class _Counter:
    """Remembers when a counter last rose; a first reading above 0 counts as a rise."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.risen_at: float | None = None
        self.rise = 0.0

    def update(self, t: float, value: float) -> None:
        previous = self.last
        if (previous is None and value > 0) or (previous is not None and value > previous):
            self.rise = value - (previous or 0)
            self.risen_at = t
        self.last = value


Listener = Callable[[AlertEvent], None]
# The labels naming what an alert is about, as a hashable, ordered key.
Subject = tuple[tuple[str, str], ...]


def subject(labels: Mapping[str, str]) -> Subject:
    return tuple(sorted(labels.items()))


class Detectors:
    """A sampler listener: evaluates every alert on every sample."""

    ALERTS = (
        "GpuMemFragmentationHigh",
        "GpuMemAllocRetries",
        "GpuMemOutOfMemory",
        "GpuMemOomFragmentation",
        "GpuMemCacheGapHigh",
        "GpuMemFreeCacheShattered",
        "GpuMemHeadroomLow",
        "GpuMemExhaustionPredicted",
        "HostMemoryPressure",
        "HostSwapGrowing",
        "HostMemoryHeldByProcess",
    )

    def __init__(
        self,
        thresholds: Thresholds | None = None,
        listeners: list[Listener] | None = None,
        *,
        log_events: bool = True,
    ) -> None:
        self.thresholds = thresholds or Thresholds()
        self.listeners = list(listeners or [])
        # Off in the agents of `gpumem-exporter run`, which detect only to remediate: the
        # launcher logs each alert once for the pod.
        self.log_events = log_events
        self._states: dict[tuple[str, Subject], _State] = {}
        self._counters: dict[tuple[str, Subject], _Counter] = {}
        self._series: dict[tuple[str, Subject], _Series] = {}
        self.__name__ = "detectors"
        # Bumped after every evaluation: what firing() answers may have changed since.
        self.evaluations = 0

    # -- public -------------------------------------------------------------------------

    def __call__(self, sample: Sample) -> None:
        t = sample.timestamp
        th = self.thresholds
        present: set[Subject] = set()
        gpu_free = {gpu.uuid: gpu.free_bytes for gpu in sample.gpus}
        for reading in sample.allocators:
            labels = {
                "device": str(reading.device),
                "gpu_uuid": reading.gpu_uuid,
                **reading.process,
            }
            key = subject(labels)
            present.add(key)
            check = self._fragmentation(reading)
            self._apply("GpuMemFragmentationHigh", key, t, check, th.fragmentation_for_s)
            for alert, counter in (
                ("GpuMemAllocRetries", "alloc_retries"),
                ("GpuMemOutOfMemory", "ooms"),
            ):
                if counter in reading.counters:
                    check = self._counter_check(alert, key, t, reading.counters[counter])
                    self._apply(alert, key, t, check, 0)
            # OOMs whose verdict was fragmentation: the cache had the bytes, in pieces. Its
            # own critical alert, because its fix is a setting, not more memory.
            fragmented = reading.ooms_by_verdict.get("fragmentation", 0)
            check = self._counter_check("GpuMemOomFragmentation", key, t, fragmented)
            self._apply("GpuMemOomFragmentation", key, t, check, 0)
            self._apply("GpuMemCacheGapHigh", key, t, self._cache_gap(reading), th.cache_gap_for_s)
            check = self._shattered(reading, gpu_free.get(reading.gpu_uuid))
            self._apply("GpuMemFreeCacheShattered", key, t, check, th.shattered_for_s)
        for gpu in sample.gpus:
            if gpu.free_bytes is None or not gpu.total_bytes:
                continue
            key = subject({"gpu": str(gpu.index), "gpu_uuid": gpu.uuid})
            self._apply("GpuMemHeadroomLow", key, t, self._headroom(gpu), th.headroom_for_s)
            check = self._exhaustion(gpu, key, t)
            self._apply("GpuMemExhaustionPredicted", key, t, check, th.exhaustion_for_s)
        host = sample.host
        if host is not None:
            self._apply("HostMemoryPressure", (), t, self._host_pressure(host), th.host_for_s)
            self._apply("HostSwapGrowing", (), t, self._swap(host, t), th.swap_for_s)
            for process in sample.host_processes:
                key = subject({"pid": str(process.pid), "role": process.role, "rank": process.rank})
                present.add(key)
                check = self._held_by_process(host, process)
                self._apply("HostMemoryHeldByProcess", key, t, check, th.host_process_for_s)
        self._forget_gone_processes(present, t)
        self.evaluations += 1

    def _forget_gone_processes(self, present: set[Subject], t: float) -> None:
        """A process that exited (a subject with a pid that this sample no longer has) takes
        its alert state with it, a firing alert resolving first: pids are reused, and the
        state must not grow with every worker a server starts."""
        for alert, key in list(self._states):
            if key in present or "pid" not in dict(key):
                continue
            self._apply(alert, key, t, None, 0)
            del self._states[(alert, key)]
            self._counters.pop((alert, key), None)

    def firing(self) -> Iterator[tuple[str, dict[str, str], bool]]:
        """(alert, labels, firing) for every alert and subject evaluated so far."""
        for (alert, key), state in sorted(self._states.items()):
            yield alert, dict(key), state.firing

    def firing_now(self) -> list[FiringAlert]:
        """The alerts firing now, critical first, then the longest firing."""
        alerts = [
            FiringAlert(alert, dict(key), SEVERITY[alert], state.firing_since, state.value)
            for (alert, key), state in self._states.items()
            if state.firing
        ]
        return sorted(alerts, key=lambda a: (a.severity != "critical", a.since or 0.0, a.alert))

    def is_firing(self, alert: str, labels: Mapping[str, str] | None = None) -> bool:
        state = self._states.get((alert, subject(labels or {})))
        return bool(state and state.firing)

    # -- conditions ---------------------------------------------------------------------

    def _fragmentation(self, reading: AllocatorReading) -> _Check | None:
        ratio = reading.fragmentation_ratio
        if ratio is None:  # undefined on this backend: never "no fragmentation"
            return None
        th = self.thresholds
        reserved = reading.gauges.get("reserved_bytes", 0)
        met = ratio > th.fragmentation_ratio and reserved > th.fragmentation_min_reserved_bytes
        cleared = (
            ratio <= th.fragmentation_ratio * (1 - th.clear_margin)
            or reserved <= th.fragmentation_min_reserved_bytes
        )
        return _Check(met, cleared, ratio)

    def _counter_check(self, alert: str, key: Subject, t: float, value: float) -> _Check:
        counter = self._counters.setdefault((alert, key), _Counter())
        counter.update(t, value)
        recent = (
            counter.risen_at is not None and t - counter.risen_at < self.thresholds.counter_window_s
        )
        return _Check(recent, not recent, counter.rise if recent else 0.0)

    def _cache_gap(self, reading: AllocatorReading) -> _Check | None:
        gap, ratio = reading.cached_free_bytes, reading.cached_free_ratio
        if gap is None or ratio is None:
            return None
        th = self.thresholds
        keep = 1 - th.clear_margin
        return _Check(
            gap > th.cache_gap_bytes and ratio > th.cache_gap_ratio,
            gap <= th.cache_gap_bytes * keep or ratio <= th.cache_gap_ratio * keep,
            gap,
        )

    def _shattered(self, reading: AllocatorReading, gpu_free: int | None) -> _Check | None:
        """The free cache is in pieces (its largest block is a small share of it) and the GPU
        (or the process's memory cap) has less room than that share of it too: a request the
        free cache could hold in total fits neither a free block nor a new cudaMalloc. While
        the device has room, a shattered cache does no harm. Reports the largest free block in
        bytes, as the Prometheus alert does."""
        share = reading.largest_free_block_share
        if share is None:  # no layout (cudaMallocAsync, skipped, not read yet): unknown
            return None
        # Room for a new cudaMalloc: the GPU's free memory, and under a per-process cap
        # (set_per_process_memory_fraction) no more than the cap leaves.
        rooms = [gpu_free] if gpu_free is not None else []
        limit = reading.gauges.get("memory_limit_bytes")
        reserved = reading.gauges.get("reserved_bytes")
        if limit is not None and reserved is not None:
            rooms.append(max(limit - reserved, 0))
        if not rooms:  # neither NVML nor a cap for this GPU: the device side is unknown
            return None
        room = min(rooms)
        th = self.thresholds
        free = reading.layout["default_pool_free_bytes"]
        largest = reading.layout["largest_free_block_bytes"]
        device_limit = th.shattered_block_share * free
        return _Check(
            share < th.shattered_block_share
            and free > th.shattered_min_free_bytes
            and room < device_limit,
            share >= th.shattered_block_share * (1 + th.clear_margin)
            or free <= th.shattered_min_free_bytes * (1 - th.clear_margin)
            or room >= device_limit * (1 + th.clear_margin),
            largest,
        )

    def _below(self, ratio: float, floor: float) -> _Check:
        """A ratio under its floor; clears only once clearly back above it (hysteresis)."""
        return _Check(ratio < floor, ratio >= floor * (1 + self.thresholds.clear_margin), ratio)

    def _headroom(self, gpu: GpuReading) -> _Check:
        assert gpu.free_bytes is not None and gpu.total_bytes
        return self._below(gpu.free_bytes / gpu.total_bytes, self.thresholds.headroom_free_ratio)

    def _exhaustion(self, gpu: GpuReading, key: Subject, t: float) -> _Check:
        assert gpu.free_bytes is not None and gpu.total_bytes
        th = self.thresholds
        series = self._series.setdefault(("free", key), _Series(th.exhaustion_window_s))
        series.add(t, gpu.free_bytes)
        slope = series.slope()
        ratio = gpu.free_bytes / gpu.total_bytes
        if slope is None:
            return _Check(False, True, 0.0)
        predicted = gpu.free_bytes + slope * th.exhaustion_horizon_s
        met = ratio < th.exhaustion_free_ratio and slope < 0 and predicted < 0
        cleared = slope >= 0 or ratio >= th.exhaustion_free_ratio * (1 + th.clear_margin)
        return _Check(met, cleared, predicted)

    def _host_pressure(self, host: HostReading) -> _Check | None:
        if not host.total_bytes:
            return None
        return self._below(
            host.available_bytes / host.total_bytes, self.thresholds.host_available_ratio
        )

    def _held_by_process(self, host: HostReading, process: HostProcessReading) -> _Check | None:
        if not host.total_bytes:
            return None
        th = self.thresholds
        in_use = host.total_bytes - host.available_bytes
        available = host.available_bytes / host.total_bytes
        share = process.resident_bytes / in_use if in_use > 0 else 0.0
        keep = 1 - th.clear_margin
        return _Check(
            available < th.host_process_available_ratio and share > th.host_process_share,
            available >= th.host_process_available_ratio * (1 + th.clear_margin)
            or share <= th.host_process_share * keep,
            process.resident_bytes,
        )

    def _swap(self, host: HostReading, t: float) -> _Check:
        th = self.thresholds
        series = self._series.setdefault(("swap", ()), _Series(th.swap_window_s))
        series.add(t, host.swap_used_bytes)
        slope = series.slope() or 0.0
        met = host.swap_used_bytes > th.swap_min_used_bytes and slope > th.swap_growth_bytes_per_s
        return _Check(met, slope <= 0 or host.swap_used_bytes <= th.swap_min_used_bytes, slope)

    # -- state machine ------------------------------------------------------------------

    def _apply(
        self, alert: str, key: Subject, t: float, check: _Check | None, for_s: float
    ) -> None:
        state = self._states.setdefault((alert, key), _State())
        if check is None:  # not defined here: nothing pending; a firing alert clears
            check = _Check(False, True, 0.0)
        state.value = check.value
        if state.firing:
            if check.cleared:
                state.firing = False
                state.pending_since = None
                self._emit(AlertEvent(alert, "resolved", check.value, t, dict(key)))
            return
        if not check.met:
            state.pending_since = None
            return
        if state.pending_since is None:
            state.pending_since = t
        if t - state.pending_since >= for_s:
            state.firing = True
            state.firing_since = t
            self._emit(AlertEvent(alert, "firing", check.value, t, dict(key)))

    def _emit(self, event: AlertEvent) -> None:
        if self.log_events:
            record: dict[str, Any] = {
                "event": "gpumem_alert",
                "alert": event.alert,
                "state": event.state,
                "value": event.value,
                **event.labels,
            }
            level = logging.WARNING if event.state == "firing" else logging.INFO
            log.log(level, json.dumps(record, sort_keys=True))
        for listener in self.listeners:
            try:
                listener(event)
            except Exception as exc:  # the host's callback must not break detection
                log.error("on_alert callback failed: %s: %s", type(exc).__name__, exc)
