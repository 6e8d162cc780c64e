"""At every out-of-memory error: a verdict on why, and (rate-limited) an allocator snapshot.

PyTorch calls the observer on the OOM-ing thread, with the GIL held, after flushing its cache
and before raising OutOfMemoryError (docs/facts.md). There the observer takes what decides the
cause (exporter/oom_verdict.py): the allocator's stats (~22 us), its segments without history
(0.2-0.7 ms), NVML's process list for that GPU (~45 us), and decides. That is bounded work per
OOM, so every OOM of a storm gets its verdict. The snapshot file is rate-limited (a server can
OOM hundreds of times a minute) and written by a writer thread. The writer is not a daemon
thread: if the OOM kills the process, the interpreter still waits for the file to be written.

The observer is attached the moment CUDA is initialized (exporter.cuda_init: inside torch's
initialization, before the allocation that started it; attaching earlier could initialize it)
and can never be detached, so it checks `enabled` on every call. Nothing it does may raise: an
exception there would replace the OutOfMemoryError the server handles.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from exporter.oom_verdict import SNAPSHOT_KEY, OomLog, OomVerdict, decide, describe

if TYPE_CHECKING:
    from exporter.actions.snapshots import SnapshotStore

log = logging.getLogger("exporter.oom")

_attached_lock = threading.Lock()
_attached = False


class OomActions(Protocol):
    """What the observer needs of the process's actions (LocalActions has it)."""

    process: dict[str, str]
    store: SnapshotStore

    def capture(self) -> Any: ...

    def count_snapshot(self, trigger: str) -> None: ...


class OomReader(Protocol):
    """What the observer reads an OOM with (the allocator source has it)."""

    ooms: OomLog

    def light_snapshot(self) -> Mapping[str, Any]: ...

    def read_oom(
        self,
        device: int,
        requested: int,
        limit_or_total: int,
        device_free: int,
        segments: Any = None,
        missing: list[str] | None = None,
    ) -> OomVerdict: ...


class OomCapture:
    """The OOM observer; `attach()` once CUDA is initialized (actions.local.when_cuda_ready)."""

    def __init__(
        self,
        actions: OomActions,
        reader: OomReader,
        *,
        snapshots: bool = True,
        cooldown_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.actions = actions
        self.reader = reader
        self.snapshots = snapshots
        self.cooldown_s = cooldown_s
        self.enabled = True
        self._clock = clock
        self._last: float | None = None

    def attach(self, *, initializing: bool = False) -> bool:
        """Attach the observer (once per process); False where CUDA is not up or the backend
        has none. `initializing`: called from torch's initialization queue, where the driver
        and the allocator are up but `is_initialized()` still says False."""
        global _attached
        torch = sys.modules.get("torch")
        attach = getattr(getattr(torch, "_C", None), "_cuda_attach_out_of_memory_observer", None)
        if torch is None or attach is None:
            return False
        if not initializing and not torch.cuda.is_initialized():
            return False
        if torch.cuda.get_allocator_backend() != "native":
            return False  # cudaMallocAsync has no OOM observer (nor OOM counts)
        with _attached_lock:
            if _attached:
                return True
            attach(self.observe)
            _attached = True
        log.info("OOM verdicts armed%s", " with snapshots" if self.snapshots else "")
        return True

    def _snapshot_due(self) -> bool:
        if not self.snapshots:
            return False
        now = self._clock()
        if self._last is not None and now - self._last < self.cooldown_s:
            return False
        self._last = now
        return True

    def observe(self, device: int, alloc_size: int, device_total: int, device_free: int) -> None:
        """Runs on the OOM-ing thread: bounded, and never raises (that would replace the OOM)."""
        started, at = time.perf_counter(), time.time()  # the OOM's time, before any reading
        try:
            if not self.enabled:
                return
            due = self._snapshot_due()
            snapshot, missing = None, []
            try:
                # The file's snapshot (history too, if someone is recording it) or the light
                # one: either gives the segments the verdict needs.
                snapshot = self.actions.capture() if due else self.reader.light_snapshot()
            except Exception as exc:
                missing.append(f"allocator snapshot: {exc!s:.120}")
            segments = snapshot.get("segments") if isinstance(snapshot, Mapping) else None
            try:
                readings = self.reader.read_oom(
                    device, alloc_size, device_total, device_free, segments, missing
                )
            except Exception as exc:  # a bug here still leaves a counted, named OOM
                readings = OomVerdict(
                    device,
                    at,
                    alloc_size,
                    device_free_bytes=device_free,
                    missing=f"exporter error: {type(exc).__name__}: {exc!s:.120}",
                )
            took = time.perf_counter() - started
            verdict = decide(replace(readings, timestamp=at, observe_s=took))
            if self.reader.ooms.record(verdict, snapshot_coming=due and snapshot is not None):
                log.warning("OOM on cuda:%d: %s", device, describe(verdict))
            if due and snapshot is not None:
                self._hand_to_writer(snapshot, verdict)
        except Exception as exc:  # never let the observer turn an OOM into something else
            log.error("OOM verdict failed: %s: %s", type(exc).__name__, exc)

    def _hand_to_writer(self, snapshot: Any, verdict: OomVerdict) -> None:
        writer = threading.Thread(
            target=self._write,
            args=(snapshot, verdict),
            name="gpumem-oom-writer",
            daemon=False,
        )
        writer.start()

    def _write(self, snapshot: Any, verdict: OomVerdict) -> None:
        try:
            meta = {
                "device": verdict.device,
                "alloc_size": verdict.requested_bytes,
                "device_free": verdict.device_free_bytes,
                "oom": verdict.to_dict(),
                "process": self.actions.process,
            }
            if isinstance(snapshot, dict):  # the verdict travels with the file, offline too
                snapshot = {**snapshot, SNAPSHOT_KEY: verdict.to_dict()}
            info = self.actions.store.write(snapshot, "oom", device=verdict.device, meta=meta)
            self.actions.count_snapshot("oom")
            self.reader.ooms.set_snapshot(verdict.device, verdict.timestamp, info.id)
            log.warning("OOM snapshot of cuda:%d written: %s", verdict.device, info.filename)
        except Exception as exc:
            log.error("writing the OOM snapshot failed: %s: %s", type(exc).__name__, exc)
