"""Opt-in OOM capture: an allocator snapshot taken at the moment PyTorch runs out of memory.

PyTorch calls the observer on the OOM-ing thread, with the GIL held, after flushing its cache
and before raising OutOfMemoryError (docs/facts.md). So the observer only takes the snapshot (and
only if the cooldown allows: a server can OOM hundreds of times a minute) and hands it to a
writer thread. The writer is not a daemon thread: if the OOM kills the process, the
interpreter still waits for the file to be written before it exits.

The observer is attached once CUDA is initialized (attaching earlier could initialize it) and
can never be detached, so it checks `enabled` on every call.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

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


class OomCapture:
    """The OOM observer; `attach()` once CUDA is initialized (actions.local.when_cuda_ready)."""

    def __init__(
        self,
        actions: OomActions,
        *,
        cooldown_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.actions = actions
        self.cooldown_s = cooldown_s
        self.enabled = True
        self._clock = clock
        self._last: float | None = None

    def attach(self) -> bool:
        global _attached
        torch = sys.modules.get("torch")
        attach = getattr(getattr(torch, "_C", None), "_cuda_attach_out_of_memory_observer", None)
        if torch is None or attach is None or not torch.cuda.is_initialized():
            return False
        if torch.cuda.get_allocator_backend() != "native":
            return False  # cudaMallocAsync has no snapshots
        with _attached_lock:
            if _attached:
                return True
            attach(self.observe)
            _attached = True
        log.info("OOM capture armed: a snapshot is written on the next out-of-memory error")
        return True

    def observe(self, device: int, alloc_size: int, device_total: int, device_free: int) -> None:
        """Runs on the OOM-ing thread: cheap, and never raises (that would replace the OOM)."""
        try:
            if not self.enabled:
                return
            now = self._clock()
            if self._last is not None and now - self._last < self.cooldown_s:
                return
            self._last = now
            snapshot = self.actions.capture()
            meta = {
                "device": device,
                "alloc_size": alloc_size,
                "device_total": device_total,
                "device_free": device_free,
            }
            writer = threading.Thread(
                target=self._write,
                args=(snapshot, device, meta),
                name="gpumem-oom-writer",
                daemon=False,
            )
            writer.start()
        except Exception as exc:  # never let the observer turn an OOM into something else
            log.error("OOM capture failed: %s: %s", type(exc).__name__, exc)

    def _write(self, snapshot: Any, device: int, meta: dict[str, Any]) -> None:
        try:
            meta["process"] = self.actions.process
            info = self.actions.store.write(snapshot, "oom", device=device, meta=meta)
            self.actions.count_snapshot("oom")
            log.warning(
                "OOM on cuda:%d (asked %d bytes, %d free): snapshot %s",
                device,
                meta["alloc_size"],
                meta["device_free"],
                info.filename,
            )
        except Exception as exc:
            log.error("writing the OOM snapshot failed: %s: %s", type(exc).__name__, exc)
