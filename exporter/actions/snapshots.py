"""Where allocator snapshots live: atomic writes, server-made ids, retention by count and bytes.

Files are plain pickles (what `torch.cuda._memory_viz` and pytorch.org/memory_viz load), named
with host, pod, pid, rank, device and time so that a file copied off the pod still says where
it came from. Ids are made here and looked up in an index; no path is ever built from a
caller's input.

Under `gpumem-exporter run` every process of the server writes into one folder and the
launcher lists it: each entry's sidecar `.json` is written when a capture starts (status
`recording`, with the writer's pid), again when it is ready or failed, so that the pod's
listing shows captures running in other processes, and one whose process died meanwhile reads
as failed.
"""

from __future__ import annotations

import contextlib
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
from typing import TYPE_CHECKING, Any

from exporter import atomic

if TYPE_CHECKING:
    from exporter.config import Config

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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


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

    @classmethod
    def for_config(cls, config: Config) -> SnapshotStore:
        return cls(
            config.snapshot_directory,
            max_count=config.snapshot_max_count,
            max_bytes=config.snapshot_max_bytes,
        )

    # -- index ---------------------------------------------------------------------------

    def _read_meta(self, meta_file: Path) -> SnapshotInfo | None:
        try:
            info = SnapshotInfo(**json.loads(meta_file.read_text()))
        except (OSError, ValueError, TypeError):
            return None
        if not ID_PATTERN.match(info.id):
            return None
        if info.status == "ready":
            return info if (self.directory / info.filename).is_file() else None
        writer = info.meta.get("writer_pid")
        if info.status == "recording" and isinstance(writer, int) and not _alive(writer):
            info.status = "failed"
            info.meta["error"] = f"process {writer} exited while recording"
        return info

    def _load_index(self) -> None:
        """Pick up snapshots written before a restart or by other processes of the server
        (their sidecar .json holds the info); entries still recording are re-read."""
        if not self.directory.is_dir():
            return
        with self._lock:  # removed by another process's retention or DELETE
            for gone in [
                i
                for i in self._index.values()
                if i.status == "ready" and not (self.directory / i.filename).is_file()
            ]:
                del self._index[gone.id]
        for meta_file in self.directory.glob("*.json"):
            info = self._read_meta(meta_file)
            if info is None:
                continue
            with self._lock:
                current = self._index.get(info.id)
                if current is None or current.status != "ready":
                    self._index[info.id] = info

    def list(self) -> list[SnapshotInfo]:
        self._load_index()  # other processes of the server write here too (gpumem-exporter run)
        with self._lock:
            return sorted(self._index.values(), key=lambda i: i.created, reverse=True)

    def get(self, snapshot_id: str) -> SnapshotInfo | None:
        if not ID_PATTERN.match(snapshot_id):
            return None
        known = self._index.get(snapshot_id)
        if known is None or known.status != "ready":
            self._load_index()
        with self._lock:
            return self._index.get(snapshot_id)

    def path(self, info: SnapshotInfo) -> Path:
        return self.directory / info.filename

    # -- writing -------------------------------------------------------------------------

    def reserve(self, trigger: str, meta: dict[str, Any] | None = None) -> SnapshotInfo:
        """Register a capture that is still recording, so it shows in the list (of this
        process, and of the pod: its sidecar is written now)."""
        info = SnapshotInfo(
            id=new_id(),
            trigger=trigger,
            created=time.time(),
            status="recording",
            meta={**(meta or {}), "writer_pid": os.getpid()},
        )
        info.filename = self._filename(info, None)
        with self._lock:
            self._index[info.id] = info
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._write_meta(info)
        return info

    def fail(self, info: SnapshotInfo, reason: str) -> None:
        """Mark a reserved capture failed, with the reason, for every reader."""
        info.status = "failed"
        info.meta["error"] = reason
        with contextlib.suppress(OSError):  # the in-memory entry still says why
            self._write_meta(info)

    def discard(self, info: SnapshotInfo) -> None:
        with self._lock:
            self._index.pop(info.id, None)
        (self.directory / (info.filename + ".json")).unlink(missing_ok=True)

    def _filename(self, info: SnapshotInfo, device: int | None) -> str:
        parts = [
            socket.gethostname(),
            os.environ.get("POD_NAME", ""),
            f"pid{os.getpid()}",
            f"rank{os.environ['RANK']}" if os.environ.get("RANK") else "",
            f"cuda{device}" if device is not None else "",
            info.id,
            info.trigger,
        ]
        return "_".join(_name_part(p) for p in parts if p) + SUFFIX

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
        info.meta.pop("writer_pid", None)
        info.filename = info.filename or self._filename(info, device)
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
