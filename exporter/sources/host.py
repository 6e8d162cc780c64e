"""Host memory: what the machine has left, swap, and this process's resident set.

A validation worker that loads tens of GiB of captured tensors swaps the machine while the
GPU looks fine; these numbers make that visible next to the GPU ones.
"""

from __future__ import annotations

import resource
import sys

import psutil

from exporter.sample import HostReading, SourceReading


def peak_rss_bytes() -> int:
    """This process's peak resident set size (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


MEMINFO = "/proc/meminfo"


WANTED = frozenset({"MemTotal", "MemAvailable", "SwapTotal", "SwapFree"})


def read_meminfo(path: str = MEMINFO) -> dict[str, int]:
    """The fields of /proc/meminfo this source needs, in bytes. One read gives memory and
    swap: psutil reads the file twice plus /proc/vmstat on every tick (~170 us, measured)."""
    values = {}
    with open(path, "rb") as f:
        for line in f:
            key, _, rest = line.partition(b":")
            name = key.decode()
            if name in WANTED:
                fields = rest.split()
                values[name] = int(fields[0]) * (1024 if fields[1:] == [b"kB"] else 1)
                if len(values) == len(WANTED):
                    break
    return values


class HostMemorySource:
    name = "host"

    def __init__(self) -> None:
        self._process = psutil.Process()

    def read(self) -> SourceReading:
        try:
            info = read_meminfo()
            total, available = info["MemTotal"], info["MemAvailable"]
            swap_total, swap_used = info["SwapTotal"], info["SwapTotal"] - info["SwapFree"]
        except (OSError, KeyError, ValueError):  # not Linux, or an old kernel
            memory, swap = psutil.virtual_memory(), psutil.swap_memory()
            total, available = int(memory.total), int(memory.available)
            swap_total, swap_used = int(swap.total), int(swap.used)
        return SourceReading(
            host=HostReading(
                total_bytes=total,
                available_bytes=available,
                swap_total_bytes=swap_total,
                swap_used_bytes=swap_used,
                process_resident_bytes=int(self._process.memory_info().rss),
                process_resident_peak_bytes=peak_rss_bytes(),
            )
        )

    def close(self) -> None:
        pass
