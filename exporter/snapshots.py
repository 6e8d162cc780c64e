"""Where allocator snapshots live: atomic writes, server-made ids, retention by count and bytes.

Files are plain pickles (what `torch.cuda._memory_viz` and pytorch.org/memory_viz load), named
with host, pod, pid, rank, device and time so that a file copied off the pod still says where
it came from. Ids are made here and looked up in an index; no path is ever built from a
caller's input.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from exporter import atomic

ID_PATTERN = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}$")
SUFFIX = ".pickle"


@dataclass
class SnapshotInfo:
    id: str
    trigger: str  # api, record, oom, remediation
    created: float
    status: str = "ready"  # "recording" until a windowed capture is written
    size_bytes: int = 0
    filename: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def public(self) -> dict[str, Any]:
        data = asdict(self)
        data["url"] = f"/snapshots/{self.id}"
        return data


def new_id() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(4)}"


def _name_part(value: str) -> str:
    """Keep file names portable whatever the pod or host is called."""
    return re.sub(r"[^A-Za-z0-9.-]+", "-", value)[:63] or "x"


class SnapshotStore:
    def __init__(
        self, directory: str | os.PathLike[str], *, max_count: int = 20, max_bytes: int = 2 << 30
    ) -> None:
        self.directory = Path(directory)
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._index: dict[str, SnapshotInfo] = {}
        self._load_index()

    # -- index ---------------------------------------------------------------------------

    def _load_index(self) -> None:
        """Pick up snapshots written before a restart (their sidecar .json holds the info)."""
        if not self.directory.is_dir():
            return
        for meta_file in self.directory.glob("*.json"):
            try:
                info = SnapshotInfo(**json.loads(meta_file.read_text()))
            except (OSError, ValueError, TypeError):
                continue
            if ID_PATTERN.match(info.id) and (self.directory / info.filename).is_file():
                with self._lock:
                    self._index.setdefault(info.id, info)

    def list(self) -> list[SnapshotInfo]:
        self._load_index()  # other processes of the server write here too (gpumem-exporter run)
        with self._lock:
            return sorted(self._index.values(), key=lambda i: i.created, reverse=True)

    def get(self, snapshot_id: str) -> SnapshotInfo | None:
        if not ID_PATTERN.match(snapshot_id):
            return None
        if snapshot_id not in self._index:
            self._load_index()
        with self._lock:
            return self._index.get(snapshot_id)

    def path(self, info: SnapshotInfo) -> Path:
        return self.directory / info.filename

    # -- writing -------------------------------------------------------------------------

    def reserve(self, trigger: str, meta: dict[str, Any] | None = None) -> SnapshotInfo:
        """Register a capture that is still recording, so it shows in the list."""
        info = SnapshotInfo(
            id=new_id(),
            trigger=trigger,
            created=time.time(),
            status="recording",
            meta=dict(meta or {}),
        )
        with self._lock:
            self._index[info.id] = info
        return info

    def discard(self, info: SnapshotInfo) -> None:
        with self._lock:
            self._index.pop(info.id, None)

    def write(
        self,
        snapshot: Any,
        trigger: str,
        *,
        device: int | None = None,
        meta: dict[str, Any] | None = None,
        info: SnapshotInfo | None = None,
    ) -> SnapshotInfo:
        """Pickle `snapshot` to a temp file, fsync, rename; then apply retention."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = info or SnapshotInfo(id=new_id(), trigger=trigger, created=time.time())
        info.meta.update(meta or {})
        parts = [
            socket.gethostname(),
            os.environ.get("POD_NAME", ""),
            f"pid{os.getpid()}",
            f"rank{os.environ['RANK']}" if os.environ.get("RANK") else "",
            f"cuda{device}" if device is not None else "",
            info.id,
            trigger,
        ]
        info.filename = "_".join(_name_part(p) for p in parts if p) + SUFFIX
        final = atomic.write_bytes(
            self.directory / info.filename, pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL)
        )
        info.size_bytes = final.stat().st_size
        info.status = "ready"
        self._write_meta(info)
        with self._lock:
            self._index[info.id] = info
        self._retain()
        return info

    def _write_meta(self, info: SnapshotInfo) -> None:
        atomic.write_bytes(
            self.directory / (info.filename + ".json"), json.dumps(asdict(info)).encode()
        )

    def delete(self, snapshot_id: str) -> bool:
        with self._lock:
            info = self._index.get(snapshot_id) if ID_PATTERN.match(snapshot_id) else None
            if info is None or info.status != "ready":
                return False
            del self._index[snapshot_id]
        self._remove_files(info)
        return True

    def _remove_files(self, info: SnapshotInfo) -> None:
        for name in (info.filename, info.filename + ".json"):
            (self.directory / name).unlink(missing_ok=True)

    def _retain(self) -> None:
        """Drop the oldest ready snapshots beyond max_count or max_bytes (the newest stays)."""
        with self._lock:
            ready = sorted(
                (i for i in self._index.values() if i.status == "ready"),
                key=lambda i: i.created,
                reverse=True,
            )
            keep: list[SnapshotInfo] = []
            dropped: list[SnapshotInfo] = []
            total = 0
            for info in ready:
                if keep and (
                    len(keep) >= self.max_count or total + info.size_bytes > self.max_bytes
                ):
                    dropped.append(info)
                    continue
                keep.append(info)
                total += info.size_bytes
            for info in dropped:
                del self._index[info.id]
        for info in dropped:
            self._remove_files(info)
