"""This process's allocator: empty_cache, snapshots, history recording, peak reset.

Guards come from docs/facts.md: act only on devices this process already initialized, call
empty_cache under `torch.cuda.device(i)` (from a new thread the current device is 0, and an
empty_cache there would create a context on GPU 0), pass explicit indices to
reset_peak_memory_stats, and never snapshot on cudaMallocAsync, where `_snapshot` raises.
empty_cache waits for queued GPU work and holds each device's allocator mutex meanwhile, so it
blocks the server's allocations for as long as that takes: it runs off the serving path and is
rate-limited per process.

Used by an embedded exporter and by each agent of `gpumem-exporter run` (which answers the
launcher's fan-out with these same methods).
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from exporter import pools
from exporter.actions.base import (
    ActionConflict,
    ActionCooldown,
    ActionFailed,
    ActionUnavailable,
    HistoryParams,
    ProcessResult,
    Target,
)
from exporter.actions.snapshots import SnapshotInfo, SnapshotStore
from exporter.actions.spec import BY_NAME
from exporter.identity import process_labels
from exporter.sample import ActionCounts, ProcessCounts

if TYPE_CHECKING:
    from exporter.actions.oom import OomCapture, OomReader
    from exporter.actions.remediation import Remediation
    from exporter.config import Config
    from exporter.detectors import Detectors
    from exporter.sample import Sample
    from exporter.sampler import Listener

log = logging.getLogger("exporter.actions")

# How long POST /snapshot/stop waits for the stopped window's snapshot to be written.
STOP_WAIT_S = 30.0


@dataclass(frozen=True)
class EmptyCacheResult:
    devices: list[int]
    reserved_before_bytes: dict[int, int]
    reserved_after_bytes: dict[int, int]
    duration_s: float

    @property
    def released_bytes(self) -> int:
        return sum(
            max(self.reserved_before_bytes[d] - self.reserved_after_bytes[d], 0)
            for d in self.devices
        )

    def public(self) -> dict[str, Any]:
        return {
            "devices": self.devices,
            "reserved_before_bytes": {str(k): v for k, v in self.reserved_before_bytes.items()},
            "reserved_after_bytes": {str(k): v for k, v in self.reserved_after_bytes.items()},
            "released_bytes": self.released_bytes,
            "duration_s": round(self.duration_s, 6),
            "scope": "every device of the process",
        }


@dataclass
class HistoryState:
    enabled: bool = False
    max_entries: int = 0
    stacks: str = "python"
    context: str = "all"
    since: float | None = None
    owner: str = ""  # "api", "startup" or a windowed capture's id

    def public(self) -> dict[str, Any]:
        data = asdict(self)
        del data["owner"]
        return data


def _torch() -> Any:
    torch = sys.modules.get("torch")  # never import torch for an action: see sources
    if torch is None or not torch.cuda.is_initialized():
        raise ActionUnavailable("CUDA is not initialized in this process: nothing to act on")
    return torch


def initialized_devices(torch: Any) -> list[int]:
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is None:
        return [torch.cuda.current_device()]
    return [i for i in range(torch.cuda.device_count()) if has_context(i)]


def _reserved(torch: Any, device: int) -> int:
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    return int(stats.get("reserved_bytes", {}).get("all", {}).get("current", 0))


def when_cuda_ready(action: Callable[[], object], name: str) -> Listener:
    """A sampler listener that runs `action` once, on the first sample where this process
    has a CUDA device in use: hooks that could initialize CUDA must wait for the host."""
    done = False

    def listener(sample: Sample) -> None:
        nonlocal done
        if not done and sample.allocators:
            done = True
            action()

    listener.__name__ = name
    return listener


class LocalActions:
    """The actions of this process. Thread-safe; one windowed capture at a time."""

    def __init__(
        self,
        store: SnapshotStore,
        *,
        config: Config | None = None,
        process: dict[str, str] | None = None,
        oom_reader: OomReader | None = None,
        component_problems: Callable[[], dict[str, int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        # Reads an OOM's verdict (the allocator source); None: no OOM observer here.
        self.oom_reader = oom_reader
        # What the server's named memory could not be counted as (the allocator source's).
        self.component_problems = component_problems
        # The OOM observer, once sample_listeners() made it (attached at CUDA's init).
        self.oom_capture: OomCapture | None = None
        self.config = config
        self.process = process if process is not None else process_labels()
        self.totals = ActionCounts()
        self.history_state = HistoryState()
        self._lock = threading.Lock()
        self._clock = clock
        self._last_empty_cache: float | None = None
        self._capturing: SnapshotInfo | None = None
        self._window_over = threading.Event()  # set to end a windowed capture early
        self._window_thread: threading.Thread | None = None
        self.remediation: Remediation | None = None  # when the settings turn it on

    # -- the interface (exporter.actions.base.Actions) -----------------------------------

    def snapshot(
        self, target: Target, *, record_s: float | None = None, history: HistoryParams
    ) -> list[ProcessResult]:
        return self._here(target, lambda: self._start_capture(record_s, history))

    def stop_capture(self, target: Target) -> list[ProcessResult]:
        return self._here(target, self._stop_capture)

    def empty_cache(self, target: Target, *, device: int | None = None) -> list[ProcessResult]:
        def run() -> dict[str, Any]:
            self._check_cooldown()
            return self._empty_cache_answer(self.empty_cache_now(device, trigger="api"))

        return self._here(target, run)

    def _empty_cache_answer(self, result: EmptyCacheResult) -> dict[str, Any]:
        return result.public()

    def history(self, target: Target) -> list[ProcessResult]:
        return self._here(target, self.history_state.public)

    def set_history(
        self,
        target: Target,
        *,
        enabled: bool,
        history: HistoryParams,
        snapshot_before_stop: bool = True,
    ) -> list[ProcessResult]:
        def run() -> dict[str, Any]:
            if self._capturing is not None:
                raise ActionConflict(f"capture {self._capturing.id} is recording history")
            dumped = None
            if enabled:
                state = self.start_history(history, owner="api")
            else:
                if snapshot_before_stop and self.history_state.enabled:
                    dumped = self.write_snapshot("history").public()
                state = self.stop_history()
            return {**state.public(), "snapshot": dumped}

        return self._here(target, run)

    def reset_peak(self, target: Target, *, device: int | None = None) -> list[ProcessResult]:
        return self._here(
            target, lambda: {"devices": self.reset_peak_now(device), "scope": "process"}
        )

    def perform(
        self, action: str, target: Target, params: Mapping[str, Any]
    ) -> list[ProcessResult]:
        return BY_NAME[action].call(self, target, dict(params))

    def counts(self) -> list[ProcessCounts]:
        remediations = self.remediation.counts if self.remediation is not None else {}
        with self._lock:
            counts = ActionCounts(
                snapshots=dict(self.totals.snapshots),
                empty_cache_released_bytes=self.totals.empty_cache_released_bytes,
                remediations={f"{a}/{o}": n for (a, o), n in remediations.items()},
            )
        if self.component_problems is not None:
            counts.component_problems = self.component_problems()
        return [ProcessCounts({}, counts)]

    def sample_listeners(self, detectors: Detectors) -> list[Listener]:
        self._arm_remediation(detectors)
        config = self.config
        listeners: list[Listener] = []
        if self.oom_reader is not None:
            from exporter.actions.oom import OomCapture

            oom = OomCapture(self, self.oom_reader)
            if config is not None:  # else OomCapture's own defaults
                oom.snapshots, oom.cooldown_s = config.oom_snapshot, config.oom_snapshot_cooldown_s
            self.oom_capture = oom
            listeners.append(when_cuda_ready(oom.attach, "oom_capture"))
        if config is not None and config.history_max_entries:
            params = HistoryParams(max_entries=config.history_max_entries)
            listeners.append(
                when_cuda_ready(
                    lambda: self.start_history(params, owner="startup"), "history_startup"
                )
            )
        return listeners

    def _arm_remediation(self, detectors: Detectors) -> None:
        """Remediation acts on this process's alerts, when the settings turn it on."""
        if self.config is not None and self.config.remediate:
            from exporter.actions.remediation import Remediation

            self.remediation = Remediation(
                self, detectors, cooldown_s=self.config.remediate_cooldown_s
            )
            detectors.listeners.append(self.remediation)

    # -- plumbing ------------------------------------------------------------------------

    def _here(self, target: Target, run: Callable[[], dict[str, Any]]) -> list[ProcessResult]:
        """Run `run` in this process if `target` names it; failures become results."""
        if not target.matches(self.process):
            return []
        try:
            return [ProcessResult(dict(self.process), True, run())]
        except ActionFailed as exc:
            return [
                ProcessResult(
                    dict(self.process),
                    False,
                    error=str(exc),
                    outcome=exc.outcome,
                    retry_after_s=exc.retry_after_s,
                )
            ]
        except Exception as exc:  # a bug or a torch error: reported, never raised
            log.exception("allocator action failed")
            return [
                ProcessResult(
                    dict(self.process), False, error=f"{type(exc).__name__}: {exc}", outcome="error"
                )
            ]

    def _check_cooldown(self) -> None:
        cooldown = self.config.empty_cache_cooldown_s if self.config else 0.0
        now = self._clock()
        with self._lock:
            last = self._last_empty_cache
            if last is not None and now - last < cooldown:
                retry = math.ceil(cooldown - (now - last))
                raise ActionCooldown(
                    f"empty_cache ran less than {cooldown:g} s ago; it waits for all queued "
                    "GPU work and blocks allocations meanwhile",
                    retry_after_s=retry,
                )
            self._last_empty_cache = now

    def _devices(self, torch: Any, device: int | None) -> list[int]:
        devices = initialized_devices(torch)
        if not devices:
            raise ActionUnavailable("no CUDA device is initialized in this process")
        if device is not None and device not in devices:
            raise ActionUnavailable(
                f"device {device} is not initialized in this process (initialized: {devices})"
            )
        return devices

    def _native(self, torch: Any) -> None:
        backend = torch.cuda.get_allocator_backend()
        if backend != "native":
            raise ActionUnavailable(
                f"allocator snapshots and history need the native backend; "
                f"this process uses {backend}",
                unsupported=True,
            )

    def _start_capture(self, record_s: float | None, history: HistoryParams) -> dict[str, Any]:
        """Immediate snapshot (status ready), or the start of a windowed one (recording)."""
        with self._lock:
            if self._capturing is not None:
                raise ActionConflict(
                    f"capture {self._capturing.id} is still recording; one capture at a time "
                    "(POST /snapshot/stop ends it now)"
                )
            if record_s is None:
                capturing = None
            else:
                self.capture()  # fail now (409/501) rather than after the window
                capturing = self.store.reserve("record", meta={"record_s": record_s})
                self._capturing = capturing
                self._window_over.clear()
                self._window_thread = threading.Thread(
                    target=self._record_window,
                    args=(capturing, record_s, history),
                    name="gpumem-record",
                    daemon=True,
                )
                self._window_thread.start()
        if capturing is None:
            return self.write_snapshot("api").public()
        return capturing.public()

    def _stop_capture(self) -> dict[str, Any]:
        """End the windowed capture now and wait for it to be written (what was recorded so
        far is kept); `stopped` is None when none was recording."""
        with self._lock:
            info, thread = self._capturing, self._window_thread
        if info is None or thread is None:
            return {"stopped": None}
        self._window_over.set()
        thread.join(STOP_WAIT_S)
        if thread.is_alive():
            raise ActionFailed(f"capture {info.id} was told to stop but is still being written")
        return {"stopped": info.public()}

    def _record_window(self, info: SnapshotInfo, record_s: float, history: HistoryParams) -> None:
        try:
            self.record_window(info, record_s, history)
        except Exception as exc:
            log.error("windowed snapshot %s failed: %s", info.id, exc)
        finally:
            with self._lock:
                self._capturing = self._window_thread = None

    # -- allocator primitives (also used by remediation and OOM capture) -----------------

    def empty_cache_now(self, device: int | None = None, trigger: str = "api") -> EmptyCacheResult:
        """Release fully free cached segments to the driver.

        PyTorch has no per-device empty_cache: one call releases on every device of the
        process; `device` picks the device guard (and must be initialized).
        """
        torch = _torch()
        devices = self._devices(torch, device)
        before = {d: _reserved(torch, d) for d in devices}
        started = time.perf_counter()
        with torch.cuda.device(device if device is not None else devices[0]):
            torch.cuda.empty_cache()
        duration = time.perf_counter() - started
        result = EmptyCacheResult(
            devices, before, {d: _reserved(torch, d) for d in devices}, duration
        )
        self._count_released(result.released_bytes)
        log.info(
            "empty_cache (%s) released %d bytes in %.3f s", trigger, result.released_bytes, duration
        )
        return result

    def _count_released(self, released: int) -> None:
        with self._lock:
            self.totals.empty_cache_released_bytes += released

    def capture(self) -> Any:
        """The raw snapshot dict (held GIL: ~2 ms without history, seconds with 50k stacks)."""
        torch = _torch()
        self._native(torch)
        return torch.cuda.memory._snapshot()

    def write_snapshot(
        self,
        trigger: str = "api",
        info: SnapshotInfo | None = None,
        meta: dict[str, Any] | None = None,
    ) -> SnapshotInfo:
        snapshot = self.capture()
        named = {"pool_names": names} if (names := pools.registry().names()) else {}
        written = self.store.write(
            snapshot, trigger, info=info, meta={"process": self.process, **named, **(meta or {})}
        )
        self.count_snapshot(trigger)
        log.info("allocator snapshot (%s) written: %s", trigger, written.filename)
        return written

    def record_window(self, info: SnapshotInfo, record_s: float, history: HistoryParams) -> None:
        """Record allocation history for `record_s` (unless it is already on), then dump it
        into `info`. On failure `info` is marked failed with the reason, and re-raised."""
        started_history = False
        started = time.monotonic()
        try:
            if not self.history_state.enabled:
                self.start_history(history, owner=info.id)
                started_history = True
            stopped_early = self._window_over.wait(record_s)
            meta = {"recorded_s": round(time.monotonic() - started, 3)} if stopped_early else None
            self.write_snapshot("record", info=info, meta=meta)
        except Exception as exc:
            self.store.fail(info, str(exc))
            raise
        finally:
            if started_history:
                try:
                    self.stop_history(owner=info.id)
                except Exception as exc:
                    log.error("stopping history after %s failed: %s", info.id, exc)

    def count_snapshot(self, trigger: str) -> None:
        with self._lock:
            self.totals.snapshots[trigger] = self.totals.snapshots.get(trigger, 0) + 1

    def _history_recorder(self, *, starting: bool) -> Callable[..., None]:
        """PyTorch's history switch, once the checks for turning it on or off have passed."""
        torch = _torch()
        if starting:
            self._native(torch)
        recorder: Callable[..., None] = torch.cuda.memory._record_memory_history
        return recorder

    def start_history(self, params: HistoryParams, owner: str = "api") -> HistoryState:
        record = self._history_recorder(starting=True)
        with self._lock:
            state = self.history_state
            if state.enabled and state.owner not in (owner, "api", "startup"):
                raise ActionConflict("a windowed snapshot is recording history right now")
            # Always bounded: the default max_entries is unbounded (docs/facts.md).
            record(
                enabled="all",
                context=params.context,
                stacks=params.stacks,
                max_entries=params.max_entries,
            )
            self.history_state = HistoryState(
                True, params.max_entries, params.stacks, params.context, time.time(), owner
            )
            return self.history_state

    def stop_history(self, owner: str = "api") -> HistoryState:
        record = self._history_recorder(starting=False)
        with self._lock:
            state = self.history_state
            if state.enabled and owner == "api" and state.owner not in ("api", "startup"):
                raise ActionConflict("a windowed snapshot is recording history right now")
            if state.enabled:
                # Turning recording off clears the buffer: callers snapshot first if they want it.
                record(enabled=None)
            self.history_state = HistoryState()
            return self.history_state

    def reset_peak_now(self, device: int | None = None) -> list[int]:
        """Set peak = current on the given (or every initialized) device, process-wide."""
        torch = _torch()
        devices = self._devices(torch, device)
        targets = [device] if device is not None else devices
        for d in targets:
            torch.cuda.reset_peak_memory_stats(d)  # explicit index: no context on GPU 0
        return targets
