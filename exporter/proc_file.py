"""/proc files: one kept open and read again from its start, and the `Name: value [kB]` fields
of meminfo and status files. Standard library only."""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable

PAGE_SIZE = resource.getpagesize()
READ_BYTES = 16384  # more than a stat, statm, meminfo or status file holds but for long Groups


def field_keys(names: Iterable[str]) -> tuple[tuple[str, bytes], ...]:
    """What parse_fields() searches for each field: made once, beside the names."""
    return tuple((name, f"\n{name}:".encode()) for name in names)


def parse_fields(data: bytes, keys: tuple[tuple[str, bytes], ...]) -> dict[str, int]:
    """The fields of `keys` found in a /proc file of `Name: value [kB]` lines, in bytes where
    given in kB. A search per field takes a quarter of a regular expression's time over the
    whole file, and a fraction of a loop over its lines. ValueError or IndexError if a field
    found has no number."""
    data = b"\n" + data  # each field is searched for at a line's start
    values = {}
    for name, key in keys:
        start = data.find(key)
        if start < 0:
            continue
        fields = data[start + len(key) : data.find(b"\n", start + 1)].split()
        values[name] = int(fields[0]) * (1024 if fields[1:] == [b"kB"] else 1)
    return values


class ProcFile:
    """A /proc file kept open and read again from its start (pread) on every tick: the kernel
    writes it anew for each read at offset 0, and an open and a close per tick are saved."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def read(self, whole: bool = False) -> bytes:
        """The file's first READ_BYTES, or all of it (`whole`: a status file's Groups line
        can push its later fields past them)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = chunk = os.pread(self._fd, READ_BYTES, 0)
            while whole and len(chunk) == READ_BYTES:
                chunk = os.pread(self._fd, READ_BYTES, len(data))
                data += chunk
            return data
        except OSError:
            self.close()  # reopened on the next read
            raise

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
