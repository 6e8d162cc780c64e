"""The exporter's own count of admin requests, by action and outcome.

The HTTP layer counts (exporter.http.admin) and /metrics reads (exporter.metrics,
gpumem_exporter_admin_requests_total): the counter lives below both, so that rendering
/metrics reads a plain value and never reaches into the HTTP layer's state. Requests are
counted on the server's event loop while /metrics renders on another thread: a lock keeps a
reading whole, and `changes` (one integer) tells the exposition cache whether anything moved.
"""

from __future__ import annotations

import threading
from collections import Counter


class RequestCounts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()
        self.changes = 0  # bumped on every count

    def add(self, action: str, outcome: str) -> None:
        with self._lock:
            self._counts[(action, outcome)] += 1
            self.changes += 1

    def read(self) -> dict[tuple[str, str], int]:
        """(action, outcome) -> requests so far."""
        with self._lock:
            return dict(self._counts)
