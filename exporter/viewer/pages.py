"""Rendered snapshot pages, kept: rendering holds the GIL (0.3 s for the demo, seconds for huge
snapshots), which an embedded exporter must not repeat each time a page is viewed."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from exporter.viewer.load import load_snapshot
from exporter.viewer.render import render_html

KEPT = 4  # pages kept, the oldest dropped first


class RenderedPages:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pages: dict[str, str] = {}  # key -> rendered page, oldest first

    def page(self, key: str, path: str | Path, *, title: str, meta: dict[str, Any]) -> str:
        """The page of the snapshot at `path`, rendered once per `key`; SnapshotError where
        it is no snapshot or is over the viewer's limits."""
        with self._lock:
            if key in self._pages:
                return self._pages[key]
        page = render_html(load_snapshot(path), title=title, meta=meta)
        with self._lock:
            self._pages[key] = page
            while len(self._pages) > KEPT:
                self._pages.pop(next(iter(self._pages)))
        return page
