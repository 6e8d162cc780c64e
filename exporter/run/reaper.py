"""The launcher's keeper: the server it started never outlives it, however it ends.

A launcher killed with SIGKILL (or by the OOM killer) runs no clean-up, so its command would
keep running, orphaned, with the run folder and socket left in the temp dir. The reaper is a
small process of its own session (terminal signals do not reach it) that holds the read end of
a pipe from the launcher. The launcher writes the command's pid (and its start time, so that a
reused pid is never hit), then `done` once it has waited for the command. End of file without
`done` means the launcher died: the reaper stops the server (SIGTERM, SIGKILL after a grace
period, as a pod's stop would), then removes the run folder. Either way it removes the folder
and exits.

The server is more than the command's tree (issue 38): a daemon that double-forked or setsid'd
was re-parented to the launcher (a subreaper), and is re-parented again when the launcher dies;
a command whose execve stalls (a binary on a hung network mount) has no pid the launcher could
send yet. So the reaper also looks at the launcher's children every WATCH_S while it lives,
remembering each, and at the end stops every process whose environment carries the run's
marker (GPUMEM_RUN_DIR=<its folder>, inherited by everything the command starts).

Run as `python -m exporter.run.reaper RUN_DIR MARKER`; it imports only psutil and the standard
library.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import IO

import psutil

GRACE_S = 10.0
WATCH_S = 1.0  # how often the launcher's children are looked at while it lives


def start(run_dir: str, env: Mapping[str, str], marker: str) -> subprocess.Popen[bytes]:
    """The keeper, with `env` (the launcher's without its secrets: the keeper is dumpable, so
    any process of the same uid can read its /proc/<pid>/environ). `marker` is the
    NAME=VALUE the command's environment carries and the launcher's does not."""
    path = env.get("PYTHONPATH")
    return subprocess.Popen(
        # The launcher's pid, never the keeper's getppid(): a launcher killed before the
        # keeper has started makes that the subreaper above it, or init (whose children
        # are no part of this run).
        [sys.executable, "-m", "exporter.run.reaper", run_dir, marker, str(os.getpid())],
        stdin=subprocess.PIPE,
        start_new_session=True,  # Ctrl-C in the terminal goes to the launcher, not here
        env={**env, "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, path]))},
    )


# Where this package is imported from, so that the reaper finds the same one.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def watch(command: psutil.Process, reaper: subprocess.Popen[bytes]) -> None:
    """Tell the reaper which process to stop if the launcher dies."""
    assert reaper.stdin is not None
    reaper.stdin.write(f"{command.pid} {command.create_time()!r}\n".encode())
    reaper.stdin.flush()


def release(reaper: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """The command has been waited for: the reaper only tidies up, and exits."""
    with contextlib.suppress(OSError, ValueError):
        assert reaper.stdin is not None
        reaper.stdin.write(b"done\n")
        reaper.stdin.close()
    try:
        reaper.wait(timeout_s)
    except subprocess.TimeoutExpired:
        reaper.kill()


def stop(
    command: psutil.Process | None, others: list[psutil.Process], grace_s: float = GRACE_S
) -> None:
    """SIGTERM the command's process group, the command, `others` and all their
    descendants; SIGKILL what is left after `grace_s`."""
    found: dict[int, psutil.Process] = {}
    for root in [command, *others] if command is not None else others:
        with contextlib.suppress(psutil.Error):
            for process in [root, *root.children(recursive=True)]:
                found.setdefault(process.pid, process)
    for never in (os.getpid(), 1):  # this keeper; init, where a launcher's pid was reused
        found.pop(never, None)
    tree = list(found.values())
    if command is not None:
        with contextlib.suppress(OSError):
            os.killpg(command.pid, signal.SIGTERM)  # the command runs as its own group's leader
    for process in tree:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    alive = _wait_gone(tree, grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    _wait_gone(alive, grace_s)


def _wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of `processes` still running after up to `timeout_s`. A zombie has ended: these
    are not the keeper's children, and whoever adopted them reaps them (or not) in its own
    time (psutil.wait_procs counts a zombie as running)."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in processes if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _command(line: str) -> psutil.Process | None:
    pid, _, started = line.partition(" ")
    try:
        process = psutil.Process(int(pid))
        return process if process.create_time() == float(started) else None
    except (ValueError, psutil.Error):
        return None


def children_of(pid: int) -> set[int]:
    """The pids of `pid`'s children: from /proc/<pid>/task/*/children (an orphan adopted by a
    subreaper may hang under any of its threads), else psutil's walk of every process."""
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        for task in tasks:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(child) for child in f.read().split())
    except FileNotFoundError:  # gone, or a kernel without CONFIG_PROC_CHILDREN
        with contextlib.suppress(psutil.Error):
            found.update(child.pid for child in psutil.Process(pid).children())
    except (OSError, ValueError):
        pass
    return found


def remember(launcher: int, seen: dict[int, float]) -> None:
    """Note each child of the launcher not seen yet, with its start time (a pid reused later
    is never hit). Only while the launcher is this process's parent: once it is gone, its
    pid may be anyone's."""
    if os.getppid() != launcher:
        return
    for pid in children_of(launcher) - seen.keys() - {os.getpid()}:
        with contextlib.suppress(psutil.Error):
            seen[pid] = psutil.Process(pid).create_time()


def the_server(seen: dict[int, float], marker: str) -> list[psutil.Process]:
    """The launcher's children it ever had that still run, and every process of this user
    whose environment carries the run's marker."""
    found: dict[int, psutil.Process] = {}
    for pid, created in seen.items():
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if process.create_time() == created:
                found[pid] = process
    wanted = marker.encode() + b"\0"
    for process in psutil.process_iter():
        if process.pid in found or process.pid == os.getpid():
            continue
        # Read raw: psutil's environ() splits at "=" and would take a value with one apart.
        with contextlib.suppress(OSError), open(f"/proc/{process.pid}/environ", "rb") as f:
            if b"\0" + wanted in b"\0" + f.read():  # each entry ends with a NUL
                found[process.pid] = process
    return list(found.values())


def serve(run_dir: str, launcher: IO[bytes], marker: str, parent: int) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)  # only the launcher's end of the pipe ends this
    command: psutil.Process | None = None
    released = False
    seen: dict[int, float] = {}
    pending = b""
    fd = launcher.fileno()
    while True:
        remember(parent, seen)  # first: a command whose execve stalls is only a child
        ready, _, _ = select.select([fd], [], [], WATCH_S)
        if not ready:
            continue
        data = os.read(fd, 4096)
        if not data:
            break
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            if line.strip() == b"done":
                released = True
            elif command is None:
                command = _command(line.decode(errors="replace").strip())
    if not released:
        stop(command, the_server(seen, marker))
    # The launcher removes the folder itself; this covers a launcher that could not.
    shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    serve(sys.argv[1], sys.stdin.buffer, sys.argv[2], int(sys.argv[3]))
