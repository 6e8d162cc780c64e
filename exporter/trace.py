"""Trace files: a recording of samples that `demo --trace FILE` replays.

Format: gzip-compressed JSON lines. The first line is a header
`{"format": "gpumem-trace", "version": 1, "meta": {...}}`, every further line one sample as
`Sample.to_dict()` gives it. A recording is written to a temporary file next to the target and
renamed into place when it closes, so a reader never sees half a trace under the final name.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

from exporter.sample import Sample

FORMAT = "gpumem-trace"
VERSION = 1


class TraceError(ValueError):
    """The file is not a readable trace; the message says why, in one line."""


class TraceWriter:
    """A sampler listener that appends each sample; `close()` publishes the file atomically."""

    def __init__(self, path: str | os.PathLike[str], meta: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.count = 0
        self._lock = threading.Lock()
        fd, tmp = tempfile.mkstemp(
            prefix=f".{self.path.name}.", suffix=".partial", dir=self.path.parent or "."
        )
        self._tmp = Path(tmp)
        self._raw: IO[bytes] | None = os.fdopen(fd, "wb")
        self._file: gzip.GzipFile | None = gzip.GzipFile(fileobj=self._raw, mode="wb")
        header = {"format": FORMAT, "version": VERSION, "meta": meta or {}}
        self._write(header)

    def _write(self, obj: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")

    def __call__(self, sample: Sample) -> None:
        with self._lock:
            if self._file is None:
                return
            self._write(sample.to_dict())
            self.count += 1

    def close(self) -> Path:
        with self._lock:
            if self._file is None or self._raw is None:
                return self.path
            self._file.close()
            self._raw.flush()
            os.fsync(self._raw.fileno())
            self._raw.close()
            self._file = self._raw = None
            os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        with self._lock:
            if self._file is not None and self._raw is not None:
                self._file.close()
                self._raw.close()
                self._file = self._raw = None
            self._tmp.unlink(missing_ok=True)


def read_trace(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[Sample]]:
    """Load a trace: (meta, samples in time order). Raises TraceError with a clear reason."""
    path = Path(path)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise TraceError(f"trace file not found: {path}") from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path} is not a gzip trace file: {exc}") from None
    if not lines:
        raise TraceError(f"{path} is empty")
    try:
        header = json.loads(lines[0])
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise TraceError(f"{path} is not a {FORMAT} file")
        if header.get("version") != VERSION:
            raise TraceError(f"{path}: unsupported trace version {header.get('version')}")
        samples = [Sample.from_dict(json.loads(line)) for line in lines[1:] if line.strip()]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, TraceError):
            raise
        raise TraceError(f"{path}: malformed trace: {exc}") from None
    if not samples:
        raise TraceError(f"{path} holds no samples")
    samples.sort(key=lambda s: s.timestamp)
    return header.get("meta", {}), samples
