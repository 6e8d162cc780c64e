"""PyTorch's CUDA caching allocator, read from inside the process that uses it.

The rules that keep this safe for the host process come from measurements (docs/facts.md):
- touch device i only when CUDA is initialized and device i already has a primary context,
  because several "read-only" calls create a ~520 MB context on a device that had none;
- always pass an explicit device index: a new thread's current device is 0;
- read with `memory_stats_as_nested_dict(i)` (one C call, ~10 us) rather than
  `memory_stats(i)` (~60 us: it flattens and sorts in Python);
- on cudaMallocAsync and with expandable segments some numbers read 0 because they are not
  tracked, so they are left out instead of exported as 0.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from exporter.components import Components, registry
from exporter.oom_verdict import MAX_NAMED_POOLS, MAX_NAMED_PROCESSES, OomLog, OomVerdict
from exporter.pools import registry as pool_registry
from exporter.probe.allocator import has_context
from exporter.probe.record import (
    ASYNC,
    COUNTERS,
    CURRENT,
    PEAK,
    POOLS,
    family_defined,
)
from exporter.sample import POOL_GAUGES, AllocatorReading, PinnedHostReading, SourceReading
from exporter.sources import ALLOCATOR, OOM_VERDICTS
from exporter.sources.allocator_layout import (
    DEFAULT_INTERVAL_S,
    DEFAULT_MAX_BLOCKS,
    DeviceLayout,
    LayoutReader,
    bounded_pools,
    layouts_from_segments,
    pool_label,
    without_trace,
)
from exporter.sources.non_allocator import MemoryState, NonAllocatorReader, memory_state

NATIVE = "native"

# The allocator's stat families and what each becomes: one table for this source and the
# probe's record (exporter.probe.record, which the serving process imports alone).
_CURRENT, _PEAK, _COUNTERS, _POOLS = CURRENT, PEAK, COUNTERS, POOLS


def parse_alloc_conf(env: Mapping[str, str]) -> dict[str, str]:
    """Parse PYTORCH_CUDA_ALLOC_CONF (or its newer name PYTORCH_ALLOC_CONF) into key -> value."""
    raw = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF") or ""
    settings = {}
    for item in raw.split(","):
        key, sep, value = item.partition(":")
        if sep and key.strip():
            settings[key.strip()] = value.strip()
    return settings


# (family, pool, stat, metric key) for the gauges, (pool stat, pool name, family) for the
# per-pool gauges, and (stat, metric key) for the counters that one backend and setting define.
_Plan = tuple[
    tuple[tuple[str, str, str, str], ...],
    tuple[tuple[str, str, str], ...],
    tuple[tuple[str, str], ...],
]


@functools.cache
def _plan(backend: str, expandable_segments: bool) -> _Plan:
    """What to read from the nested stats dict, worked out once per backend and setting so
    that a read is a flat loop of lookups (it runs every tick for every device)."""

    def defined(family: str) -> bool:
        return family_defined(family, backend, expandable_segments)

    gauges = [(f, "all", "current", key) for f, key in _CURRENT.items() if defined(f)]
    gauges += [(f, "all", "peak", key) for f, key in _PEAK.items()]
    pools, counters = [], []
    if backend != ASYNC:
        pools = [
            (pool_stat, pool, family)
            for pool_stat, pool in _POOLS.items()
            for family in POOL_GAUGES
            if defined(family)
        ]
        counters = list(_COUNTERS.items())
    return tuple(gauges), tuple(pools), tuple(counters)


def allocator_reading_from_stats(
    stats: Mapping[str, Any],
    *,
    device: int,
    gpu_uuid: str,
    backend: str,
    expandable_segments: bool,
) -> AllocatorReading:
    """Turn one `memory_stats_as_nested_dict(i)` result into the numbers defined there."""
    gauge_plan, pool_plan, counter_plan = _plan(backend, expandable_segments)
    # Values are taken as they are: torch's C++ int64 stats arrive as Python ints (an int()
    # per value cost 1.5 of the 4 us this function took).
    gauges: dict[str, int] = {}
    # try/except, not `in` checks or contextlib.suppress: free when nothing is raised, and
    # this loop is most of the read's Python time. KeyError: a family this torch lacks.
    for family, pool, stat, key in gauge_plan:
        try:  # noqa: SIM105
            gauges[key] = stats[family][pool][stat]
        except KeyError:
            pass
    pools: dict[str, dict[str, int]] = {}
    for pool_stat, pool, family in pool_plan:
        try:
            value = stats[family][pool_stat]["current"]
        except KeyError:
            continue
        pools.setdefault(pool, {})[family] = value
    counters = {key: stats[stat] for stat, key in counter_plan if stat in stats}
    max_split = stats.get("max_split_size")
    # torch 2.13+: reserved bytes per private pool, keyed by pool id tuples; read every tick
    # (the snapshot adds allocated bytes at its own cadence).
    by_pool = stats.get("reserved_bytes_by_private_pools")
    private_pools = {}
    if isinstance(by_pool, Mapping):
        private_pools = bounded_pools(
            {
                pool_label(pool_id if isinstance(pool_id, tuple) else (pool_id,)): {
                    "reserved_bytes": value["all"]["current"]
                }
                for pool_id, value in by_pool.items()
            }
        )
    return AllocatorReading(
        device=device,
        gpu_uuid=gpu_uuid,
        backend=backend,
        expandable_segments=expandable_segments,
        gauges=gauges,
        counters=counters,
        pools=pools,
        max_split_size_bytes=max_split if isinstance(max_split, int) and max_split >= 0 else None,
        private_pools=private_pools,
    )


def block_count(stats: Mapping[str, Any], expandable_segments: bool) -> int:
    """An upper estimate of the blocks a snapshot would build for one device, from counts the
    stats already have: live allocations, free split blocks and one free block per segment.
    With expandable segments the last two are not tracked; free blocks sit between live ones
    there, so at most one more per allocation."""
    try:
        allocations = int(stats["allocation"]["all"]["current"])
        if expandable_segments:
            return 2 * allocations + 1
        split = int(stats["inactive_split"]["all"]["current"])
        return allocations + split + int(stats["segment"]["all"]["current"])
    except (KeyError, TypeError, ValueError):
        return 0


def nvml_uuid(uuid: object) -> str:
    """A device UUID as torch gives it, in NVML's spelling ("GPU-<uuid>"), so that allocator
    and device series join on gpu_uuid."""
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


# At most one layout read a second for allocation retries (a retry storm must not turn every
# tick of a 10 Hz exporter into a snapshot).
RETRY_LAYOUT_MIN_S = 1.0

# Live allocator settings kept per reading (scalars; the snapshot reports more).
_SETTINGS = ("expandable_segments", "garbage_collection_threshold", "max_split_size")


# What an embedded exporter says where the process's torch has no CUDA at all, instead of
# waiting for a GPU that this torch can never use.
NO_CUDA_BUILD = "this process's torch is built without CUDA (a CPU-only wheel): no GPU to read"


def _built_with_cuda(torch: Any) -> bool:
    version = getattr(torch, "version", None)
    if version is None:
        return True  # cannot tell: read as before
    return bool(getattr(version, "cuda", None) or getattr(version, "hip", None))


class TorchAllocatorSource:
    """Reads every CUDA device this process has already initialized; never initializes one."""

    name = "torch"
    provides = frozenset({ALLOCATOR, OOM_VERDICTS})

    def __init__(
        self,
        torch_module: Any = None,
        env: Mapping[str, str] | None = None,
        *,
        layout_interval_s: float = DEFAULT_INTERVAL_S,
        layout_max_blocks: int = DEFAULT_MAX_BLOCKS,
        non_allocator: NonAllocatorReader | None = None,
        components: Components | None = None,
    ) -> None:
        self._torch = torch_module
        # Takes this process's bytes outside the allocator from NVML (None: NVML is off).
        self._non_allocator = non_allocator
        self._env = os.environ if env is None else env
        self._layout_interval_s = layout_interval_s
        self._layout_max_blocks = layout_max_blocks
        self._layout: LayoutReader | None = None
        # The allocator snapshot's C call without its history trace, made once for the layout
        # and the OOM's snapshot alike: a torch that refuses that form is found out once.
        self._segments: Callable[[], Mapping[str, Any]] | None = None
        # What torch_cuda_allocator_info shows beyond backend, expandable segments and max
        # split size: what PYTORCH_CUDA_ALLOC_CONF said at start-up (worked out with the
        # backend, once), until the allocator reports its live settings in a snapshot.
        self._setting_labels: dict[str, str] = {}
        self._read_pinned: Any = None
        self._backend: str | None = None
        self._expandable: bool | None = None
        self._uuids: dict[int, str] = {}
        self._totals: dict[int, int] = {}
        self._read_fraction: Any = None  # torch's getter, False where it has none
        self._with_context: set[int] = set()
        self._read_stats: Any = None
        self._cpu_only: bool | None = None  # torch built without CUDA; None: not loaded yet
        # UUIDs of the GPUs read last time: the ones this process uses (the NVML source of
        # an embedded exporter reads only these).
        self.uuids_in_use: frozenset[str] = frozenset()
        # The verdicts of this process's OOMs (exporter.actions.oom writes them; every
        # reading carries its device's latest).
        self.ooms = OomLog()
        # What the server named its memory (exporter.component()); every reading carries its
        # device's.
        self.components = components if components is not None else registry()
        self._retries: dict[int, int] = {}  # alloc_retries by device at the last tick

    def component_problems(self) -> dict[str, int]:
        """What the ledger could not take as the server asked: its components' problems and
        the pool names refused (gpumem_exporter_component_problems), only those that happened."""
        found = self.components.problems()
        refused = pool_registry().refused
        if refused:
            found["pools_refused"] = refused
        return found

    def _load_torch(self) -> Any:
        # Never import torch here: a process that has not imported it is not using CUDA
        # through it, and importing it would cost the host seconds and hundreds of MB.
        if self._torch is None:
            self._torch = sys.modules.get("torch")
        return self._torch

    def _has_context(self, torch: Any, index: int) -> bool:
        return has_context(torch, "cuda", index, self._with_context)

    def _gpu_uuid(self, torch: Any, index: int) -> str:
        if index not in self._uuids:
            self._uuids[index] = nvml_uuid(torch.cuda.get_device_properties(index).uuid)
        return self._uuids[index]

    def _settings(self, torch: Any) -> tuple[str, bool]:
        if self._backend is None:
            self._backend = str(torch.cuda.get_allocator_backend())
            conf = parse_alloc_conf(self._env)
            self._expandable = conf.get("expandable_segments", "").lower() == "true"
            self._setting_labels = {
                "garbage_collection_threshold": conf.get("garbage_collection_threshold", ""),
                "source": "environment",
            }
        return self._backend, bool(self._expandable)

    def allocator_settings(self) -> tuple[str, bool] | None:
        """(backend, expandable segments) as the latest read found them; None before one.
        The probe's records define the same numbers a read does (exporter.probe.record)."""
        if self._backend is None:
            return None
        return self._backend, bool(self._expandable)

    def _without_cuda(self) -> bool:
        """Whether this process's torch is built without CUDA (known once torch is loaded)."""
        if self._cpu_only is None:
            torch = self._load_torch()
            if torch is None:
                return False
            self._cpu_only = not _built_with_cuda(torch)
        return self._cpu_only

    @property
    def idle_reason(self) -> str:
        """Why this process reports no GPU: a torch built without CUDA never will."""
        return NO_CUDA_BUILD if self._without_cuda() else "no GPU in use by this process (yet)"

    def non_allocator_retry_s(self) -> float | None:
        """When the bytes outside the allocator want another read (NonAllocatorReader)."""
        return self._non_allocator.retry_in() if self._non_allocator is not None else None

    def read(self) -> SourceReading:
        if self._without_cuda():
            return SourceReading(unavailable=NO_CUDA_BUILD)
        torch = self._load_torch()
        if torch is None or not torch.cuda.is_initialized():
            return SourceReading()
        backend, expandable = self._settings(torch)
        if self._read_stats is None:
            # The C call itself (what memory_stats_as_nested_dict wraps, after checks this
            # loop already made): 1-2 us less per device and tick.
            self._read_stats = getattr(
                torch._C, "_cuda_memoryStats", torch.cuda.memory_stats_as_nested_dict
            )
        layout = self._layout_reader(torch, backend)
        readings = []
        # Each device's stats: the layout's block count when it is due, and this tick's
        # numbers again where the layout's snapshot finds the settings changed.
        read_stats: dict[int, Any] = {}
        for index in range(torch.cuda.device_count()):
            if not self._has_context(torch, index):
                continue
            stats = self._read_stats(index)
            if not stats:
                continue
            read_stats[index] = stats
            reading = allocator_reading_from_stats(
                stats,
                device=index,
                gpu_uuid=self._gpu_uuid(torch, index),
                backend=backend,
                expandable_segments=expandable,
            )
            if index not in self._with_context and not reading.gauges.get("reserved_peak_bytes"):
                continue  # fallback path: a device this process never used
            limit = self._memory_limit(torch, index)
            if limit is not None:
                reading.gauges["memory_limit_bytes"] = limit
            readings.append(reading)
        self.uuids_in_use = frozenset(reading.gpu_uuid for reading in readings)
        if self._non_allocator is not None:
            self._non_allocator.apply(readings, self._state_now)
        if readings and layout is not None:
            due = self._retries_rose(readings) or layout.due()
            blocks = sum(block_count(st, expandable) for st in read_stats.values()) if due else 0
            self._add_layout(layout, due, readings, blocks)
            if self._expandable != expandable:
                self._replan(readings, read_stats)
        pools = pool_registry()
        for reading in readings:
            reading.settings = dict(self._setting_labels)
            reading.components = self.components.on_device(reading.device)
            reading.private_pool_info = {
                label: pools.describe(label) for label in reading.private_pools
            }
        self.ooms.annotate(readings)
        return SourceReading(allocators=readings, pinned_host=self._pinned_host(torch))

    def _replan(self, readings: list[AllocatorReading], read_stats: Mapping[int, Any]) -> None:
        """The snapshot just said the server switched expandable segments (vLLM does, around
        its CuMem pool): this tick's numbers are taken again from the same stats under the
        setting in force (it decides which are defined), so that the switch shows in this
        reading, not one detail interval later (seen on an H200)."""
        for reading in readings:
            again = allocator_reading_from_stats(
                read_stats[reading.device],
                device=reading.device,
                gpu_uuid=reading.gpu_uuid,
                backend=reading.backend,
                expandable_segments=bool(self._expandable),
            )
            limit = reading.gauges.get("memory_limit_bytes")
            if limit is not None:
                again.gauges["memory_limit_bytes"] = limit
            reading.expandable_segments = again.expandable_segments
            reading.gauges, reading.pools = again.gauges, again.pools

    def _retries_rose(self, readings: list[AllocatorReading]) -> bool:
        """Whether an allocation retry happened since the last tick (and the layout was not
        read in the last second): the layout is read at once, so that the cache's holes and
        largest free block are those of the retry (what GpuMemAllocRetries says is building)."""
        rose = False
        for reading in readings:
            retries = reading.counters.get("alloc_retries")
            before = self._retries.get(reading.device)
            if retries is not None:
                self._retries[reading.device] = retries
                rose = rose or (before is not None and retries > before)
        latest = self._layout.latest if self._layout is not None else None
        return rose and (latest is None or time.time() - latest.timestamp >= RETRY_LAYOUT_MIN_S)

    def _memory_limit(self, torch: Any, index: int) -> int | None:
        """The allocator's cap on this device, as it computes it (fraction x total memory).
        Read every tick: a server may set the fraction at any time. None where torch has no
        getter (before 2.8)."""
        if self._read_fraction is None:  # looked up once: this runs every tick
            self._read_fraction = getattr(torch._C, "_cuda_getMemoryFraction", False)
        fraction = self._read_fraction
        if not fraction:
            return None
        # cudaMallocAsync answers 2^64 / total memory where no cap is set (measured on an
        # H100, torch 2.11): a cap above the device's memory is the device's memory.
        return int(min(fraction(index), 1.0) * self._total(torch, index))

    def _total(self, torch: Any, index: int) -> int:
        """The device's memory, read once."""
        if index not in self._totals:
            self._totals[index] = int(torch.cuda.get_device_properties(index).total_memory)
        return self._totals[index]

    def _state_now(self, index: int) -> MemoryState:
        """Device `index`'s reserved bytes and segment counts read again (the non-allocator
        probe's second reading)."""
        return memory_state(self._read_stats(index))

    def _layout_reader(self, torch: Any, backend: str) -> LayoutReader | None:
        if self._layout is None and backend == NATIVE and self._layout_interval_s > 0:
            if getattr(torch._C, "_cuda_memorySnapshot", None) is None:
                return None
            history = getattr(torch._C, "_cuda_isHistoryEnabled", lambda: False)
            self._layout = LayoutReader(
                # Every device and pool, without the history trace (the reader does not run
                # while history recording is on).
                self._segments_snapshot(torch),
                history_enabled=history,
                interval_s=self._layout_interval_s,
                max_blocks=self._layout_max_blocks,
            )
        return self._layout

    def _segments_snapshot(self, torch: Any) -> Callable[[], Mapping[str, Any]]:
        if self._segments is None:
            self._segments = without_trace(torch._C._cuda_memorySnapshot)
        return self._segments

    def _add_layout(
        self, reader: LayoutReader, due: bool, readings: list[AllocatorReading], blocks: int
    ) -> None:
        """Attach the latest layout (reading a new one when due) to this tick's readings."""
        if due:
            read = reader.read(blocks)
            if read.settings:
                live_settings = {k: read.settings[k] for k in _SETTINGS if k in read.settings}
                self._setting_labels = {**live_settings, "source": "live"}
                live = read.settings.get("expandable_segments", "").lower()
                if live in ("true", "false"):
                    # Settings can change at run time (torch.cuda.memory._set_allocator_settings)
                    self._expandable = live == "true"
        latest = reader.latest
        if latest is None:
            return
        age = max(time.time() - latest.timestamp, 0.0)
        for reading in readings:
            reading.layout_skipped = latest.skipped
            if latest.skipped:
                continue
            # A device with no segments at all has nothing free: zeros, not "unknown".
            layout = latest.layouts.get(reading.device) or DeviceLayout()
            reading.layout = layout.as_gauges()
            reading.layout_age_s = age
            pools = {label: dict(values) for label, values in layout.private_pools.items()}
            for label, values in reading.private_pools.items():  # the stats' own, fresher
                pools.setdefault(label, {}).update(values)
            reading.private_pools = pools

    # -- at an OOM (exporter.actions.oom calls these from PyTorch's OOM observer) ----------

    def light_snapshot(self) -> Mapping[str, Any]:
        """The allocator's segments without its history trace (0.2-0.7 ms on an H100 where
        the full dump with history stalled 0.3-0.8 s). Raises where it would stall the
        OOM-ing thread: with history recording on, every block's stack becomes Python objects."""
        torch = self._load_torch()
        if getattr(torch._C, "_cuda_isHistoryEnabled", lambda: False)():
            raise RuntimeError("history recording is on: a snapshot would build every stack")
        # Bounded like the layout (~0.7 us a block): 7.8 ms at 10k blocks on an H100.
        read = self._read_stats or torch.cuda.memory_stats_as_nested_dict
        blocks = sum(block_count(read(i), bool(self._expandable)) for i in self._with_context)
        if blocks > self._layout_max_blocks:
            raise RuntimeError(f"{blocks} blocks: a snapshot would stall the OOM-ing thread")
        return self._segments_snapshot(torch)()

    def read_oom(
        self,
        device: int,
        requested: int,
        limit_or_total: int,
        device_free: int,
        segments: Any = None,
        missing: list[str] | None = None,
    ) -> OomVerdict:
        """The readings that decide an OOM's verdict (not yet decided), each taken on its own:
        one that fails is left None and named in `missing`, never raised. Arguments are the
        OOM observer's own; `segments` those of a snapshot taken in the same observer call."""
        torch = self._load_torch()
        missing = list(missing or [])
        reading = OomVerdict(device, time.time(), int(requested), device_free_bytes=device_free)
        values: dict[str, Any] = {}
        try:
            stats = (self._read_stats or torch.cuda.memory_stats_as_nested_dict)(device)
            values["reserved_bytes"] = int(stats["reserved_bytes"]["all"]["current"])
            values["allocated_bytes"] = int(stats["allocated_bytes"]["all"]["current"])
        except Exception as exc:
            missing.append(f"allocator stats: {exc!r:.120}")
        try:
            total = values["device_total_bytes"] = self._total(torch, device)
            # The observer passes the cap where a fraction is set, else the device's memory.
            fraction = getattr(torch._C, "_cuda_getMemoryFraction", None)
            capped = fraction(device) < 1.0 if fraction else limit_or_total < total
            values["memory_limit_bytes"] = int(limit_or_total) if capped else None
        except Exception as exc:
            missing.append(f"device total: {exc!r:.120}")
        values.update(self._oom_layout(device, segments, values, missing))
        try:
            if self._non_allocator is None:
                raise RuntimeError("NVML is off (GPUMEM_NVML)")
            own, others = self._non_allocator.at_oom(self._gpu_uuid(torch, device))
            values["other_processes_bytes"] = sum(used for _, used in others)
            values["other_processes"] = [list(p) for p in others[:MAX_NAMED_PROCESSES]]
            if own is not None and "reserved_bytes" in values:
                values["outside_allocator_bytes"] = max(own - values["reserved_bytes"], 0)
        except Exception as exc:
            missing.append(f"other processes: {exc!s:.120}")
        try:
            # Known without a tick: the OOM may be the process's first allocation.
            values["expandable_segments"] = self._settings(torch)[1]
        except Exception as exc:
            values["expandable_segments"] = bool(self._expandable)
            missing.append(f"allocator settings: {exc!r:.120}")
        return replace(reading, **values, missing="; ".join(missing))

    def _oom_layout(
        self, device: int, segments: Any, values: Mapping[str, Any], missing: list[str]
    ) -> dict[str, Any]:
        """Holes, the largest free block and the private pools' free bytes from the observer's
        snapshot; without one, the holes as reserved - allocated (after PyTorch's flush, the
        cache that is left is holes) and no largest block."""
        if segments is not None:
            try:
                layout = layouts_from_segments(segments).get(device) or DeviceLayout()
                free = {
                    pool: sums["reserved_bytes"] - sums.get("allocated_bytes", 0)
                    for pool, sums in layout.private_pools.items()
                }
                most = sorted(free.items(), key=lambda item: item[1], reverse=True)
                most = most[:MAX_NAMED_POOLS]
                names = pool_registry().names()
                return {
                    "free_in_holes_bytes": layout.default_pool_free_bytes,
                    "largest_free_block_bytes": layout.largest_free_block_bytes,
                    "private_pools_free_bytes": sum(free.values()),
                    "private_pools_free": dict(most),
                    "private_pool_names": {pool: names[pool] for pool, _ in most if pool in names},
                }
            except Exception as exc:
                missing.append(f"allocator layout: {exc!r:.120}")
        if "reserved_bytes" in values and "allocated_bytes" in values:
            holes = values["reserved_bytes"] - values["allocated_bytes"]
            return {"free_in_holes_bytes": max(holes, 0)}
        return {}

    def _pinned_host(self, torch: Any) -> list[PinnedHostReading]:
        """Pinned host memory of PyTorch's caching host allocator: one C call (5-8 us on an
        H200 host), which creates no CUDA context (measured, docs/facts.md)."""
        if self._read_pinned is None:
            self._read_pinned = getattr(torch._C, "_cuda_hostMemoryStats", False)
        if not self._read_pinned:
            return []
        stats = self._read_pinned()
        try:
            held = int(stats["allocated_bytes"]["current"])
            in_use = int(stats["active_bytes"]["current"])
        except (KeyError, TypeError, ValueError):
            return []
        return [PinnedHostReading(held_bytes=held, in_use_bytes=in_use)]

    def close(self) -> None:
        if self._non_allocator is not None:
            self._non_allocator.close()
