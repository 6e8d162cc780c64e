"""A /proc file kept open and read again from its start: standard library only."""

from __future__ import annotations

import os


class ProcFile:
    """A /proc file kept open and read again from its start (pread) on every tick: the kernel
    writes it anew for each read at offset 0, and an open and a close per tick are saved."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def read(self) -> bytes:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(self._fd, 16384, 0)
        except OSError:
            self.close()  # reopened on the next read
            raise

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
