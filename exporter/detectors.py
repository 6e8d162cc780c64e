"""The in-process alerts, evaluated on every sample.

Each alert is declared once in exporter.alerts (its condition, thresholds, duration; the same
as its rule in deploy/prometheus/alerts.yaml, which a test holds equal); this module evaluates
them, for servers that are not scraped yet, for a callback the server can act on
(`on_alert`), and for the optional remediation policy. Each alert is edge-triggered: one
structured log line when it starts firing and one when it clears. Hysteresis keeps a value
hovering at a threshold from flapping: an alert clears only when the value is clearly back on
the safe side (`detect_clear_margin`), or when a counter has not moved for a whole window.

State is kept per alert and subject, where the subject is every label that names it: the CUDA
ordinal (`device`) and `gpu_uuid` plus the process labels (pid, rank, local_rank, role) for
allocator alerts, so that two processes on one GPU never share a counter or a timer; the NVML
index (`gpu`) and `gpu_uuid` for GPU alerts; the process (pid, role, rank) for per-process host
memory; nothing for the host.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from exporter.alerts import ALERTS, BY_NAME, ON, Alert, Check, Evaluation, Subject
from exporter.config import Config
from exporter.sample import Sample

log = logging.getLogger("exporter.alerts")


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


@dataclass
class FiringAlert:
    alert: str
    labels: dict[str, str]
    severity: str  # as the shipped Prometheus rule labels it (exporter.alerts)
    since: float | None  # when it started firing (sample time, Unix seconds)
    value: float  # the value of the latest evaluation (a ratio, bytes, a count of rises)


@dataclass
class SettingsSeen:
    """An allocator's live settings as last seen, how often they changed while its process
    ran, and each setting's last change (setting -> (from, to))."""

    settings: Mapping[str, str]
    changes: int = 0
    last: dict[str, tuple[str, str]] = field(default_factory=dict)


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
    """Remembers when a counter last rose, and its rises within the window (what the alert's
    value says: "OOMs in the last 10 min" is their sum, as Prometheus's increase() over the
    rule's range; it was the latest rise alone, 1 beside a banner of 5). A first reading
    above 0 counts as a rise; a reading below the last (a restart) starts again from it."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.risen_at: float | None = None
        self._rises: deque[tuple[float, float]] = deque()  # (t, by how much), oldest first

    def update(self, t: float, value: float) -> None:
        previous = self.last
        if (previous is None and value > 0) or (previous is not None and value > previous):
            self._rises.append((t, value - (previous or 0)))
            self.risen_at = t
        self.last = value

    def risen_within(self, t: float, window_s: float) -> float:
        while self._rises and t - self._rises[0][0] >= window_s:
            self._rises.popleft()
        return sum(rise for _, rise in self._rises)


Listener = Callable[[AlertEvent], None]


def subject(labels: Mapping[str, str]) -> Subject:
    return tuple(sorted(labels.items()))


class Detectors:
    """A sampler listener: evaluates every declared alert (exporter.alerts) on every sample."""

    ALERTS = tuple(alert.name for alert in ALERTS)

    def __init__(
        self,
        settings: Config | None = None,
        listeners: list[Listener] | None = None,
        *,
        log_events: bool = True,
    ) -> None:
        # The thresholds are settings (detect_*); defaults where none are given.
        self.settings = settings if settings is not None else Config()
        # The declared alerts by what they are evaluated for, in declaration order, each with
        # how long its condition must hold: worked out once, not per sample and subject.
        self._plan: dict[str, tuple[tuple[Alert, float], ...]] = {
            on: tuple(
                (alert, getattr(self.settings, alert.hold) if alert.hold else 0.0)
                for alert in ALERTS
                if alert.on == on
            )
            for on in ON
        }
        self.listeners = list(listeners or [])
        # Off in the agents of `gpumem-exporter run`, which detect only to remediate: the
        # launcher logs each alert once for the pod.
        self.log_events = log_events
        self._states: dict[tuple[str, Subject], _State] = {}
        self._counters: dict[tuple[str, Subject], _Counter] = {}
        self._series: dict[tuple[str, Subject], _Series] = {}
        self._settings: dict[Subject, SettingsSeen] = {}  # by allocator subject
        self.__name__ = "detectors"
        # Bumped after every evaluation: what firing() answers may have changed since.
        self.evaluations = 0

    # -- public -------------------------------------------------------------------------

    def __call__(self, sample: Sample) -> None:
        t, settings = sample.timestamp, self.settings
        present: set[Subject] = set()
        gpu_free = {gpu.uuid: gpu.free_bytes for gpu in sample.gpus}
        for reading in sample.allocators:
            labels = {"device": str(reading.device), "gpu_uuid": reading.gpu_uuid}
            key = subject({**labels, **reading.process})
            present.add(key)
            free = gpu_free.get(reading.gpu_uuid)
            self._evaluate("allocator", Evaluation(t, settings, self, key, reading, gpu_free=free))
        for gpu in sample.gpus:
            if gpu.free_bytes is None or not gpu.total_bytes:
                continue
            key = subject({"gpu": str(gpu.index), "gpu_uuid": gpu.uuid})
            self._evaluate("gpu", Evaluation(t, settings, self, key, gpu=gpu))
        host = sample.host
        if host is not None:
            self._evaluate("host", Evaluation(t, settings, self, (), host=host))
            for process in sample.host_processes:
                key = subject({"pid": str(process.pid), "role": process.role, "rank": process.rank})
                present.add(key)
                seen = Evaluation(t, settings, self, key, host=host, process=process)
                self._evaluate("host_process", seen)
        self._forget_gone_processes(present, t)
        self.evaluations += 1

    def _evaluate(self, on: str, seen: Evaluation) -> None:
        """Each alert declared for this kind of subject, in declaration order."""
        for alert, hold in self._plan[on]:
            if alert.applies is not None and not alert.applies(seen):
                continue
            seen.alert = alert.name
            self._apply(alert.name, seen.key, seen.t, alert.condition(seen), hold)

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
        for key in [k for k in self._settings if k not in present and "pid" in dict(k)]:
            del self._settings[key]

    def firing(self) -> Iterator[tuple[str, dict[str, str], bool]]:
        """(alert, labels, firing) for every alert and subject evaluated so far."""
        for (alert, key), state in sorted(self._states.items()):
            yield alert, dict(key), state.firing

    def firing_subjects(self) -> list[tuple[str, dict[str, str]]]:
        """(alert, labels) of each alert firing now, in firing()'s order: what /metrics and
        /stats serve, on every render. The states that are not firing (most of them) are
        neither sorted nor made into labels: 0.6 against 6 us hot for the demo's 11."""
        firing = [(alert, key) for (alert, key), state in self._states.items() if state.firing]
        return [(alert, dict(key)) for alert, key in sorted(firing)]

    def firing_now(self) -> list[FiringAlert]:
        """The alerts firing now, critical first, then the longest firing."""
        alerts = [
            FiringAlert(alert, dict(key), BY_NAME[alert].severity, state.firing_since, state.value)
            for (alert, key), state in self._states.items()
            if state.firing
        ]
        return sorted(alerts, key=lambda a: (a.severity != "critical", a.since or 0.0, a.alert))

    def is_firing(self, alert: str, labels: Mapping[str, str] | None = None) -> bool:
        state = self._states.get((alert, subject(labels or {})))
        return bool(state and state.firing)

    # -- what conditions remember ----------------------------------------------------------

    def rose(self, alert: str, key: Subject, t: float, value: float) -> Check:
        """Firing while the counter rose within the window; its value the latest rise."""
        # get, then create: setdefault would build a new one on every call (every tick).
        counter = self._counters.get((alert, key))
        if counter is None:
            counter = self._counters[alert, key] = _Counter()
        counter.update(t, value)
        window_s = self.settings.detect_counter_window_s
        recent = counter.risen_at is not None and t - counter.risen_at < window_s
        return Check(recent, not recent, counter.risen_within(t, window_s) if recent else 0.0)

    def changes(self, key: Subject, settings: Mapping[str, str] | None) -> int:
        """How often this allocator's live settings changed so far (None: not read live
        this time, nothing to compare). Each change is said once, from what to what."""
        seen = self._settings.get(key)
        if settings is None:
            return seen.changes if seen is not None else 0
        if seen is None:
            self._settings[key] = SettingsSeen(dict(settings))
            return 0
        if settings != seen.settings:
            moved = {
                name: (seen.settings.get(name, ""), value)
                for name, value in settings.items()
                if seen.settings.get(name, "") != value
            }
            seen.settings, seen.changes = dict(settings), seen.changes + 1
            seen.last.update(moved)
            if self.log_events:
                record: dict[str, Any] = {"event": "gpumem_allocator_settings_changed", **dict(key)}
                record["changed"] = {name: {"from": a, "to": b} for name, (a, b) in moved.items()}
                log.warning(json.dumps(record, sort_keys=True))
        return seen.changes

    def settings_changes(self) -> Iterator[tuple[dict[str, str], SettingsSeen]]:
        """(subject labels, what was seen) of each allocator whose settings changed."""
        for key, seen in sorted(self._settings.items()):
            if seen.changes:
                yield dict(key), seen

    def trend(self, name: str, key: Subject, window_s: float) -> _Series:
        series = self._series.get((name, key))
        if series is None:
            series = self._series[name, key] = _Series(window_s)
        return series

    # -- state machine ------------------------------------------------------------------

    def _apply(self, alert: str, key: Subject, t: float, check: Check | None, for_s: float) -> None:
        state = self._states.get((alert, key))
        if state is None:
            state = self._states[alert, key] = _State()
        if check is None:  # not defined here: nothing pending; a firing alert clears
            check = Check(False, True, 0.0)
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
