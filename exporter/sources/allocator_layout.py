"""The allocator's layout, from a segments-only snapshot: what its counters cannot say.

`memory_stats` counts bytes; it cannot say whether the next big allocation fits in the cache
(that needs the largest free block), it does not track fragmentation with expandable segments
(pytorch/pytorch#159564), and before torch 2.13 it has no per-private-pool bytes (CUDA-graph
pools, MemPools). The allocator snapshot has all three, but taking it holds the allocator's
mutex and builds a Python object per block while holding the GIL: a stall of the serving
thread that grows with the number of blocks (docs/performance.md). So it is read at its own
slow cadence, never when there are too many blocks, and never while history recording would
make the snapshot build stack frames for every block.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The pool every ordinary allocation comes from; CUDA graphs and MemPools get their own ids.
DEFAULT_POOL = (0, 0)
# Private pools beyond this many per device (the biggest are kept) are summed as "other":
# torch.compile's CUDA-graph trees can make one pool per graph.
MAX_PRIVATE_POOLS = 16

DEFAULT_INTERVAL_S = 10.0
DEFAULT_MAX_BLOCKS = 10_000


# torch 2.11+: every pool (the default pool's id), without the history trace. The trace is
# empty while history is off, but asking for it (None) still costs the C call ~220 us of CPU:
# 303 against 81 us at 1 Hz on an H200, torch 2.11 (`python -m bench.probe_ticks
# --snapshot-forms`, docs/performance.md).
WITHOUT_TRACE = (0, 0, False)


def without_trace(snapshot: Callable[[Any], Mapping[str, Any]]) -> Callable[[], Mapping[str, Any]]:
    """The snapshot's C call (torch._C._cuda_memorySnapshot) asked for every pool without its
    history trace; where torch takes no such argument (TypeError or RuntimeError), asked with
    None (every pool) from then on."""
    form: list[Any] = [WITHOUT_TRACE]

    def take() -> Mapping[str, Any]:
        try:
            return snapshot(form[0])
        except (TypeError, RuntimeError):
            if form[0] is None:
                raise
            form[0] = None
            return snapshot(None)

    return take


def pool_label(pool_id: Iterable[int]) -> str:
    """A pool id as memory_stats spells it when it flattens `reserved_bytes_by_private_pools`:
    (0, 1) -> "0_1"."""
    return "_".join(str(part) for part in pool_id)


@dataclass
class DeviceLayout:
    """One device's layout, summed from its snapshot segments."""

    # The biggest inactive block of the default pool: the biggest request that fits without
    # a new cudaMalloc (or, with expandable segments, a new cuMemMap).
    largest_free_block_bytes: int = 0
    # Inactive bytes in the default pool: cache an ordinary allocation could reuse.
    default_pool_free_bytes: int = 0
    # Inactive bytes inside segments that also hold live blocks, in every pool: what
    # inactive_split_bytes counts on the native allocator, but defined with expandable
    # segments too.
    free_in_used_segments_bytes: int = 0
    blocks: int = 0
    # pool label -> {"reserved_bytes": ..., "allocated_bytes": ...}, private pools only
    private_pools: dict[str, dict[str, int]] = field(default_factory=dict)

    def as_gauges(self) -> dict[str, int]:
        return {
            "largest_free_block_bytes": self.largest_free_block_bytes,
            "default_pool_free_bytes": self.default_pool_free_bytes,
            "free_in_used_segments_bytes": self.free_in_used_segments_bytes,
        }


def layouts_from_segments(segments: Iterable[Mapping[str, Any]]) -> dict[int, DeviceLayout]:
    """Sum snapshot segments per device.

    Only segments with free bytes and live bytes are walked block by block (a full segment has
    no free block, an empty one is one free block of its size), so the walk costs little more
    than the snapshot that built the blocks.
    """
    layouts: dict[int, DeviceLayout] = {}
    for segment in segments:
        device = int(segment["device"])
        layout = layouts.get(device)
        if layout is None:
            layout = layouts[device] = DeviceLayout()
        total = segment["total_size"]
        active = segment["active_size"]
        free = total - active
        blocks = segment["blocks"]
        layout.blocks += len(blocks)
        pool_id = tuple(segment.get("segment_pool_id") or DEFAULT_POOL)
        if pool_id != DEFAULT_POOL:
            sums = layout.private_pools.setdefault(
                pool_label(pool_id), {"reserved_bytes": 0, "allocated_bytes": 0}
            )
            sums["reserved_bytes"] += total
            sums["allocated_bytes"] += segment["allocated_size"]
        if active > 0:
            layout.free_in_used_segments_bytes += free
        if pool_id != DEFAULT_POOL or free <= 0:
            continue
        layout.default_pool_free_bytes += free
        if active == 0:
            largest = total
        else:
            largest = max(
                (b["size"] for b in blocks if b["state"] == "inactive"),
                default=0,
            )
        layout.largest_free_block_bytes = max(layout.largest_free_block_bytes, largest)
    for layout in layouts.values():
        layout.private_pools = bounded_pools(layout.private_pools)
    return layouts


def bounded_pools(pools: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """At most MAX_PRIVATE_POOLS pools, the biggest by reserved bytes; the rest summed as
    "other" (a label per pool would let torch.compile's graph trees grow the series)."""
    ranked = sorted(pools.items(), key=lambda item: item[1].get("reserved_bytes", 0), reverse=True)
    result = {label: dict(values) for label, values in ranked[:MAX_PRIVATE_POOLS]}
    other: dict[str, int] = {}
    for _, values in ranked[MAX_PRIVATE_POOLS:]:
        for key, value in values.items():
            other[key] = other.get(key, 0) + value
    if other:
        result["other"] = other
    return result


@dataclass
class LayoutRead:
    """The outcome of one attempt: layouts by device, or why there are none."""

    layouts: dict[int, DeviceLayout]
    timestamp: float
    duration_s: float = 0.0
    skipped: str = ""  # why nothing was read ("" when read)
    error: str = ""  # with skipped == "error"
    settings: dict[str, str] = field(default_factory=dict)  # snapshot's allocator_settings


class LayoutReader:
    """Takes a segments-only snapshot every `interval_s`, unless it would stall the host.

    `snapshot` is the C call (torch._C._cuda_memorySnapshot); `history_enabled` says whether
    history recording is on (then every block carries stack frames that the snapshot turns
    into Python objects under the GIL: 0.1-0.45 s at 10k blocks, docs/performance.md).
    """

    def __init__(
        self,
        snapshot: Callable[[], Mapping[str, Any]],
        *,
        history_enabled: Callable[[], bool] = lambda: False,
        interval_s: float = DEFAULT_INTERVAL_S,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._snapshot = snapshot
        self._history_enabled = history_enabled
        self.interval_s = interval_s
        self.max_blocks = max_blocks
        self._clock = clock
        self._next = 0.0
        self.latest: LayoutRead | None = None

    def due(self) -> bool:
        return self.interval_s > 0 and self._clock() >= self._next

    def read(self, blocks: int) -> LayoutRead:
        """Read now (the caller checked `due`); `blocks` is the allocator's own count of
        blocks on the devices read, from the stats of the same tick."""
        now = self._clock()
        self._next = now + self.interval_s
        wall = time.time()
        if blocks > self.max_blocks:
            result = LayoutRead({}, wall, skipped="too_many_blocks")
        elif self._history_enabled():
            result = LayoutRead({}, wall, skipped="history_recording")
        else:
            start = time.perf_counter()
            try:
                snapshot = self._snapshot()
                layouts = layouts_from_segments(snapshot.get("segments", ()))
            except Exception as exc:  # a torch that changed the snapshot's shape
                self.latest = LayoutRead({}, wall, skipped="error", error=f"{exc!r:.200}")
                return self.latest
            settings = snapshot.get("allocator_settings") or {}
            result = LayoutRead(
                layouts,
                wall,
                duration_s=time.perf_counter() - start,
                settings={
                    str(k): str(v).lower() if isinstance(v, bool) else str(v)
                    for k, v in settings.items()
                    if isinstance(v, (bool, int, float, str))
                },
            )
        self.latest = result
        return result
