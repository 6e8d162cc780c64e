"""Series budgets: what one endpoint serves of readings that others send or that a process
tree grows, so that no local process can make a scrape huge (issue 38: processes of the same
uid made `gpumem-exporter run` serve 243k series and take 12.5 s a scrape).

A reading is one process's allocator on one device (about 22 series at the basic detail
level, 37 at full, more with private pools), or one process's host memory (3 series). What a
budget leaves out is counted on /metrics (gpumem_exporter_readings_over_budget), never
silently dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

# One process's allocators: a process uses at most the GPUs of its node (8 on HGX boards,
# 16 on the largest); an agent sending more is not describing CUDA devices.
PER_PROCESS = 16
# One endpoint's allocators: 256 readings is about 9,500 series at full detail (a server of
# 8 GPUs with 32 processes on each); every process connected first keeps its place, so a
# flood of newcomers cannot push out the server's own workers.
PER_ENDPOINT = 256
# One endpoint's host-memory rows: the largest processes first (the on-call looks for the
# one holding the host's RAM).
HOST_PROCESSES = 256

# The budgets, as /metrics names them.
NAMES = ("per_process", "per_endpoint", "host_processes")

T = TypeVar("T")


def take(items: Sequence[T], room: int) -> tuple[list[T], int]:
    """The first `room` of `items`, and how many were left out."""
    room = max(room, 0)
    return list(items[:room]), max(len(items) - room, 0)
