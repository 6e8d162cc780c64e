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
        self._devices: list[tuple[int, int]] | None = None  # (index, total memory)
        self._ready = False  # CUDA initialized (it never goes back, but in a forked child)
        self._totals: dict[int, int] = {}
        self._paths: tuple[tuple[str, str, str] | None, ...] | None = None
        self._settings: tuple[str, bool] | None = None  # what the paths were planned for
        self._pack: Any = None  # record.packer() for the settings in force
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
            self._pack = record.packer(self._paths)
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
        """One record per device this process initialized; [] before `ready()`. Per device:
        the C call, the limit's getter and one compiled call into struct (record.packer);
        the checked path only where that one cannot take the stats (private pools, a value
        that is no int, a family this torch lacks)."""
        if not self._ready and not self.ready():
            return []
        if self._devices is None:
            self._find_devices()
        read, fraction, pack = self._read_stats, self._read_fraction, self._pack
        expected = self._expected
        now = time.time()
        found = []
        for index, total in self._devices or ():
            stats = read(index)
            if not stats:
                continue
            limit = int(min(fraction(index), 1.0) * total) if fraction else record.ABSENT
            self._sequence += 1
            try:
                if record.PRIVATE_POOLS_KEY in stats:
                    raise KeyError(record.PRIVATE_POOLS_KEY)  # pools follow: the checked path
                data, counts = pack(stats, index, self._sequence, now, limit)
            except (KeyError, TypeError, struct.error):
                data, counts = self._checked(stats, index, now, limit)
            if index not in self._with_context and not self._was_used(stats):
                continue  # torch could not say, and this device was never used
            if counts != expected.get(index):
                self.moved = True
            found.append(data)
        return found

    def _find_devices(self) -> None:
        """The devices this process initialized, with each one's memory (for the limit);
        what to read them with, looked up once."""
        torch = self._torch
        if self._read_stats is None:
            self._read_stats = getattr(
                torch._C, "_cuda_memoryStats", torch.cuda.memory_stats_as_nested_dict
            )
            self._read_fraction = getattr(torch._C, "_cuda_getMemoryFraction", False)
        devices = []
        for index in range(torch.cuda.device_count()):
            if has_context(torch, "cuda", index, self._with_context):
                if index not in self._totals and self._read_fraction:
                    properties = torch.cuda.get_device_properties(index)
                    self._totals[index] = int(properties.total_memory)
                devices.append((index, self._totals.get(index, 0)))
        self._devices = devices

    def _checked(
        self, stats: Any, index: int, now: float, limit: int
    ) -> tuple[bytes, tuple[int, int]]:
        """The record read number by number (values_from_stats), with the private pools."""
        assert self._paths is not None
        values = record.values_from_stats(stats, self._paths)
        values[record.LIMIT] = limit
        pools = record.private_pools(stats)
        data = record.pack(index, self._sequence, now, values, pools)
        return data, (values[record.RETRIES], values[record.OOMS])

    @staticmethod
    def _was_used(stats: Any) -> bool:
        try:
            return int(stats["reserved_bytes"]["all"]["peak"]) > 0
        except (KeyError, TypeError, ValueError):
            return False
