"""Publish the exporter's series through prometheus_client's multiprocess mode.

A server that sets PROMETHEUS_MULTIPROC_DIR serves /metrics from a fresh registry holding only
a MultiProcessCollector (vLLM, gunicorn and uvicorn apps with several workers). That collector
reads the `*.db` files of the folder, which prometheus_client's Counter, Gauge and Histogram
write; a custom collector such as ours never reaches it. So on every sample the bridge renders
what SampleCollector serves (one list of families for both paths) into files of that format:

- Gauges go to a `liveall` gauge file: MultiProcessCollector labels each value with the `pid`
  in the file's name and keeps the processes apart. Summing or max-ing modes would add up one
  process's allocator to another's, or hide one. Info families go as their `_info` gauge, as
  the text format shows them.
- A gauge that already names a process in a `pid` label of its own (NVML's list of processes
  on a GPU, which every process of the server reads the same) is filed under that pid: the
  reader sets `pid` from the file name, and the copies of each process merge into one series.
- Counters go to a counter file with a `pid` label of their own: MultiProcessCollector sums
  counter files by label set, and the label keeps each process's monotonic count apart.

prometheus_client names its files `gauge_liveall_<pid>.db` and `counter_<pid>.db`; ours add
`_gpumem-exporter-<writer pid>.db` behind that name (the reader only looks at the first three
`_`-separated parts), so they never replace the host's files, and a sweep can tell ours, and
their writer, from theirs.

Each file is rewritten whole on every sample (temp file, rename): a series gone from the sample
(a GPU lost) is gone from the next scrape; prometheus_client's own files never drop a key. A
process that exits removes its series (atexit, or the handle's stop); any other bridge in the
folder sweeps those of a killed one. The reader of a scrape tolerates a live gauge file
vanishing between its glob and its read, but fails the whole scrape on a counter file that
vanished: counter files are emptied, never deleted (8 bytes per process that ever ran).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import mmap_key

from exporter import atomic
from exporter.sample import Sample

log = logging.getLogger(__name__)

MARK = "gpumem-exporter"
# Ours: <prometheus_client's own name>_gpumem-exporter-<writer pid>.db
_OURS = re.compile(rf"^(?:gauge_liveall_[0-9]+\.db|counter)_{MARK}-(?P<writer>[0-9]+)\.db$")
_INT = struct.Struct("i")
_DOUBLES = struct.Struct("dd")
_EMPTY_SIZE = 8  # a file with no entries: its used length and padding

Entries = list[tuple[str, float]]


def multiprocess_dir(env: Mapping[str, str] = os.environ) -> Path | None:
    """The folder of prometheus_client's multiprocess mode, found as prometheus_client finds
    it (the lower-case name is its deprecated spelling); None when the mode is off."""
    value = env.get("PROMETHEUS_MULTIPROC_DIR") or env.get("prometheus_multiproc_dir")
    return Path(value) if value else None


def encode(entries: Entries) -> bytes:
    """prometheus_client's file layout (mmap_dict.MmapedDict): the used length (4 bytes) and
    4 bytes of padding, then per entry the key's length (4 bytes), the UTF-8 key padded with
    spaces to 8-byte alignment, the value and a timestamp (doubles; 0: not `mostrecent`).
    Not MmapedDict itself: it updates a 1 MiB mapping in place and never drops a key, where
    the bridge rewrites a small file whole and renames it (tests read it back through
    MultiProcessCollector, so the two layouts cannot drift apart unseen)."""
    out = bytearray(_EMPTY_SIZE)
    for key, value in entries:
        raw = key.encode()
        out += _INT.pack(len(raw)) + raw + b" " * (8 - (len(raw) + 4) % 8)
        out += _DOUBLES.pack(value, 0.0)
    _INT.pack_into(out, 0, len(out))
    return bytes(out)


@functools.lru_cache(maxsize=4096)
def _key(name: str, sample_name: str, labels: tuple[tuple[str, str], ...], doc: str) -> str:
    """A sample's key in the file; cached, since the same series come back every tick and the
    JSON encoding is most of render()'s cost."""
    return mmap_key(name, sample_name, [k for k, _ in labels], [v for _, v in labels], doc)


def render(families: Iterable[Metric], pid: int) -> tuple[dict[str, bytes], set[str]]:
    """The files of process `pid` for these families ({file name: content}), and the names
    of families whose type has no place in them (none of SampleCollector's today)."""
    writer = f"{MARK}-{pid}.db"
    gauges: dict[str, Entries] = {}  # by the pid the series is about
    counters: Entries = []
    skipped = set()
    for family in families:
        doc = family.documentation
        if family.type in ("gauge", "info"):
            name = family.name + "_info" if family.type == "info" else family.name
            for sample in family.samples:
                labels = dict(sample.labels)
                owner = labels.pop("pid", "")
                owner = owner if owner.isdigit() else str(pid)
                key = _key(name, sample.name, tuple(labels.items()), doc)
                gauges.setdefault(owner, []).append((key, sample.value))
        elif family.type == "counter":
            for sample in family.samples:
                labels = {**sample.labels, "pid": sample.labels.get("pid") or str(pid)}
                key = _key(family.name, sample.name, tuple(labels.items()), doc)
                counters.append((key, sample.value))
        else:
            skipped.add(family.name)
    files = {f"gauge_liveall_{owner}.db_{writer}": encode(e) for owner, e in gauges.items()}
    files[f"counter_{writer}"] = encode(counters)
    return files, skipped


class MultiprocessBridge:
    """A sampler listener that writes `families()` (SampleCollector.collect) into `directory`
    for MultiProcessCollector, and retires the files of processes that are gone.

    A writer is gone once its PID is (prometheus_client's multiprocess mode needs every
    process of the folder in one PID namespace anyway: its own file names hold the PID), or
    once it has not rewritten its files for `stale_s` (its PID reused by another process). A
    file whose content did not change is rewritten only every `stale_s / 3`, to show that its
    writer lives; most ticks change one file of three (the gauges).
    """

    def __init__(
        self,
        families: Callable[[], Iterable[Metric]],
        directory: Path,
        *,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        mtime_clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        self.pid = os.getpid()
        self._families = families
        self._stale_s = max(60.0, 10 * interval_s)
        self._clock = clock
        self._mtime_clock = mtime_clock
        self._lock = threading.Lock()
        self._closed = False
        self._skipped: set[str] = set()
        self._written: dict[str, tuple[bytes, float]] = {}  # name -> (content, when written)

    def __call__(self, sample: Sample) -> None:
        self.publish()

    def publish(self) -> None:
        files, skipped = render(self._families(), self.pid)
        if skipped - self._skipped:
            self._skipped |= skipped
            log.warning("families not published to PROMETHEUS_MULTIPROC_DIR: %s", sorted(skipped))
        with self._lock:
            if self._closed or os.getpid() != self.pid:  # stopped, or a forked child
                return
            now = self._clock()
            for name, data in files.items():
                last = self._written.get(name)
                if last is None or last[0] != data or now - last[1] > self._stale_s / 3:
                    atomic.write_bytes(self.directory / name, data, fsync=False)
                    self._written[name] = (data, now)
            self._sweep(keep=files.keys())

    def _sweep(self, keep: Iterable[str]) -> None:
        """Retire our files that this process no longer writes, and those of gone writers."""
        keep = set(keep)
        for name in self._written.keys() - keep:
            del self._written[name]
        now = self._mtime_clock()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                match = _OURS.match(entry.name)
                if match is None or entry.name in keep:
                    continue
                writer = int(match["writer"])
                if writer == self.pid or self._gone(entry, writer, now):
                    self._retire(entry)

    def _gone(self, entry: os.DirEntry[str], writer: int, now: float) -> bool:
        if not atomic.writer_alive(writer):
            return True
        try:
            return now - entry.stat().st_mtime > self._stale_s
        except FileNotFoundError:
            return False  # retired by another bridge meanwhile

    def _retire(self, entry: os.DirEntry[str]) -> None:
        if entry.name.startswith("gauge_"):
            Path(entry.path).unlink(missing_ok=True)
            return
        try:
            if entry.stat().st_size <= _EMPTY_SIZE:
                return  # emptied already
        except FileNotFoundError:
            return
        atomic.write_bytes(entry.path, encode([]), fsync=False)

    def close(self) -> None:
        """Take this process's series out of the folder (at exit, or when the handle stops).
        Never raises: it runs from atexit in the host process."""
        with self._lock:
            if self._closed or os.getpid() != self.pid:
                return
            self._closed = True
            try:
                self._sweep(keep=())
            except Exception as exc:  # the folder removed at exit before us, say
                log.warning(
                    "could not remove this process's series from %s: %s", self.directory, exc
                )
