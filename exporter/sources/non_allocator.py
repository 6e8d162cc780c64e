"""This process's GPU memory outside PyTorch's caching allocator, from readings that belong
together.

The value is NVML's per-process used minus the allocator's reserved: CUDA context, NCCL,
library workspaces. Both move while a server works, so a value built from a process list of
one moment and a reserved of another is off by whatever moved in between (seen on an H100:
768 MiB published where the truth was 518). Here the process list is read between two reads
of the allocator's state (reserved and its counts of cudaMalloc and cudaFree calls), and a
value is taken only when they agree; otherwise the last value taken stays, with its age.
Reserved alone is not enough: a segment allocated and freed again between the two reads
(a server emptying its cache) leaves it equal while the list saw the segment (an H100 under
such churn served values 92 MiB off in a third of its scrapes). The allocator's stats are
read under the same mutex that cudaMalloc and cudaFree run under, so equal states before and
after mean the list saw that reserved.

When: on the first tick, whenever reserved or the device's used memory (NVML's cheap device
reading, ~5 us) moved since the value was taken, and every `refresh_s` while the device's used
memory is not exactly what it was then. Where it is, to the byte, and reserved too, nothing on
the GPU took or gave back memory since the list was read, so this process's share has not
moved either (only another process changing by exactly the opposite amount at once could hide
a change): the list is then read every STEADY_REFRESHES x `refresh_s`. The list is the
costliest part of what a serving process reads every 10 s (~290 us of CPU on cold caches on an
H200, docs/performance.md), and a server's GPU memory stands still most of the time. The
process owning the allocator does this itself, embedded or as an agent under `run`: readings
from two processes are never of one moment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from exporter.sample import AllocatorReading
from exporter.sources.nvml import CHANGE_BYTES, INIT_RETRY_S
from exporter.sources.own_process_reads import OwnProcessReads

if TYPE_CHECKING:
    from exporter.config import Config

log = logging.getLogger(__name__)

# A GPU without a value yet (no agreeing readings, or NVML not listing this process, as right
# after the process made its context) is tried again after this, then after twice as long
# each time, up to refresh_s: soon for a process that just started, rarely for one NVML will
# never list (another PID namespace).
FIRST_RETRY_S = 0.5
# The list's period, in refresh_s, while the device's used memory and reserved are exactly as
# they were when it was last read (see the module's doc).
STEADY_REFRESHES = 6


# (reserved bytes, cudaMalloc calls, cudaFree calls) of one device; a count is None where the
# allocator does not keep it (cudaMallocAsync): reserved alone is compared there.
MemoryState = tuple[int | None, int | None, int | None]


def memory_state(stats: Any) -> MemoryState:
    """The state of one nested stats dict (`_cuda_memoryStats(i)`), what apply() compares."""

    def number(value: Any) -> int | None:
        return value if type(value) is int else None

    try:
        reserved = number(stats["reserved_bytes"]["all"]["current"])
    except (KeyError, TypeError):
        reserved = None
    try:
        return reserved, number(stats.get("num_device_alloc")), number(stats.get("num_device_free"))
    except AttributeError:
        return reserved, None, None


def reading_state(reading: AllocatorReading) -> MemoryState:
    """The same state, as the reading (read before the list) has it."""
    counters = reading.counters
    return (
        reading.gauges.get("reserved_bytes"),
        counters.get("device_malloc"),
        counters.get("device_free"),
    )


def _agree(before: MemoryState, after: MemoryState) -> bool:
    """Reserved equal, and each count the reading has (none under cudaMallocAsync) too."""
    return before[0] == after[0] and all(
        was is None or was == now for was, now in zip(before[1:], after[1:], strict=True)
    )


@dataclass(frozen=True)
class _Taken:
    """The last agreeing reading of one GPU, and what it was taken against."""

    value: int | None  # None: NVML did not list this process (another PID namespace)
    at: float
    reserved: int
    device_used: int


class NonAllocatorReader:
    """Fills AllocatorReading.non_allocator_bytes/_age_s for this process's own readings."""

    def __init__(
        self,
        nvml_module: Any = None,
        *,
        refresh_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        pid: Callable[[], int] = os.getpid,
    ) -> None:
        self._nvml = nvml_module
        self._refresh_s = refresh_s
        self._clock = clock
        self._pid = pid
        self._handles: dict[str, Any] = {}
        self._reads: OwnProcessReads | None = None  # made once NVML is initialized
        self._ready = False
        self._next_init = 0.0
        self._taken: dict[str, _Taken] = {}
        # GPUs without a value: when to try again, and the wait that gave that time.
        self._retry: dict[str, tuple[float, float]] = {}

    @classmethod
    def for_config(cls, config: Config) -> NonAllocatorReader | None:
        """The probe a process runs with these settings; None where NVML is turned off."""
        return cls(refresh_s=config.process_interval_s) if config.nvml else None

    def _init(self) -> bool:
        if self._ready:
            return True
        now = self._clock()
        if now < self._next_init:
            return False
        self._next_init = now + INIT_RETRY_S
        try:
            if self._nvml is None:
                import pynvml  # nvidia-ml-py

                self._nvml = pynvml
            self._nvml.nvmlInit()
        except Exception as exc:  # no library, no driver: no value, the NVML source says why
            log.debug("non-allocator bytes unavailable: %s", exc)
            return False
        self._reads = OwnProcessReads(self._nvml)
        self._ready = True
        return True

    def _handle(self, uuid: str) -> Any:
        if uuid not in self._handles:
            self._handles[uuid] = self._nvml.nvmlDeviceGetHandleByUUID(uuid)
        return self._handles[uuid]

    def apply(
        self, readings: list[AllocatorReading], state_now: Callable[[int], MemoryState]
    ) -> None:
        """Set the value on this tick's readings; `state_now(device)` reads the allocator's
        state again (after the process list). Never raises: a GPU NVML cannot read gets no
        value."""
        if not readings or not self._init():
            return
        for reading in readings:
            try:
                self._apply(reading, state_now)
            except Exception as exc:  # NVMLError (lost GPU, not supported) or a torch error
                log.debug("non-allocator bytes of GPU %s: %s", reading.gpu_uuid, exc)

    def _apply(self, reading: AllocatorReading, state_now: Callable[[int], MemoryState]) -> None:
        reserved = reading.gauges.get("reserved_bytes")
        if reserved is None:
            return
        reads = self._reads
        assert reads is not None  # _init() made it
        handle = self._handle(reading.gpu_uuid)
        now = self._clock()
        taken = self._taken.get(reading.gpu_uuid)
        device_used = reads.device_used(handle)
        retry = self._retry.get(reading.gpu_uuid)
        due = (
            taken is None
            or taken.reserved != reserved
            or abs(taken.device_used - device_used) > CHANGE_BYTES
            or now - taken.at >= self._refresh_s * self._periods(taken, device_used)
            or (retry is not None and now >= retry[0])
        )
        if due:
            used = reads.used_by(handle, self._pid())
            # The state again, after the list: equal means the list saw this reserved.
            if _agree(reading_state(reading), state_now(reading.device)):
                value = max(used - reserved, 0) if used is not None else None
                taken = _Taken(value, now, reserved, device_used)
                self._taken[reading.gpu_uuid] = taken
            if taken is not None and taken.value is not None:
                self._retry.pop(reading.gpu_uuid, None)
            else:
                wait = min(retry[1] * 2 if retry else FIRST_RETRY_S, self._refresh_s)
                self._retry[reading.gpu_uuid] = (now + wait, wait)
        if taken is not None and taken.value is not None:
            reading.non_allocator_bytes = taken.value
            reading.non_allocator_age_s = max(now - taken.at, 0.0)

    @staticmethod
    def _periods(taken: _Taken, device_used: int) -> int:
        """How many refresh_s the list may wait: more while the GPU's used memory is, to the
        byte, what it was when the list was read (reserved equal is checked beside this)."""
        return STEADY_REFRESHES if device_used == taken.device_used else 1

    def retry_in(self) -> float | None:
        """Seconds until a GPU without a value is to be tried again (0: now); None where
        every GPU read has one. A caller reading less often than every tick (`run`'s agent,
        its full sample every 10 s) reads again then."""
        if not self._retry:
            return None
        return max(min(at for at, _ in self._retry.values()) - self._clock(), 0.0)

    def at_oom(self, uuid: str) -> tuple[int | None, list[tuple[int, int]]]:
        """(this process's used bytes, [(pid, bytes)] of the other processes, biggest first)
        as NVML lists them on this GPU (~45 us: read only at an OOM). Raises where the
        answer would be a guess: NVML not readable, or this process not in the list (another
        PID namespace: one of the entries may be this process)."""
        if not self._init():
            raise RuntimeError("NVML is not readable here")
        pid = self._pid()
        entries = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle(uuid))
        own = [e.usedGpuMemory for e in entries if e.pid == pid]
        if not own:
            raise RuntimeError(f"NVML does not list pid {pid} (another PID namespace?)")
        others = [(int(e.pid), int(e.usedGpuMemory or 0)) for e in entries if e.pid != pid]
        used = int(own[0]) if own[0] is not None else None
        return used, sorted(others, key=lambda other: other[1], reverse=True)

    def close(self) -> None:
        if self._ready and self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._ready = False
            self._handles.clear()
            self._reads = None
