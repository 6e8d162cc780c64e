"""`gpumem-exporter run` owns the process tree it starts, as tini -g, dumb-init and systemd's
control-group kill do, and more:

- The launcher is a child subreaper (PR_SET_CHILD_SUBREAPER; as PID 1 of a container it is
  one anyway): every process of the server that is orphaned (its parent died, or it left with
  a double fork or setsid) is re-parented to it, so it is reaped and never outlives the run.
- The command runs as the leader of its own process group (and session); every forwarded
  signal goes to that group, so a terminal's Ctrl-C reaches all of the server as it would
  without the wrapper.
- Exactly one reaper: this loop's waitpid(-1) records the command's status when it reaps it
  (a second waiter would make Popen.wait() report 0 for a crash) and reaps every orphan.
- Stopping: on SIGTERM, SIGINT or SIGHUP, and when the command exits by itself, whatever is
  left of the tree (the group, descendants, orphans, setsid'd ones) gets SIGTERM, then SIGKILL
  once the grace period (GPUMEM_STOP_GRACE_S, default 10 s, inside Kubernetes' 30 s) has
  passed. The launcher then exits with the command's status (128 + N for signal N) and logs
  which processes it had to stop, and which of them still held GPU memory.
- No lost signals: the handlers are in place before the command starts; a signal that comes
  while it is being started is delivered once it exists, and a stop signal before it starts
  means it never starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from types import FrameType

import psutil

log = logging.getLogger("exporter.launcher")

PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
FORWARDED = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGWINCH")
    if hasattr(signal, name)
)
POLL_S = 0.05  # how often zombies are reaped and the grace deadline checked


def prctl(option: int, value: int) -> bool:
    """prctl(2) on Linux; False where it is not available or refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def exit_status(wait_status: int) -> int:
    """A shell's exit status for a wait status: the code, or 128 + N for signal N."""
    code = os.waitstatus_to_exitcode(wait_status)
    return code if code >= 0 else 128 - code


class Supervisor:
    """Starts one command and owns everything it starts. `describe(pid)` names a process for
    the log. Set after construction, as the launcher learns them: `gpu_pids` (which processes
    hold GPU memory, from NVML) and `spared` (the launcher's own helpers, its keeper, never
    stopped here)."""

    def __init__(self, *, grace_s: float, describe: Callable[[int], str] = lambda pid: "") -> None:
        self.grace_s = grace_s
        self._describe = describe
        self.gpu_pids: Callable[[], Collection[int]] = frozenset
        self.spared: set[int] = set()
        self.pid: int | None = None
        self.status: int | None = None
        self._pending: list[int] = []
        self.stop_signal: int | None = None  # the first stop signal received
        self._stop_deadline: float | None = None

    # -- signals --------------------------------------------------------------------------

    def install(self) -> Callable[[], None]:
        """Handle the forwarded signals from now on; returns what restores the old handlers."""
        previous = {signum: signal.signal(signum, self._on_signal) for signum in FORWARDED}

        def restore() -> None:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

        return restore

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum in STOP_SIGNALS and self._stop_deadline is None:
            self.stop_signal = signum
            self._stop_deadline = time.monotonic() + self.grace_s
        if self.pid is None:
            self._pending.append(signum)  # delivered once the command exists
        else:
            self._to_group(signum)

    def _to_group(self, signum: int) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signum)  # the command leads its own group

    # -- the command ----------------------------------------------------------------------

    def spawn(self, argv: Sequence[str], env: Mapping[str, str]) -> int | None:
        """Start the command; None if a stop signal came first (it never starts). OSError if
        it cannot be started."""
        prctl(PR_SET_CHILD_SUBREAPER, 1)  # as PID 1 (or off Linux) nothing changes
        if self._stop_deadline is not None:
            return None
        # setsid in the child (async-signal-safe, unlike a preexec_fn in a threaded process):
        # its own session and process group, led by the command.
        child = subprocess.Popen(list(argv), env=dict(env), start_new_session=True)
        child.returncode = 0  # this Popen is never waited on: the loop below is the reaper
        self.pid = child.pid
        for signum in self._pending:
            self._to_group(signum)
        self._pending.clear()
        return self.pid

    def wait(self) -> int:
        """Reap until the command has exited, stop what it left, return its exit status."""
        assert self.pid is not None
        killed = False
        while self.status is None:
            self._reap()
            if self.status is not None:
                break
            overdue = self._stop_deadline is not None and time.monotonic() >= self._stop_deadline
            if overdue and not killed:
                log.warning(
                    "the command did not stop within %.0f s of the signal: SIGKILL", self.grace_s
                )
                self._signal(self._leftovers(), signal.SIGKILL)
                killed = True
            time.sleep(POLL_S)
        self._stop_leftovers()
        return self.status

    def _reap(self) -> None:
        while True:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.pid:
                self.status = exit_status(wait_status)

    def tree(self) -> list[int]:
        """The pids of the server (_server)."""
        return [p.pid for p in self._server()]

    def _server(self) -> list[psutil.Process]:
        """The launcher's descendants less its own helpers (the keeper and what it starts).
        As a subreaper it adopts the orphans of the command's tree (a worker whose parent
        exited, a daemon that double-forked), which a walk from the command would miss."""
        spared = set(self.spared)
        with contextlib.suppress(psutil.Error):
            for helper in [psutil.Process(p) for p in self.spared if psutil.pid_exists(p)]:
                spared.update(c.pid for c in helper.children(recursive=True))
        try:
            descendants = psutil.Process().children(recursive=True)
        except psutil.Error:
            return []
        return [p for p in descendants if p.pid not in spared]

    def _leftovers(self) -> list[psutil.Process]:
        """Every process of the server still there (_server) and of the command's group."""
        found = {p.pid: p for p in self._server()}
        if self.pid is not None:
            for process in psutil.process_iter():
                with contextlib.suppress(psutil.Error, OSError):
                    if os.getpgid(process.pid) == self.pid and process.pid not in self.spared:
                        found[process.pid] = process
        return [p for _, p in sorted(found.items()) if _running(p)]

    def _signal(self, processes: list[psutil.Process], signum: int) -> None:
        self._to_group(signum)
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signum)

    def _wait_gone(self, processes: list[psutil.Process], deadline: float) -> list[psutil.Process]:
        """Reap while any of `processes` runs, until `deadline`; those still running."""
        while (alive := [p for p in processes if _running(p)]) and time.monotonic() < deadline:
            self._reap()
            time.sleep(POLL_S)
        self._reap()
        return alive

    def _stop_leftovers(self) -> None:
        left = self._leftovers()
        if not left:
            return
        stopped = [(p.pid, self._describe(p.pid)) for p in left]
        gpu = sorted(set(self.gpu_pids()) & {pid for pid, _ in stopped})
        self._signal(left, signal.SIGTERM)
        deadline = self._stop_deadline or time.monotonic() + self.grace_s
        # Once more through the whole tree: what the first SIGTERM made start meanwhile.
        killed = self._wait_gone(left, deadline) + self._leftovers()
        if killed:
            self._signal(killed, signal.SIGKILL)
            self._wait_gone(killed, time.monotonic() + 5)
        names = ", ".join(f"{pid} ({role or '?'})" for pid, role in stopped)
        log.warning(
            "the command left %d process(es) running; stopped them: %s%s%s",
            len(stopped),
            names,
            f"; {len({p.pid for p in killed})} needed SIGKILL" if killed else "",
            f"; still holding GPU memory: {', '.join(map(str, gpu))}" if gpu else "",
        )


def _running(process: psutil.Process) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
