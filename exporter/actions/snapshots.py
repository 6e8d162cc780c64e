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

The folder is this user's alone (exporter.config.private_folder_problem), and the index only
trusts what the store itself would have written: a sidecar names a plain file of the store's
pattern, with the right field types, and its data is a regular file. Anything else is skipped
with one warning, so that nothing is served or deleted outside the folder. A store starting up
settles what a killed writer left (temp files, unindexed data, dead `recording` entries); a
folder that cannot take a file answers 507 with the reason and keeps nothing half-written
(docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import re
import secrets
import socket
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporter import atomic
from exporter.actions.errors import ActionInsufficientStorage
from exporter.config import ConfigError, make_private_folder, private_folder_problem
from exporter.identity import pod_name, process_labels

if TYPE_CHECKING:
    from exporter.config import Config

log = logging.getLogger("exporter.snapshots")

ID_PATTERN = re.compile(r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}")  # fullmatch: "$" allows a "\n"
SUFFIX = ".pickle"
# The names _filename makes: _name_part()s joined by "_", the id and the trigger last. A plain
# name in the folder: no "/", never "." or ".." or hidden (temp files start with ".").
FILENAME_PATTERN = re.compile(
    r"[A-Za-z0-9-][A-Za-z0-9._-]*_(?P<id>[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8})_(?P<trigger>[A-Za-z0-9.-]+)"
    + re.escape(SUFFIX)
)
STATUSES = ("ready", "recording", "failed")
MAX_SIDECAR_BYTES = 64 << 10


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
    """Keep file names portable whatever the pod or host is called (never hidden: a name
    starting with a dot is a temp file's)."""
    return re.sub(r"[^A-Za-z0-9.-]+", "-", value)[:63].lstrip(".") or "x"


def _finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _entry(sidecar_name: str, data: Any) -> SnapshotInfo:
    """The entry a sidecar holds, if the store could have written it; ValueError says why not.

    Paths come from server-made names only: the data file must be a plain name of the store's
    pattern for this very id, and the sidecar must be named after it."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    try:
        info = SnapshotInfo(**data)
    except TypeError:
        raise ValueError("unknown or missing fields") from None
    named = FILENAME_PATTERN.fullmatch(info.filename) if isinstance(info.filename, str) else None
    # The id must be the one in the name, so it is a server-made id too.
    if named is None or named["id"] != info.id or sidecar_name != info.filename + ".json":
        raise ValueError("filename is not the store's name for this id and sidecar")
    if info.status not in STATUSES:
        raise ValueError(f"status is not one of {', '.join(STATUSES)}")
    if not isinstance(info.trigger, str) or not isinstance(info.meta, dict):
        raise ValueError("trigger is not a string, or meta not an object")
    if not _finite_number(info.created):
        raise ValueError("created is not a finite number")
    size = info.size_bytes
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError("size_bytes is not a whole number")
    return info


def _read_json(path: Path) -> Any:
    """A sidecar's JSON. Never follows a symlink, never blocks on a FIFO; sidecars are small."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError("not a regular file")
        raw = f.read(MAX_SIDECAR_BYTES + 1)
    if len(raw) > MAX_SIDECAR_BYTES:
        raise ValueError(f"over {MAX_SIDECAR_BYTES} bytes")
    return json.loads(raw)


# A windowed capture blocks every other snapshot of its process until it ends: long enough for
# a few minutes of serving steps; stop_capture ends it early.
MAX_RECORD_S = 300
# How long past its recording time a capture by another PID namespace's writer may take to be
# written before it is taken as abandoned.
OVERDUE_S = 120.0


def _forget_writer(meta: dict[str, Any]) -> None:
    """A capture that is written no longer needs its writer's identity."""
    meta.pop("writer_pid", None)
    meta.pop("writer_pid_namespace", None)


def _writer_gone(info: SnapshotInfo) -> bool:
    """Whether the process that reserved a capture has exited (or is not known). One of
    another PID namespace (another container on this volume) cannot be asked: it is gone
    once its capture is overdue."""
    writer = info.meta.get("writer_pid")
    if not isinstance(writer, int) or writer <= 0:
        return True
    namespace = info.meta.get("writer_pid_namespace")
    if not atomic.same_pid_namespace(namespace if isinstance(namespace, str) else ""):
        record_s = info.meta.get("record_s")
        if not isinstance(record_s, (int, float)) or not 0 < record_s <= MAX_RECORD_S:
            record_s = MAX_RECORD_S
        return time.time() - info.created > record_s + OVERDUE_S
    return not atomic.writer_alive(writer)


class SnapshotStore:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_count: int = 20,
        max_bytes: int = 2 << 30,
        process: dict[str, str] | None = None,
    ) -> None:
        self.directory = Path(directory)
        # Whose snapshots these are, for their file names: this process unless told (the
        # demo names the recorded one).
        self.process = process
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._index: dict[str, SnapshotInfo] = {}
        self._warned: set[str] = set()  # files (and the folder) already warned about
        if self._private():
            self._sweep()
        self._load_index()

    @classmethod
    def for_config(
        cls, config: Config, *, directory: str | None = None, process: dict[str, str] | None = None
    ) -> SnapshotStore:
        return cls(
            directory or config.snapshot_directory,
            max_count=config.snapshot_max_count,
            max_bytes=config.snapshot_max_bytes,
            process=process,
        )

    # -- the folder ----------------------------------------------------------------------

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        """A bad file is met on every listing: one warning per file, not one per request."""
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def _private(self) -> bool:
        """Whether the folder may be read: it exists and is this user's alone. Checked on
        every read, not only at start-up: a folder in a shared temp dir can be removed (by a
        temp cleaner) and made again by someone else."""
        problem = private_folder_problem(self.directory)
        if problem is not None and os.path.lexists(self.directory):
            self._warn_once(f"folder {self.directory}", "%s: its snapshots are ignored", problem)
        return problem is None

    def _writable_folder(self) -> None:
        """Create the folder if missing; refuse one that is not private (507)."""
        try:
            make_private_folder(self.directory)
        except ConfigError as exc:
            raise ActionInsufficientStorage(str(exc)) from None

    @contextlib.contextmanager
    def _storage(self, what: str) -> Iterator[None]:
        """A folder that cannot take a file (full, over quota, read-only, not writable) is a
        507 that says why, not a 500."""
        try:
            yield
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise ActionInsufficientStorage(f"{what}: {reason} (in {self.directory})") from exc

    # -- after a crash -------------------------------------------------------------------

    def _sweep(self) -> None:
        """Settle what writers killed mid-write left, so that the folder holds what the index
        says: temp files of dead writers removed, unindexed snapshots adopted, entries whose
        data is gone dropped, dead writers' captures settled. Under `gpumem-exporter run`
        other live processes write here too: their files are left alone."""
        try:
            names = set(os.listdir(self.directory))
        except OSError:
            return
        for name in sorted(names):
            path = self.directory / name
            try:
                if atomic.is_temp(name):
                    if atomic.abandoned(path):
                        path.unlink()
                elif name.endswith(SUFFIX + ".json"):
                    self._settle(path)
                elif FILENAME_PATTERN.fullmatch(name) and name + ".json" not in names:
                    self._adopt(path)
            except OSError as exc:  # a read-only folder, say: the index still skips it
                log.warning("snapshot folder %s: %s left as is: %s", self.directory, name, exc)

    def _settle(self, sidecar: Path) -> None:
        """One sidecar after a crash: a ready entry without its data is dropped; a capture
        whose writer died while `recording` is ready if its data was written, else failed."""
        info = self._read_entry(sidecar)
        if info is None:
            return  # not one the store wrote: skipped, never removed
        data = self._data_stat(info)
        if info.status == "ready" and data is None:
            sidecar.unlink()
        elif info.status == "recording" and _writer_gone(info):
            if data is not None and stat.S_ISREG(data.st_mode):  # renamed in before the kill
                info.status, info.size_bytes = "ready", data.st_size
                _forget_writer(info.meta)
            else:
                info.status = "failed"
                info.meta["error"] = "the process exited while recording"
            self._write_meta(info)

    def _adopt(self, path: Path) -> None:
        """Index a snapshot whose writer was killed before it wrote the sidecar."""
        named = FILENAME_PATTERN.fullmatch(path.name)
        data = path.lstat()
        sidecar = path.with_name(path.name + ".json")
        if named is None or not stat.S_ISREG(data.st_mode) or os.path.lexists(sidecar):
            return
        info = SnapshotInfo(
            id=named["id"],
            trigger=named["trigger"],
            created=data.st_mtime,
            size_bytes=data.st_size,
            filename=path.name,
            meta={"adopted": "written before a crash; indexed when the exporter started"},
        )
        self._write_meta(info)
        log.info("snapshot %s had no index entry: adopted", path.name)

    # -- index ---------------------------------------------------------------------------

    def _read_entry(self, sidecar: Path) -> SnapshotInfo | None:
        """The entry a sidecar holds, or None: removed meanwhile, or not one the store could
        have written (warned about once)."""
        try:
            return _entry(sidecar.name, _read_json(sidecar))
        except FileNotFoundError:
            return None  # removed by another process of the server meanwhile
        except (OSError, ValueError, RecursionError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else str(exc)
            self._warn_once(
                sidecar.name,
                "snapshot index: skipping %s in %s: %s",
                sidecar.name,
                self.directory,
                reason,
            )
            return None

    def _data_stat(self, info: SnapshotInfo) -> os.stat_result | None:
        """The entry's data file as it is (a symlink is not followed), None if missing."""
        try:
            return os.lstat(self.directory / info.filename)
        except OSError:
            return None

    def _regular(self, info: SnapshotInfo) -> bool:
        data = self._data_stat(info)
        return data is not None and stat.S_ISREG(data.st_mode)

    def _read_meta(self, sidecar: Path) -> SnapshotInfo | None:
        info = self._read_entry(sidecar)
        if info is None:
            return None
        if info.status == "ready":
            data = self._data_stat(info)
            if data is not None and not stat.S_ISREG(data.st_mode):
                self._warn_once(
                    sidecar.name,
                    "snapshot index: skipping %s in %s: its data is not a regular file",
                    sidecar.name,
                    self.directory,
                )
            # Missing: being deleted by another process (a restart drops the sidecar).
            return info if data is not None and stat.S_ISREG(data.st_mode) else None
        if info.status == "recording" and _writer_gone(info):
            info.status = "failed"
            info.meta["error"] = f"process {info.meta.get('writer_pid')} exited while recording"
        return info

    def _load_index(self) -> None:
        """Pick up snapshots written before a restart or by other processes of the server
        (their sidecar .json holds the info); entries still recording are re-read."""
        if not self._private():
            with self._lock:  # nothing in a folder that is not ours alone is served
                self._index.clear()
            return
        with self._lock:  # removed by another process's retention or DELETE
            for gone in [
                i for i in self._index.values() if i.status == "ready" and not self._regular(i)
            ]:
                del self._index[gone.id]
        for sidecar in self.directory.glob("*.json"):
            info = self._read_meta(sidecar)
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
        if not ID_PATTERN.fullmatch(snapshot_id):
            return None
        known = self._index.get(snapshot_id)
        if known is None or known.status != "ready" or not self._regular(known):
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
            meta={
                **(meta or {}),
                "writer_pid": os.getpid(),
                "writer_pid_namespace": atomic.pid_namespace(),
            },
        )
        info.filename = self._filename(info, None)
        with self._storage("capture not started"):
            self._writable_folder()
            self._write_meta(info)
        with self._lock:
            self._index[info.id] = info
        return info

    def fail(self, info: SnapshotInfo, reason: str) -> None:
        """Mark a reserved capture failed, with the reason, for every reader."""
        info.status = "failed"
        info.meta["error"] = reason
        with contextlib.suppress(OSError):  # the in-memory entry still says why
            self._write_meta(info)

    def discard(self, info: SnapshotInfo) -> None:
        """Forget a failed capture (its sidecar); OSError leaves it listed."""
        with self._lock:
            (self.directory / (info.filename + ".json")).unlink(missing_ok=True)
            self._index.pop(info.id, None)

    def _filename(self, info: SnapshotInfo, device: int | None) -> str:
        process = self.process or process_labels()
        rank = process.get("rank", "")
        parts = [
            socket.gethostname(),
            pod_name(),
            f"pid{process.get('pid') or os.getpid()}",
            f"rank{rank}" if rank else "",
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
        """Pickle `snapshot` to a temp file, fsync, rename; then its sidecar, then retention.
        A folder that cannot take both answers 507 and keeps neither."""
        payload = pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL)
        info = info or SnapshotInfo(id=new_id(), trigger=trigger, created=time.time())
        info.meta.update(meta or {})
        _forget_writer(info.meta)
        info.filename = info.filename or self._filename(info, device)
        with self._storage("snapshot not written"):
            self._writable_folder()
            data = atomic.write_bytes(self.directory / info.filename, payload)
            info.size_bytes = len(payload)
            info.status = "ready"
            try:
                self._write_meta(info)
            except OSError:
                data.unlink(missing_ok=True)  # no index entry would ever name it
                raise
        with self._lock:
            self._index[info.id] = info
        self._retain()
        return info

    def _write_meta(self, info: SnapshotInfo) -> None:
        atomic.write_bytes(
            self.directory / (info.filename + ".json"), json.dumps(asdict(info)).encode()
        )

    def delete(self, snapshot_id: str) -> bool:
        """Remove a ready snapshot; False if there is none. OSError (a read-only or foreign
        folder) leaves it listed and on disk as it was: the index never names data that is
        gone, nor forgets data that is there."""
        with self._lock:
            info = self._index.get(snapshot_id) if ID_PATTERN.fullmatch(snapshot_id) else None
            if info is None or info.status != "ready":
                return False
            self._remove(info)
        return True

    def _remove(self, info: SnapshotInfo) -> None:
        """Remove an entry, with self._lock held. The data first: OSError there (a read-only
        folder) leaves everything as it was. Then the entry, then its sidecar: a sidecar left
        without data (a crash, or that unlink failing too) is dropped at the next start,
        whereas data without a sidecar would be adopted again."""
        (self.directory / info.filename).unlink(missing_ok=True)
        self._index.pop(info.id, None)
        with contextlib.suppress(OSError):
            (self.directory / (info.filename + ".json")).unlink(missing_ok=True)

    def _retain(self) -> None:
        """Drop the oldest entries beyond max_count or max_bytes (the newest stays). Every
        entry of the folder counts: other processes' too, and failed captures (a sidecar
        each, which would pile up otherwise); one still recording is never dropped."""
        self._load_index()
        with self._lock:
            settled = sorted(
                (i for i in self._index.values() if i.status != "recording"),
                key=lambda i: i.created,
                reverse=True,
            )
            keep: list[SnapshotInfo] = []
            dropped: list[SnapshotInfo] = []
            total = 0
            for info in settled:
                if keep and (
                    len(keep) >= self.max_count or total + info.size_bytes > self.max_bytes
                ):
                    dropped.append(info)
                    continue
                keep.append(info)
                total += info.size_bytes
            for info in dropped:
                self._remove(info)
