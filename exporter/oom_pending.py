"""OOMs the allocator has counted and its OOM observer has not judged yet.

The count moves at the OOM; the verdict comes when the observer, on the OOM-ing thread, has
taken its readings (and a snapshot: seconds with memory history on). Meanwhile the page and
`why` would explain the previous OOM, or nothing: this says "verdict pending" from the moment
the count moves. Kept per process and device from the samples (a sampler listener), so it
works the same on live readings and on a replayed recording.

OOMs counted before the observer was armed never get a verdict: the unjudged count first seen
is the baseline. And a count that no verdict follows within PENDING_MAX_S (an observer that
is not armed, an agent of an older version) is no longer called pending.
"""

from __future__ import annotations

import threading
from typing import Any

from exporter.sample import Sample

PENDING_MAX_S = 60.0


class PendingOoms:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._baseline: dict[tuple[int | None, int], int] = {}  # unjudged OOMs first seen
        self._since: dict[tuple[int | None, int], float] = {}  # when the count moved
        self._rows: list[dict[str, Any]] = []

    def __call__(self, sample: Sample) -> None:
        rows = []
        for reading in sample.allocators:
            ooms = reading.counters.get("ooms")
            if ooms is None:
                continue
            key = (sample.allocator_pid(reading), reading.device)
            unjudged = ooms - sum(reading.ooms_by_verdict.values())
            baseline = self._baseline.get(key)
            if baseline is None or unjudged < baseline:  # first seen, or the count restarted
                self._baseline[key] = baseline = unjudged
            if unjudged <= baseline:
                self._since.pop(key, None)
                continue
            since = self._since.setdefault(key, sample.timestamp)
            if sample.timestamp - since > PENDING_MAX_S:
                continue
            rows.append(
                {
                    "pid": key[0],
                    "rank": reading.process.get("rank", ""),
                    "role": reading.process.get("role", ""),
                    "device": reading.device,
                    "gpu_uuid": reading.gpu_uuid,
                    "since": since,
                    "count": unjudged - baseline,
                }
            )
        with self._lock:
            self._rows = rows

    def rows(self) -> list[dict[str, Any]]:
        """One per process and device with OOMs awaiting their verdict, newest first."""
        with self._lock:
            return sorted(self._rows, key=lambda row: -row["since"])
