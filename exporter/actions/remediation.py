"""Optional automatic remediation (off by default): acts on in-process alerts.

- Allocation retries while fragmentation is high on the same device: empty_cache, at most once
  per cooldown. It returns fully free segments to the driver; it cannot mend split segments,
  so it helps the next large allocation and costs a synchronisation.
- The first OOM: an allocator snapshot, to see afterwards what held the memory.

Actions run on a worker thread of their own: empty_cache can wait seconds for queued GPU work,
which must stall neither the sampler nor the thread that reported the alert.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from exporter.actions.errors import ActionFailed
from exporter.detectors import AlertEvent, Detectors

log = logging.getLogger("exporter.remediation")


class RemediationActions(Protocol):
    """What remediation needs of the process's actions (LocalActions has it)."""

    def empty_cache_now(self, device: int | None = None, trigger: str = "api") -> Any: ...

    def write_snapshot(self, trigger: str = "api") -> Any: ...


class Remediation:
    """An `on_alert` listener that queues actions for its worker thread."""

    def __init__(
        self,
        actions: RemediationActions,
        detectors: Detectors,
        *,
        cooldown_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.actions = actions
        self.detectors = detectors
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._last_empty_cache: float | None = None
        self._snapshotted_oom = False
        self.counts: Counter[tuple[str, str]] = Counter()  # (action, outcome) -> count
        self._queue: queue.Queue[str] = queue.Queue(maxsize=8)
        self._worker = threading.Thread(target=self._run, name="gpumem-remediation", daemon=True)
        self._worker.start()
        self.__name__ = "remediation"

    def __call__(self, event: AlertEvent) -> None:
        if event.state != "firing":
            return
        if event.alert == "GpuMemAllocRetries" and self.detectors.is_firing(
            "GpuMemFragmentationHigh", event.labels
        ):
            now = self._clock()
            if (
                self._last_empty_cache is not None
                and now - self._last_empty_cache < self.cooldown_s
            ):
                self._count("empty_cache", "cooldown")
                return
            self._last_empty_cache = now
            self._submit("empty_cache")
        elif event.alert == "GpuMemOutOfMemory" and not self._snapshotted_oom:
            self._snapshotted_oom = True
            self._submit("snapshot")

    def _submit(self, action: str) -> None:
        try:
            self._queue.put_nowait(action)
        except queue.Full:
            self._count(action, "dropped")

    def _count(self, action: str, outcome: str) -> None:
        self.counts[(action, outcome)] += 1
        log.warning("remediation %s: %s", action, outcome)

    def _run(self) -> None:
        while True:
            action = self._queue.get()
            try:
                if action == "empty_cache":
                    result = self.actions.empty_cache_now(trigger="remediation")
                    log.warning(
                        "remediation empty_cache released %d bytes in %.3f s",
                        result.released_bytes,
                        result.duration_s,
                    )
                else:
                    info = self.actions.write_snapshot("remediation")
                    log.warning("remediation snapshot after OOM: %s", info.filename)
                self.counts[(action, "ok")] += 1
            except ActionFailed as exc:
                log.warning("remediation %s not possible here: %s", action, exc)
                self.counts[(action, "unavailable")] += 1
            except Exception as exc:
                log.error("remediation %s failed: %s: %s", action, type(exc).__name__, exc)
                self.counts[(action, "error")] += 1
            finally:
                self._queue.task_done()

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Block until queued actions ran (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True
