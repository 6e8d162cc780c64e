"""In-process alert logic, evaluated on every sample.

The same conditions as deploy/prometheus/alerts.yaml (names, thresholds and durations mirror
it; change both together), for servers that are not scraped yet, for a callback the server can
act on (`on_alert`), and for the optional remediation policy. Each alert is edge-triggered: one
structured log line when it starts firing and one when it clears. Hysteresis keeps a value
hovering at a threshold from flapping: an alert clears only when the value is clearly back on
the safe side (`clear_margin`), or when a counter has not moved for a whole window.
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
from exporter.sample import AllocatorReading, GpuReading, HostReading, Sample

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
    """What `on_alert` receives when an alert starts firing or clears."""

    alert: str
    device: str  # CUDA ordinal for allocator alerts, NVML index for GPU ones, "" for the host
    state: str  # "firing" or "resolved"
    value: float
    timestamp: float
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class _State:
    pending_since: float | None = None
    firing: bool = False
    value: float = 0.0


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


class Detectors:
    """A sampler listener: evaluates every alert on every sample."""

    ALERTS = (
        "GpuMemFragmentationHigh",
        "GpuMemAllocRetries",
        "GpuMemOutOfMemory",
        "GpuMemCacheGapHigh",
        "GpuMemHeadroomLow",
        "GpuMemExhaustionPredicted",
        "HostMemoryPressure",
        "HostSwapGrowing",
    )

    def __init__(
        self, thresholds: Thresholds | None = None, listeners: list[Listener] | None = None
    ) -> None:
        self.thresholds = thresholds or Thresholds()
        self.listeners = list(listeners or [])
        self._states: dict[tuple[str, str], _State] = {}
        self._counters: dict[tuple[str, str], _Counter] = {}
        self._series: dict[tuple[str, str], _Series] = {}
        self.__name__ = "detectors"

    # -- public -------------------------------------------------------------------------

    def __call__(self, sample: Sample) -> None:
        t = sample.timestamp
        for reading in sample.allocators:
            device = str(reading.device)
            labels = {"gpu_uuid": reading.gpu_uuid}
            self._apply(
                "GpuMemFragmentationHigh",
                device,
                t,
                self._fragmentation(reading),
                self.thresholds.fragmentation_for_s,
                labels,
            )
            for alert, key in (
                ("GpuMemAllocRetries", "alloc_retries"),
                ("GpuMemOutOfMemory", "ooms"),
            ):
                if key in reading.counters:
                    check = self._counter_check(alert, device, t, reading.counters[key])
                    self._apply(alert, device, t, check, 0, labels)
            self._apply(
                "GpuMemCacheGapHigh",
                device,
                t,
                self._cache_gap(reading),
                self.thresholds.cache_gap_for_s,
                labels,
            )
        for gpu in sample.gpus:
            device = str(gpu.index)
            labels = {"gpu_uuid": gpu.uuid}
            if gpu.free_bytes is None or not gpu.total_bytes:
                continue
            self._apply(
                "GpuMemHeadroomLow",
                device,
                t,
                self._headroom(gpu),
                self.thresholds.headroom_for_s,
                labels,
            )
            self._apply(
                "GpuMemExhaustionPredicted",
                device,
                t,
                self._exhaustion(gpu, t),
                self.thresholds.exhaustion_for_s,
                labels,
            )
        if sample.host is not None:
            self._apply(
                "HostMemoryPressure",
                "",
                t,
                self._host_pressure(sample.host),
                self.thresholds.host_for_s,
                {},
            )
            self._apply(
                "HostSwapGrowing", "", t, self._swap(sample.host, t), self.thresholds.swap_for_s, {}
            )

    def firing(self) -> Iterator[tuple[str, str, bool]]:
        """(alert, device, firing) for every alert evaluated so far."""
        for (alert, device), state in sorted(self._states.items()):
            yield alert, device, state.firing

    def is_firing(self, alert: str, device: str = "") -> bool:
        state = self._states.get((alert, device))
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

    def _counter_check(self, alert: str, device: str, t: float, value: float) -> _Check:
        counter = self._counters.setdefault((alert, device), _Counter())
        counter.update(t, value)
        recent = (
            counter.risen_at is not None and t - counter.risen_at < self.thresholds.counter_window_s
        )
        return _Check(recent, not recent, counter.rise if recent else 0.0)

    def _cache_gap(self, reading: AllocatorReading) -> _Check | None:
        reserved = reading.gauges.get("reserved_bytes")
        allocated = reading.gauges.get("allocated_bytes")
        ratio = reading.cached_free_ratio
        if reserved is None or allocated is None or ratio is None:
            return None
        th = self.thresholds
        gap = reserved - allocated
        keep = 1 - th.clear_margin
        return _Check(
            gap > th.cache_gap_bytes and ratio > th.cache_gap_ratio,
            gap <= th.cache_gap_bytes * keep or ratio <= th.cache_gap_ratio * keep,
            gap,
        )

    def _below(self, ratio: float, floor: float) -> _Check:
        """A ratio under its floor; clears only once clearly back above it (hysteresis)."""
        return _Check(ratio < floor, ratio >= floor * (1 + self.thresholds.clear_margin), ratio)

    def _headroom(self, gpu: GpuReading) -> _Check:
        assert gpu.free_bytes is not None and gpu.total_bytes
        return self._below(gpu.free_bytes / gpu.total_bytes, self.thresholds.headroom_free_ratio)

    def _exhaustion(self, gpu: GpuReading, t: float) -> _Check:
        assert gpu.free_bytes is not None and gpu.total_bytes
        th = self.thresholds
        series = self._series.setdefault(("free", str(gpu.index)), _Series(th.exhaustion_window_s))
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

    def _swap(self, host: HostReading, t: float) -> _Check:
        th = self.thresholds
        series = self._series.setdefault(("swap", ""), _Series(th.swap_window_s))
        series.add(t, host.swap_used_bytes)
        slope = series.slope() or 0.0
        met = host.swap_used_bytes > th.swap_min_used_bytes and slope > th.swap_growth_bytes_per_s
        return _Check(met, slope <= 0 or host.swap_used_bytes <= th.swap_min_used_bytes, slope)

    # -- state machine ------------------------------------------------------------------

    def _apply(
        self,
        alert: str,
        device: str,
        t: float,
        check: _Check | None,
        for_s: float,
        labels: dict[str, str],
    ) -> None:
        state = self._states.setdefault((alert, device), _State())
        if check is None:  # not defined here: nothing pending; a firing alert clears
            check = _Check(False, True, 0.0)
        state.value = check.value
        if state.firing:
            if check.cleared:
                state.firing = False
                state.pending_since = None
                self._emit(AlertEvent(alert, device, "resolved", check.value, t, labels))
            return
        if not check.met:
            state.pending_since = None
            return
        if state.pending_since is None:
            state.pending_since = t
        if t - state.pending_since >= for_s:
            state.firing = True
            self._emit(AlertEvent(alert, device, "firing", check.value, t, labels))

    def _emit(self, event: AlertEvent) -> None:
        record: dict[str, Any] = {
            "event": "gpumem_alert",
            "alert": event.alert,
            "state": event.state,
            "device": event.device,
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
