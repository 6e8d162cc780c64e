"""Host memory per process: resident, peak resident and swap bytes, from /proc/PID/status.

Which processes: under `gpumem-exporter run`, every process of the command's tree, whether it
uses CUDA or not (a validation worker holding tens of GiB of tensors in a list is the one the
on-call needs to find); in the node daemon, every process NVML lists on a GPU (host PIDs:
the DaemonSet runs with hostPID). Each is labelled pid, role and rank, so that the process
holding the host's RAM can be told apart from the one growing GPU memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import psutil

from exporter import budget
from exporter.identity import command_line, command_role
from exporter.proc_file import ProcFile, field_keys, parse_fields
from exporter.sample import HostProcessReading, SourceReading
from exporter.sources import HOST_PROCESSES

_STATUS_FIELDS = {"VmRSS": "rss", "VmHWM": "hwm", "VmSwap": "swap"}
_STATUS_KEYS = field_keys(_STATUS_FIELDS)


def read_status(pid: int, proc: str = "/proc") -> dict[str, int] | None:
    """VmRSS, VmHWM and VmSwap of a process in bytes; None if it is gone (or not Linux).

    The whole file read at once (/proc/PID/status is ~1.5 KiB; its Groups line grows with a
    process's groups) and a search per field (exporter.proc_file.parse_fields): Python's file
    object and a loop over the lines cost 147 us a tick on the cold caches of the helper's
    once-a-second tick, 36 us hot against this 21. KeptStatus keeps the files it reads on
    every tick open instead."""
    status = ProcFile(f"{proc}/{pid}/status")
    try:
        return status_values(status.read(whole=True))
    except OSError:
        return None
    finally:
        status.close()


def status_values(data: bytes) -> dict[str, int] | None:
    """read_status()'s fields from a status file's text."""
    try:
        found = parse_fields(data, _STATUS_KEYS)
    except (ValueError, IndexError):
        return None
    values = {_STATUS_FIELDS[name]: value for name, value in found.items()}
    return values if "rss" in values else None  # kernel threads and zombies have no VmRSS


class KeptStatus:
    """/proc/PID/status of the processes read on every tick, each kept open (pread): on the
    cold caches of the helper's once-a-second tick an open, a read and a close of its served
    process's status cost 180 us of CPU against 55 for a read of the file kept open (the
    development VM, bench.helper_breakdown's conditions).

    A descriptor names the process it was opened for, not its PID: once that process is gone
    its reads fail, and the PID's file is opened again (a new process that took the PID is
    read, never the old one's numbers). At most MAX_KEPT_OPEN are kept (the node daemon may
    see hundreds of GPU processes); the rest are opened on each read, as before."""

    MAX_KEPT_OPEN = 64

    def __init__(self, proc: str) -> None:
        self._proc = proc
        self._files: dict[int, ProcFile] = {}

    def read(self, pid: int) -> dict[str, int] | None:
        kept = self._files.get(pid)
        if kept is None:
            if len(self._files) >= self.MAX_KEPT_OPEN:
                return read_status(pid, self._proc)
            kept = self._files[pid] = ProcFile(f"{self._proc}/{pid}/status")
        for _ in range(2):  # the second: the PID's file opened again, after its process left
            try:
                data = kept.read(whole=True)
            except OSError:
                continue  # closed by read(): opened again on the next
            if data:
                return status_values(data)
            kept.close()  # an empty read: a task gone
        self.forget(pid)
        return None

    def keep_only(self, pids: Iterable[int]) -> None:
        for gone in set(self._files) - set(pids):
            self.forget(gone)

    def forget(self, pid: int) -> None:
        kept = self._files.pop(pid, None)
        if kept is not None:
            kept.close()

    def close(self) -> None:
        for pid in list(self._files):
            self.forget(pid)


# A tenant's process sets its own environment (up to a quarter of its stack limit): only this
# much is read, enough for RANK and GPUMEM_ROLE in any real one.
MAX_ENVIRON_BYTES = 1 << 16


def read_environ(pid: int, proc: str = "/proc") -> dict[bytes, bytes]:
    """The environment a process was started with (its first MAX_ENVIRON_BYTES); {} if it
    cannot be read."""
    try:
        with open(f"{proc}/{pid}/environ", "rb") as f:
            raw = f.read(MAX_ENVIRON_BYTES)
    except OSError:
        return {}
    return dict(item.partition(b"=")[::2] for item in raw.split(b"\0") if item)


def describe(pid: int, proc: str = "/proc", args: list[str] | None = None) -> dict[str, str]:
    """role (GPUMEM_ROLE, else what its command line says: identity.command_role) and rank
    (RANK) as the process started (`args`: its command line, where already read)."""
    env = read_environ(pid, proc)
    role = env.get(b"GPUMEM_ROLE", b"").decode(errors="replace") or command_role(
        command_line(pid, proc) if args is None else args
    )
    return {"role": role[:64], "rank": env.get(b"RANK", b"").decode(errors="replace")[:16]}


def process_tree(root: int | None) -> list[int]:
    """`root` and all its descendants (the command `run` started and what it spawned)."""
    if root is None:
        return []
    try:
        parent = psutil.Process(root)
        return [root, *(child.pid for child in parent.children(recursive=True))]
    except psutil.Error:
        return []


class ProcessMemorySource:
    name = "process_memory"
    provides = frozenset({HOST_PROCESSES})

    def __init__(
        self,
        pids: Callable[[], Iterable[int]],
        *,
        labels: Callable[[], Mapping[int, Mapping[str, str]]] | None = None,
        proc: str = "/proc",
    ) -> None:
        self._pids = pids
        # Live labels where they are known (an agent's hello carries the RANK it runs with),
        # else what the process started with, read again only when its command line changes:
        # a process seen between fork and exec (the launcher starting the command, a spawn
        # worker) has its parent's, and a pid's first description must not stick past exec.
        self._labels = labels
        self._proc = proc
        self._described: dict[int, tuple[list[str], dict[str, str]]] = {}
        self._status = KeptStatus(proc)

    def read(self) -> SourceReading:
        pids = sorted(set(self._pids()))
        known = self._labels() if self._labels is not None else {}
        readings = []
        for pid in pids:
            status = self._status.read(pid)
            if status is None:
                continue
            labels = known.get(pid)
            if labels is None:
                args = command_line(pid, self._proc)
                seen = self._described.get(pid)
                if seen is None or seen[0] != args:
                    seen = self._described[pid] = (args, describe(pid, self._proc, args))
                labels = seen[1]
            readings.append(
                HostProcessReading(
                    pid=pid,
                    role=labels.get("role", ""),
                    rank=labels.get("rank", ""),
                    resident_bytes=status["rss"],
                    resident_peak_bytes=status.get("hwm"),
                    swap_bytes=status.get("swap"),
                )
            )
        for gone in set(self._described) - set(pids):  # pids are reused: forget the exited
            del self._described[gone]
        self._status.keep_only(pids)
        largest = sorted(readings, key=lambda r: -r.resident_bytes)
        served, dropped = budget.take(largest, budget.HOST_PROCESSES)
        if dropped:
            readings = sorted(served, key=lambda r: r.pid)  # back in pid order
        return SourceReading(host_processes=readings, over_budget={"host_processes": dropped})

    def close(self) -> None:
        self._status.close()
