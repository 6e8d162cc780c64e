"""The probe's tick: the allocator's numbers of every CUDA device this process initialized, as
one packed record each (exporter.probe.record), read with the C call that
`torch.cuda.memory_stats_as_nested_dict` wraps.

The same rules keep it safe for the host as the full source (exporter.sources.torch_allocator):
torch is never imported here (found in sys.modules), a device is read only once this process
has its primary context (several "read-only" calls create one), and the device index is
always explicit.
"""

from __future__ import annotations

import struct
import sys
import time
from typing import Any

from exporter.probe import record


def has_context(torch: Any, kind: str, index: int, known: set[int]) -> bool:
    """Whether this process initialized device `index` of this device type (its primary
    context), asked without initializing it; `known` caches the devices that have one (torch
    never tears a primary context down). True where torch cannot say (the private API exists
    in torch 2.4-2.13 for CUDA and ROCm): reading stats is still safe there, and an untouched
    device reads all zeros, which the caller leaves out."""
    if index in known:
        return True
    check = getattr(torch._C, f"_{kind}_hasPrimaryContext", None)
    if check is None:
        return True
    if check(index):
        known.add(index)
        return True
    return False


class AllocatorProbe:
    """Packs this tick's allocator numbers; what it needs from torch is looked up once."""

    def __init__(self, torch_module: Any = None) -> None:
        self._torch = torch_module
        self._read_stats: Any = None
        self._read_fraction: Any = None  # False where torch has no getter (before 2.8)
        self._with_context: set[int] = set()
        # The devices this process had initialized at the last full read: a tick reads only
        # these (worked out again at each configure(), so a device initialized later joins
        # with the next full sample).
        self._devices: list[int] | None = None
        self._ready = False  # CUDA initialized (it never goes back, but in a forked child)
        self._totals: dict[int, int] = {}
        self._paths: tuple[tuple[str, str, str] | None, ...] | None = None
        self._settings: tuple[str, bool] | None = None  # what the paths were planned for
        self._read_values: Any = None
        self._sequence = 0
        # Each device's (allocation retries, OOMs) as the caller's latest full read had them
        # (expect()); `moved` turns True when a record shows others (or a device that read
        # did not have): the caller reads the full sample at once, with the layout and the
        # verdict of that retry or OOM.
        self._expected: dict[int, tuple[int, int]] = {}
        self.moved = False

    def configure(self, backend: str, expandable_segments: bool) -> None:
        """The allocator's backend and expandable-segments setting, as the full read found
        them (they decide which numbers are defined; a server may switch the latter), at
        every full read: the devices are worked out again, the reader compiled again only
        where the settings changed (compiling costs more than a whole record)."""
        if (backend, expandable_segments) != self._settings:
            self._paths = record.plan(backend, expandable_segments)
            self._read_values = record.reader(self._paths)
            self._settings = (backend, expandable_segments)
        self._devices = None

    def expect(self, counters: dict[int, tuple[int, int]]) -> None:
        """(retries, OOMs) by device as a full read found them; clears `moved`."""
        self._expected = counters
        self.moved = False

    def ready(self) -> bool:
        """Whether this process uses CUDA through torch (and a full read configured us)."""
        if self._ready:
            return True
        torch = self._torch or sys.modules.get("torch")
        if torch is None or self._paths is None:
            return False
        self._torch = torch
        self._ready = bool(torch.cuda.is_initialized())
        return self._ready

    def records(self) -> list[bytes]:
        """One record per device this process initialized; [] before `ready()`."""
        if not self.ready():
            return []
        torch, paths = self._torch, self._paths
        assert paths is not None
        if self._read_stats is None:
            self._read_stats = getattr(
                torch._C, "_cuda_memoryStats", torch.cuda.memory_stats_as_nested_dict
            )
            self._read_fraction = getattr(torch._C, "_cuda_getMemoryFraction", False)
        if self._devices is None:
            self._devices = [
                index
                for index in range(torch.cuda.device_count())
                if has_context(torch, "cuda", index, self._with_context)
            ]
        now = time.time()
        found = []
        for index in self._devices:
            stats = self._read_stats(index)
            if not stats:
                continue
            try:
                values = self._read_values(stats)
            except (KeyError, TypeError):  # a torch without one of them: one by one
                values = record.values_from_stats(stats, paths)
            if index not in self._with_context and values[record.PEAK_RESERVED] <= 0:
                continue  # torch could not say, and this device was never used
            values[record.LIMIT] = self._limit(index)
            # Pinned host memory (PINNED) travels in the full sample: it moves when a server
            # pins its staging buffers, not per tick, and its read costs 20 us cold.
            if (values[record.RETRIES], values[record.OOMS]) != self._expected.get(index):
                self.moved = True
            self._sequence += 1
            pools = record.private_pools(stats)
            try:
                found.append(record.pack(index, self._sequence, now, values, pools))
            except (struct.error, TypeError):  # a value that is no int: checked one by one
                values = record.values_from_stats(stats, paths)
                values[record.LIMIT] = self._limit(index)
                found.append(record.pack(index, self._sequence, now, values, pools))
        return found

    def _limit(self, index: int) -> int:
        """The allocator's cap (fraction x the device's memory), as the full source reads it;
        ABSENT without a getter."""
        if not self._read_fraction:
            return record.ABSENT
        if index not in self._totals:
            self._totals[index] = int(self._torch.cuda.get_device_properties(index).total_memory)
        return int(min(self._read_fraction(index), 1.0) * self._totals[index])
