"""Actions on the allocator: empty_cache, snapshots, history recording, peak reset.

Guards come from shared/FACTS.md: act only on devices this process already initialized, call
empty_cache under `torch.cuda.device(i)` (from a new thread the current device is 0, and an
empty_cache there would create a context on GPU 0), pass explicit indices to
reset_peak_memory_stats, and never snapshot on cudaMallocAsync, where `_snapshot` raises.
empty_cache waits for queued GPU work and holds each device's allocator mutex meanwhile, so it
blocks the server's allocations for as long as that takes: callers run it off the serving
path and rate-limit it.

`ReplayActions` does the same on recorded data for the demo: nothing is freed or reset, and
every result says it is a replay.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from exporter.snapshots import SnapshotInfo, SnapshotStore

log = logging.getLogger("exporter.actions")

STACK_MODES = ("python", "all")
CONTEXT_MODES = ("all", "alloc", "state")


class ActionUnavailable(RuntimeError):
    """The action cannot run here (no CUDA yet, unsupported backend): a 409/501, not a 500."""

    def __init__(self, message: str, *, unsupported: bool = False) -> None:
        super().__init__(message)
        self.unsupported = unsupported  # True: never possible here (501); False: not now (409)


@dataclass(frozen=True)
class EmptyCacheResult:
    devices: list[int]
    reserved_before_bytes: dict[int, int]
    reserved_after_bytes: dict[int, int]
    duration_s: float
    replay: bool = False

    @property
    def released_bytes(self) -> int:
        return sum(
            max(self.reserved_before_bytes[d] - self.reserved_after_bytes[d], 0)
            for d in self.devices
        )


@dataclass
class HistoryState:
    enabled: bool = False
    max_entries: int = 0
    stacks: str = "python"
    context: str = "all"
    since: float | None = None
    owner: str = ""  # "api", "startup" or a windowed capture's id


@dataclass
class ActionCounts:
    snapshots: Counter[str] = field(default_factory=Counter)  # trigger -> count
    empty_cache: Counter[str] = field(default_factory=Counter)
    released_bytes_total: int = 0


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


class Actions:
    """The allocator actions of this process. Thread-safe; one capture or history at a time."""

    replay = False

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self.counts = ActionCounts()
        self.history = HistoryState()
        self._lock = threading.Lock()

    # -- helpers -------------------------------------------------------------------------

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

    # -- empty_cache ---------------------------------------------------------------------

    def empty_cache(self, device: int | None = None, trigger: str = "api") -> EmptyCacheResult:
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
        with self._lock:
            self.counts.empty_cache[trigger] += 1
            self.counts.released_bytes_total += result.released_bytes
        log.info(
            "empty_cache (%s) released %d bytes in %.3f s", trigger, result.released_bytes, duration
        )
        return result

    # -- snapshots -----------------------------------------------------------------------

    def capture(self) -> Any:
        """The raw snapshot dict (held GIL: ~2 ms without history, seconds with 50k stacks)."""
        torch = _torch()
        self._native(torch)
        return torch.cuda.memory._snapshot()

    def snapshot(
        self,
        trigger: str = "api",
        info: SnapshotInfo | None = None,
        meta: dict[str, Any] | None = None,
    ) -> SnapshotInfo:
        snapshot = self.capture()
        written = self.store.write(snapshot, trigger, info=info, meta=meta)
        self.count_snapshot(trigger)
        log.info("allocator snapshot (%s) written: %s", trigger, written.filename)
        return written

    def record_window(
        self,
        info: SnapshotInfo,
        record_s: float,
        *,
        max_entries: int,
        stacks: str = "python",
        context: str = "all",
    ) -> SnapshotInfo:
        """Record allocation history for `record_s` (unless it is already on), then dump it
        into `info`. On failure `info` is marked failed with the reason, and re-raised."""
        started_history = False
        try:
            if not self.history.enabled:
                self.start_history(
                    max_entries=max_entries, stacks=stacks, context=context, owner=info.id
                )
                started_history = True
            time.sleep(record_s)
            return self.snapshot("record", info=info)
        except Exception as exc:
            info.status = "failed"
            info.meta["error"] = str(exc)
            raise
        finally:
            if started_history:
                try:
                    self.stop_history(owner=info.id)
                except Exception as exc:
                    log.error("stopping history after %s failed: %s", info.id, exc)

    def count_snapshot(self, trigger: str) -> None:
        with self._lock:
            self.counts.snapshots[trigger] += 1

    # -- history -------------------------------------------------------------------------

    def start_history(
        self, *, max_entries: int, stacks: str = "python", context: str = "all", owner: str = "api"
    ) -> HistoryState:
        torch = _torch()
        self._native(torch)
        with self._lock:
            if self.history.enabled and self.history.owner not in (owner, "api", "startup"):
                raise ActionUnavailable("a windowed snapshot is recording history right now")
            # Always bounded: the default max_entries is unbounded (FACTS.md).
            torch.cuda.memory._record_memory_history(
                enabled="all", context=context, stacks=stacks, max_entries=max_entries
            )
            self.history = HistoryState(True, max_entries, stacks, context, time.time(), owner)
            return self.history

    def stop_history(self, owner: str = "api") -> HistoryState:
        torch = _torch()
        with self._lock:
            if (
                self.history.enabled
                and owner == "api"
                and self.history.owner not in ("api", "startup")
            ):
                raise ActionUnavailable("a windowed snapshot is recording history right now")
            if self.history.enabled:
                # Turning recording off clears the buffer: callers snapshot first if they want it.
                torch.cuda.memory._record_memory_history(enabled=None)
            self.history = HistoryState()
            return self.history

    # -- peaks ---------------------------------------------------------------------------

    def reset_peak(self, device: int | None = None) -> list[int]:
        """Set peak = current on the given (or every initialized) device, process-wide."""
        torch = _torch()
        devices = self._devices(torch, device)
        targets = [device] if device is not None else devices
        for d in targets:
            torch.cuda.reset_peak_memory_stats(d)  # explicit index: no context on GPU 0
        return targets


def demo_snapshot_path() -> Path:
    return Path(str(resources.files("exporter") / "data" / "demo_snapshot.pickle.gz"))


class ReplayActions(Actions):
    """The demo's actions: answered from the snapshot recorded beside the demo trace."""

    replay = True

    def __init__(self, store: SnapshotStore) -> None:
        super().__init__(store)
        self._snapshot: dict[str, Any] | None = None

    @property
    def _recorded(self) -> dict[str, Any]:
        if self._snapshot is None:  # loaded on first use: the demo starts without it
            from exporter.viewer import load_snapshot

            self._snapshot = load_snapshot(demo_snapshot_path())
        return self._snapshot

    def empty_cache(self, device: int | None = None, trigger: str = "api") -> EmptyCacheResult:
        # What empty_cache would have released: the segments with nothing active in them.
        devices = sorted({s["device"] for s in self._recorded["segments"]})
        if device is not None and device not in devices:
            raise ActionUnavailable(f"device {device} is not in the recording ({devices})")
        before = {
            d: sum(s["total_size"] for s in self._recorded["segments"] if s["device"] == d)
            for d in devices
        }
        after = {
            d: sum(
                s["total_size"]
                for s in self._recorded["segments"]
                if s["device"] == d and s["active_size"] > 0
            )
            for d in devices
        }
        with self._lock:
            self.counts.empty_cache[trigger] += 1
        return EmptyCacheResult(devices, before, after, 0.0, replay=True)

    def capture(self) -> Any:
        return self._recorded

    def start_history(
        self, *, max_entries: int, stacks: str = "python", context: str = "all", owner: str = "api"
    ) -> HistoryState:
        with self._lock:
            self.history = HistoryState(True, max_entries, stacks, context, time.time(), owner)
            return self.history

    def stop_history(self, owner: str = "api") -> HistoryState:
        with self._lock:
            self.history = HistoryState()
            return self.history

    def reset_peak(self, device: int | None = None) -> list[int]:
        return (
            [device]
            if device is not None
            else sorted({s["device"] for s in self._recorded["segments"]})
        )
