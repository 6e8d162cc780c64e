"""client_python's process metrics (`process_cpu_seconds_total`, `process_resident_memory_bytes`,
`process_open_fds`, ...) for this process, written from one kept-open /proc file.

client_python's ProcessCollector opens /proc/self/stat and /proc/self/limits through Python's
file objects and lists /proc/self/fd on every collect: 51 us hot, 220-250 us on the cold caches
a once-a-second render finds (measured in the helper process on the development VM), a fifth of
the helper's whole render. Here /proc/self/stat is kept open and read again from its start
(exporter.proc_file), the file limit comes from getrlimit() (the soft limit, the
column client_python reads), and the start time's parts are read once: 14 us hot.

The families are client_python's, name for name, help for help, value for value (a test holds
them to ProcessCollector's); the descriptor it keeps open counts in `process_open_fds`.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Hashable, Iterable

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.proc_file import PAGE_SIZE, ProcFile


class OneValue:
    """A family of one unlabelled sample: its name, type and help, and its value now."""

    __slots__ = ("_shape", "counter", "help", "name", "value")

    def __init__(self, name: str, help: str, counter: bool = False, value: float = 0.0) -> None:
        self.name, self.help, self.counter, self.value = name, help, counter, value
        self._shape = (name, help, counter)

    def holding(self, value: float) -> OneValue:
        return OneValue(self.name, self.help, self.counter, value)

    def shape(self) -> Hashable:
        return self._shape

    def values(self) -> list[float]:
        return [self.value]

    def to_metric(self) -> Metric:
        if self.counter:
            return CounterMetricFamily(self.name, self.help, value=self.value)
        return GaugeMetricFamily(self.name, self.help, value=self.value)


# client_python's ProcessCollector's families, in its order, with its help texts.
_VIRTUAL = OneValue("process_virtual_memory_bytes", "Virtual memory size in bytes.")
_RESIDENT = OneValue("process_resident_memory_bytes", "Resident memory size in bytes.")
_START = OneValue(
    "process_start_time_seconds", "Start time of the process since unix epoch in seconds."
)
_CPU = OneValue(
    "process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", counter=True
)
_OPEN_FDS = OneValue("process_open_fds", "Number of open file descriptors.")
_MAX_FDS = OneValue("process_max_fds", "Maximum number of open file descriptors.")


def _boot_time(proc: str) -> float | None:
    """The machine's boot time (seconds since the epoch, /proc/stat's btime); None without /proc."""
    try:
        with open(f"{proc}/stat", "rb") as stat:
            for line in stat:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class OwnProcessMetrics(Collector):
    """This process's CPU, memory and file descriptors, as client_python's ProcessCollector
    serves them (Linux; nothing elsewhere, as it does)."""

    def __init__(self, proc: str = "/proc") -> None:
        self._proc = proc
        self._ticks = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        self._boot = _boot_time(proc)
        self._stat: ProcFile | None = None
        # /proc/self/fd kept open and listed through its descriptor: 71 against 103 us of CPU
        # on cold caches for a listing by path (development VM). Like client_python's count,
        # this one counts every descriptor the process holds, the listing's own included.
        self._fd_dir: int | None = None
        self._pid = 0  # the process these were opened in: a forked child opens its own

    def _opened_here(self) -> ProcFile:
        if self._stat is None or self._pid != os.getpid():
            # A forked child inherits its parent's descriptors of /proc/PID/stat and
            # /proc/PID/fd: its copies are closed, and the child's own files opened.
            self.close()
            self._stat, self._pid = ProcFile(f"{self._proc}/self/stat"), os.getpid()
        return self._stat

    def _read_stat(self) -> list[bytes]:
        # The command name (field 2) may hold spaces and ')': fields count from after it.
        return self._opened_here().read().rpartition(b")")[2].split()

    def _count_fds(self) -> int:
        self._opened_here()
        if self._fd_dir is None:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
            self._fd_dir = os.open(f"{self._proc}/self/fd", flags)
        return len(os.listdir(self._fd_dir))

    def collect(self) -> Iterable[Metric]:
        return [family.to_metric() for family in self.families()]

    def families(self) -> list[OneValue]:
        """The families as the exposition's renderer takes them (exporter.exposition_templates
        .Family): each of one value, with a shape fixed for the process's life, so that a
        render makes no prometheus_client family of them (a fifth of this collector's cold
        cost in the helper, with the shapes computed again from the samples)."""
        if self._boot is None:
            return []
        found: list[OneValue] = []
        try:
            parts = self._read_stat()
            found += [
                _VIRTUAL.holding(float(parts[20])),
                _RESIDENT.holding(float(parts[21]) * PAGE_SIZE),
                _START.holding(float(parts[19]) / self._ticks + self._boot),
                _CPU.holding((float(parts[11]) + float(parts[12])) / self._ticks),
            ]
        except (OSError, ValueError, IndexError):
            pass
        try:
            open_fds = self._count_fds()
        except OSError:
            return found
        found.append(_OPEN_FDS.holding(float(open_fds)))
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY:  # /proc says "unlimited", which has no number
            found.append(_MAX_FDS.holding(float(soft)))
        return found

    def close(self) -> None:
        if self._stat is not None:
            self._stat.close()
        if self._fd_dir is not None:
            fd, self._fd_dir = self._fd_dir, None
            os.close(fd)

    # The registry that holds it has no close(): its descriptor goes with it (tests make
    # hundreds of runtimes in one process).
    __del__ = close
