"""Write a file so that readers see the old content or the new, never half of it.

A writer killed mid-write (SIGKILL, OOM kill) leaves its temp file behind. The temp file's
name carries the writer's pid, so that a sweep can remove leftovers without touching a file
another live process is still writing (`gpumem-exporter run` processes share one folder), and
its PID namespace: two containers sharing one volume have pids that mean nothing to each
other (issue 38), so a file of another namespace's writer is left over only once it is stale.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
import time
from collections.abc import Iterable
from functools import cache
from pathlib import Path

TEMP_SUFFIX = ".partial"
# A temp file nobody has written to for this long is left over, whatever its name says: the
# pid may have been reused, or the file predates pids in names.
STALE_TEMP_S = 600.0
# .<target name>.<writer pid>[n<its PID namespace>].<random>.partial (mkstemp's random part
# has no dot; names without the namespace are older versions').
_TEMP_NAME = re.compile(
    r"^\..+\.(?P<pid>[0-9]+)(?:n(?P<namespace>[0-9]+))?\.[^.]+" + re.escape(TEMP_SUFFIX) + "$"
)


@cache
def pid_namespace() -> str:
    """This process's PID namespace (the inode number of /proc/self/ns/pid), "" where it
    cannot be read. Fixed for a process's life: a fork stays in its parent's."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return ""
    inode = link.partition("[")[2].rstrip("]")
    return inode if inode.isdigit() else ""


def same_pid_namespace(namespace: str) -> bool:
    """Whether a writer that recorded `namespace` ("" where it did not) had pids of ours:
    only then can kill(pid, 0) say whether it lives."""
    return not namespace or not pid_namespace() or namespace == pid_namespace()


def writer_tag() -> str:
    """This process as a temp file's name says it: pid, then its PID namespace."""
    namespace = pid_namespace()
    return f"{os.getpid()}n{namespace}" if namespace else str(os.getpid())


def write_bytes(
    path: str | os.PathLike[str], data: bytes, *, private: bool = True, fsync: bool = True
) -> Path:
    """write_chunks of one piece (below)."""
    write_chunks(path, (data,), private=private, fsync=fsync)
    return Path(path)


def write_chunks(
    path: str | os.PathLike[str],
    chunks: Iterable[bytes],
    *,
    private: bool = True,
    fsync: bool = True,
) -> int:
    """Write to a temporary file beside `path`, fsync, then rename over it.

    `private` (the default) keeps mkstemp's 0600: what the exporter writes for itself
    (snapshots, in their private folder) is this user's alone. `private=False` gives the file
    the mode `> FILE` would (user_file_mode): for files the user names (`view -o`,
    `record -o`), which they expect to share like any other.
    `fsync=False` skips the flush to disk, for files rewritten every few seconds that nobody
    needs after a crash: readers still see the old content or the new, never half of it.
    The chunks are written as they come (a download need not be held whole); one that fails
    leaves nothing at `path`. Returns the bytes written.
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{target.name}.{writer_tag()}.", suffix=TEMP_SUFFIX, dir=target.parent
    )
    try:
        with os.fdopen(fd, "wb") as f:
            if not private:
                os.fchmod(f.fileno(), user_file_mode(target))
            size = 0
            for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return size


def user_file_mode(target: Path | None = None) -> int:
    """The mode `> FILE` in a shell leaves: an existing file's own, else 0666 less the umask
    (a user who closed an earlier output to others keeps it closed)."""
    if target is not None:
        try:
            info = target.stat()
            if stat.S_ISREG(info.st_mode):
                return stat.S_IMODE(info.st_mode)
        except OSError:
            pass
    return 0o666 & ~current_umask()


def current_umask() -> int:
    """This process's umask. Linux shows it in /proc/self/status; elsewhere it can only be
    read by setting it, which races with threads creating files meanwhile (the CLI has none).
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def is_temp(name: str) -> bool:
    """Whether `name` is a temp file of write_bytes (its own or an older version's)."""
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def writer_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def abandoned(path: Path, *, stale_s: float = STALE_TEMP_S) -> bool:
    """Whether the temp file `path` was left behind: its writer is dead, or it has not been
    written to for `stale_s` seconds (the only sign for a writer of another PID namespace)."""
    match = _TEMP_NAME.match(path.name)
    if (
        match is not None
        and same_pid_namespace(match["namespace"] or "")
        and not writer_alive(int(match["pid"]))
    ):
        return True
    try:
        return time.time() - path.lstat().st_mtime > stale_s
    except FileNotFoundError:
        return False  # renamed into place or removed meanwhile
