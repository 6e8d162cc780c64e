"""Host memory: what the machine has left, swap, and this process's resident set.

A validation worker that loads tens of GiB of captured tensors swaps the machine while the
GPU looks fine; these numbers make that visible next to the GPU ones.
"""

from __future__ import annotations

import resource
import sys

import psutil

from exporter.proc_file import PAGE_SIZE, ProcFile, field_keys, parse_fields
from exporter.sample import HostReading, SourceReading
from exporter.sources import HOST_MEMORY


def peak_rss_bytes() -> int:
    """This process's peak resident set size (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


MEMINFO = "/proc/meminfo"
STATM = "/proc/self/statm"
WANTED = ("MemTotal", "MemAvailable", "SwapTotal", "SwapFree")
_KEYS = field_keys(WANTED)


def parse_meminfo(data: bytes) -> dict[str, int]:
    """The fields of /proc/meminfo this source needs, in bytes. One read gives memory and
    swap (psutil reads the file twice plus /proc/vmstat on every tick, ~170 us measured)."""
    return parse_fields(data, _KEYS)


class HostMemorySource:
    name = "host"
    provides = frozenset({HOST_MEMORY})

    def __init__(self) -> None:
        self._meminfo = ProcFile(MEMINFO)
        self._statm = ProcFile(STATM)
        self._process = psutil.Process()

    def _resident_bytes(self) -> int:
        try:
            return int(self._statm.read().split()[1]) * PAGE_SIZE
        except (OSError, IndexError, ValueError):  # not Linux
            return int(self._process.memory_info().rss)

    def read(self) -> SourceReading:
        try:
            info = parse_meminfo(self._meminfo.read())
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
                process_resident_bytes=self._resident_bytes(),
                process_resident_peak_bytes=peak_rss_bytes(),
            )
        )

    def close(self) -> None:
        self._meminfo.close()
        self._statm.close()
