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


class HostMemorySource:
    name = "host"

    def __init__(self) -> None:
        self._process = psutil.Process()

    def read(self) -> SourceReading:
        memory = psutil.virtual_memory()
        swap = psutil.swap_memory()
        return SourceReading(
            host=HostReading(
                total_bytes=int(memory.total),
                available_bytes=int(memory.available),
                swap_total_bytes=int(swap.total),
                swap_used_bytes=int(swap.used),
                process_resident_bytes=int(self._process.memory_info().rss),
                process_resident_peak_bytes=peak_rss_bytes(),
            )
        )

    def close(self) -> None:
        pass
