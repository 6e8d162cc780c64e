"""The folder an agents' socket lives in (a launcher's, a helper's): held for life by the
process that serves it, in a place where a socket's path fits. Standard library only: the
serving processes import it to find their helper."""

from __future__ import annotations

import fcntl
import os
import tempfile

from exporter.transport.agent import SOCKET_NAME

LOCK_NAME = "launcher.lock"


def hold_lock(run_dir: str) -> int:
    """Lock the folder for as long as this process (a launcher, a helper) lives: the kernel
    drops the lock when the process dies, however it dies. A pid would not do: processes in
    other PID namespaces (containers sharing /tmp) see other pids, and pids are reused."""
    fd = os.open(os.path.join(run_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh folder: nobody else holds it
    return fd


# The longest name of a folder that holds an agents' socket (a helper's of uid 2**32 on port 0).
LONGEST_FOLDER = "gpumem-helper-4294967296-0-12345678"


def fits(where: str, folder: str = LONGEST_FOLDER) -> bool:
    """Whether a socket in `folder` under `where` fits the 107 bytes a Unix socket's path may
    have."""
    return len(os.path.join(where, folder, SOCKET_NAME).encode()) <= 107


def socket_base() -> str:
    """The temp dir, unless a socket's path in a helper's or a launcher's folder there would
    pass the 107 bytes a Unix socket's path may have: then /tmp."""
    base = tempfile.gettempdir()
    return base if fits(base) else "/tmp"
