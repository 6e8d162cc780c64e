"""The launcher's keeper: the server it started never outlives it, however it ends.

A launcher killed with SIGKILL (or by the OOM killer) runs no clean-up, so its command would
keep running, orphaned, with the run folder and socket left in the temp dir. The reaper is a
small process of its own session (terminal signals do not reach it) that holds the read end of
a pipe from the launcher. The launcher writes the command's pid (and its start time, so that a
reused pid is never hit), then `done` once it has waited for the command. End of file without
`done` means the launcher died: the reaper stops the command's process group and every
descendant (SIGTERM, SIGKILL after a grace period, as a pod's stop would), then removes the run
folder. Either way it removes the folder and exits.

Run as `python -m exporter.run.reaper RUN_DIR`; it imports only psutil and the standard library.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from typing import IO

import psutil

GRACE_S = 10.0


def start(run_dir: str, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """The keeper, with `env` (the launcher's without its secrets: the keeper is dumpable, so
    any process of the same uid can read its /proc/<pid>/environ)."""
    path = env.get("PYTHONPATH")
    return subprocess.Popen(
        [sys.executable, "-m", "exporter.run.reaper", run_dir],
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


def stop_tree(root: psutil.Process, grace_s: float = GRACE_S) -> None:
    """SIGTERM the process group of `root` and all its descendants; SIGKILL what is left."""
    try:
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    with contextlib.suppress(OSError):
        os.killpg(root.pid, signal.SIGTERM)  # the command runs as its own group's leader
    for process in tree:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def _command(line: str) -> psutil.Process | None:
    pid, _, started = line.partition(" ")
    try:
        process = psutil.Process(int(pid))
        return process if process.create_time() == float(started) else None
    except (ValueError, psutil.Error):
        return None


def serve(run_dir: str, launcher: IO[str]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)  # only the launcher's end of the pipe ends this
    command: psutil.Process | None = None
    released = False
    for line in launcher:
        if line.strip() == "done":
            released = True
        elif command is None:
            command = _command(line.strip())
    if not released and command is not None:
        stop_tree(command)
    # The launcher removes the folder itself; this covers a launcher that could not.
    shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    serve(sys.argv[1], sys.stdin)
