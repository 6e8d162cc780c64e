"""Trace files: a recording of samples that `demo --trace FILE` replays.

Format: gzip-compressed JSON lines. The first line is a header
`{"format": "gpumem-trace", "version": 1, "meta": {...}}`, every further line one sample as
`Sample.to_dict()` gives it, timestamps strictly increasing. The lines come from the readings'
declarations (exporter.sample.Readings): a part added there is written and read with no change
here, and a reader ignores parts it does not know and keeps the defaults of parts a line
lacks, so older and newer writers of one version read alike. A change that an older reader
would misread raises VERSION and adds an upgrade of the older lines to UPGRADES: every trace
ever written (the packaged demo, the captures under tests/data) keeps loading.

A writer publishes the file in one of two ways. By default it writes to a temporary file next
to the target and renames it into place when it closes, so a reader never sees half a trace
under the final name. A `live` writer (`gpumem-exporter record`) renames it into place at the
first sample and flushes every sample after, so that whatever ends the recording (the target
dying, the recorder killed) leaves a loadable trace of every sample taken so far: the reader
accepts a gzip stream cut off before its end and drops a last line cut off mid-write.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import logging
import math
import os
import tempfile
import threading
import time
import types
import typing
import zlib
from pathlib import Path
from typing import IO, Any

from exporter import atomic
from exporter.sample import Sample

FORMAT = "gpumem-trace"
VERSION = 1
# Older versions this reader takes: version -> its sample line as this version's.
UPGRADES: dict[int, typing.Callable[[dict[str, Any]], dict[str, Any]]] = {}

log = logging.getLogger(__name__)


class TraceError(ValueError):
    """The file is not a readable trace; the message says why, in one line."""


class TraceWriter:
    """A sampler listener that appends each sample; `close()` publishes the file atomically,
    or the first sample does for a `live` writer (see the module's docstring).

    Timestamps in a trace strictly increase (the replay needs it, `read_trace` insists): a
    sample whose clock went backwards (a wall-clock step) is written at the previous timestamp
    plus the time that has really passed since it, on the monotonic clock.

    `private` (the default) keeps the file this user's alone (0600); `private=False` gives it
    the mode `> FILE` would (atomic.user_file_mode), for `record -o FILE`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        meta: dict[str, Any] | None = None,
        *,
        live: bool = False,
        private: bool = True,
    ) -> None:
        self.path = Path(path)
        self.count = 0
        self._live = live
        self._published = False
        self._last: tuple[float, float] | None = None  # (timestamp, monotonic) of the last
        self._lock = threading.Lock()
        fd, tmp = tempfile.mkstemp(
            prefix=f".{self.path.name}.", suffix=".partial", dir=self.path.parent or "."
        )
        self._tmp = Path(tmp)
        if not private:
            os.fchmod(fd, atomic.user_file_mode(self.path))
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
            record = sample.to_dict()
            now = time.monotonic()
            if self._last is not None and not record["timestamp"] > self._last[0]:
                record["timestamp"] = self._last[0] + max(now - self._last[1], 1e-6)
            elif not math.isfinite(record["timestamp"]):
                record["timestamp"] = time.time()
            self._write(record)
            self._last = (record["timestamp"], now)
            self.count += 1
            if self._live:
                # A sync flush ends a deflate block: every line so far decodes from the file.
                self._file.flush()
                if not self._published:
                    os.replace(self._tmp, self.path)  # the open file now has the final name
                    self._published = True

    def close(self) -> Path:
        with self._lock:
            if self._file is None or self._raw is None:
                return self.path
            self._file.close()
            self._raw.flush()
            os.fsync(self._raw.fileno())
            self._raw.close()
            self._file = self._raw = None
            if not self._published:
                os.replace(self._tmp, self.path)
                self._published = True
        return self.path

    def abort(self) -> None:
        """Stop writing and remove the recording (published or not)."""
        with self._lock:
            if self._file is not None and self._raw is not None:
                self._file.close()
                self._raw.close()
                self._file = self._raw = None
            (self.path if self._published else self._tmp).unlink(missing_ok=True)


def read_trace(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[Sample]]:
    """Load a trace: (meta, samples in time order). Raises TraceError with a clear reason.

    Every sample is checked before anything replays it: a JSON object, each field of the
    type the exporter writes, numbers finite, timestamps strictly increasing; the error
    names the line. A trace whose writer was cut off (a live recording) loads up to its last
    complete line.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TraceError(f"trace file not found: {path}") from None
    except OSError as exc:
        raise TraceError(f"cannot read trace file {path}: {exc.strerror}") from None
    try:
        text, cut_off = _gunzip(data)
    except zlib.error as exc:
        raise TraceError(f"{path} is not a gzip trace file: {exc}") from None
    except _TooLarge:
        raise TraceError(
            f"{path} decompresses to more than {MAX_TRACE_BYTES >> 20} MiB: not a trace"
        ) from None
    lines = text.split(b"\n")
    if cut_off:
        lines.pop()  # the line being written when the writer stopped (b"" if it was complete)
    if not any(line.strip() for line in lines):
        raise TraceError(f"{path} is empty")
    header = _json_line(path, 1, lines[0])
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TraceError(f"{path} is not a {FORMAT} file")
    version = header.get("version")
    if version != VERSION and version not in UPGRADES:
        newer = isinstance(version, int) and version > VERSION
        why = ": written by a newer gpumem-exporter" if newer else ""
        raise TraceError(f"{path}: unsupported trace version {version}{why}")
    upgrade = UPGRADES.get(version) if isinstance(version, int) else None
    meta = header.get("meta", {})
    if not isinstance(meta, dict):
        raise TraceError(f"{path}: malformed trace at line 1: meta is not an object")
    samples: list[Sample] = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        data_line = _json_line(path, number, line)
        if upgrade is not None and isinstance(data_line, dict):
            data_line = upgrade(data_line)
        problem = _sample_problem(data_line)
        if problem is None and samples and not data_line["timestamp"] > samples[-1].timestamp:
            problem = (
                f"timestamp {data_line['timestamp']} is not after the previous sample's "
                f"({samples[-1].timestamp})"
            )
        if problem is not None:
            raise TraceError(f"{path}: malformed trace at line {number}: {problem}")
        samples.append(Sample.from_dict(data_line))
    if not samples:
        raise TraceError(f"{path} holds no samples")
    if cut_off:
        log.warning(
            "trace %s ends mid-write (its recording was cut off or is still running): "
            "read the %d samples before that",
            path,
            len(samples),
        )
    return meta, samples


# The most a trace may decompress to: hours of samples at 1 Hz are tens of MiB. Past it the
# file is not a trace (a gzip bomb: a few MiB that would fill memory), and it says so.
MAX_TRACE_BYTES = 1 << 30


class _TooLarge(ValueError):
    pass


def _gunzip(data: bytes) -> tuple[bytes, bool]:
    """Every gzip member's content, and whether the last was cut off before its end (a live
    recording, or its writer killed): then the content is what was written so far.
    _TooLarge past MAX_TRACE_BYTES."""
    parts, total = [], 0
    while data:
        member = zlib.decompressobj(wbits=31)
        part = member.decompress(data, MAX_TRACE_BYTES - total + 1)
        total += len(part)
        if total > MAX_TRACE_BYTES:
            raise _TooLarge
        parts.append(part)
        if not member.eof:
            return b"".join(parts), True
        data = member.unused_data.lstrip(b"\0")  # gzip allows zero padding after a member
    return b"".join(parts), False


def _json_line(path: Path, number: int, line: bytes) -> Any:
    try:
        return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: malformed trace at line {number}: {exc}") from None


def _sample_problem(data: Any) -> str | None:
    """What is wrong with one decoded sample line, or None."""
    if not isinstance(data, dict):
        return f"expected a sample object, got {_show(data)}"
    # Keys this version does not know are left for newer writers, as Sample.from_dict does.
    return _fields_problem(data, Sample, "", ignore_unknown=True)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields_problem(
    data: Any, cls: type, where: str, *, ignore_unknown: bool = False
) -> str | None:
    if not isinstance(data, dict):
        return f"{where or 'sample'}: expected an object, got {_show(data)}"
    hints = _hints(cls)
    for field in dataclasses.fields(cls):
        name = f"{where}.{field.name}" if where else field.name
        if field.name not in data:
            required = (
                field.default is dataclasses.MISSING
                and field.default_factory is dataclasses.MISSING
            )
            if required:
                return f"{name} is missing"
            continue
        problem = _value_problem(data[field.name], hints[field.name], name)
        if problem is not None:
            return problem
    if not ignore_unknown:
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            return f"{where}: unknown field {unknown[0]!r}"
    return None


def _value_problem(value: Any, hint: Any, where: str) -> str | None:
    """Why `value` (decoded JSON) does not fit the type hint of its field, or None."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):  # the sample types use only `X | None`
        if value is None and type(None) in args:
            return None
        return _value_problem(value, next(a for a in args if a is not type(None)), where)
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"{where}: expected a number, got {_show(value)}"
        return None if math.isfinite(value) else f"{where} is {_show(value)}, not a finite number"
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else f"{where}: expected an integer, got {_show(value)}"
    if hint is bool:
        return None if isinstance(value, bool) else f"{where}: expected true or false"
    if hint is str:
        return None if isinstance(value, str) else f"{where}: expected a string, got {_show(value)}"
    if origin is list:
        if not isinstance(value, list):
            return f"{where}: expected a list, got {_show(value)}"
        for index, item in enumerate(value):
            problem = _value_problem(item, args[0], f"{where}[{index}]")
            if problem is not None:
                return problem
        return None
    if origin is dict:
        if not isinstance(value, dict):
            return f"{where}: expected an object, got {_show(value)}"
        for key, item in value.items():  # JSON object keys are always strings
            problem = _value_problem(item, args[1], f"{where}.{key}")
            if problem is not None:
                return problem
        return None
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _fields_problem(value, hint, where)
    raise TypeError(f"no check for field type {hint!r}")  # a new field type: add its check


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
