"""The probe's record: one device's allocator numbers of one tick, in a fixed binary layout.

A serving process pays for every byte of Python it runs per tick, so the numbers the exporter
serves go out as they come from the allocator's nested stats dict, packed with `struct` into
a buffer made once: no dataclass, no dict of results, no JSON. Everything else a reading has
(the GPU's UUID, backend, settings, layout, OOM verdicts, bytes outside the allocator) changes
at its own, slower pace and travels in the full sample (exporter.transport.protocol), which a record
then updates.

    header   magic "GMPR", version, size in bytes, device, sequence, Unix time, private-pool
             count (the first three stay where they are in every version: a reader of a
             byte stream finds where a record of any version ends)
    values   one int64 per FIELDS entry, ABSENT where the allocator does not define it
    pools    (pool id, pool id, reserved bytes) for each private pool

Versioned: a reader refuses a record of another version (RecordError("record_version")),
never misreads one. Records travel as they are (no base64, no line): the stream they share
with JSON lines tells them apart by their magic (exporter.transport.protocol.StreamReader).
Standard library only: the probe imports it in the serving process.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Any

MAGIC = b"GMPR"
# 1: sent as a base64 line; 2: as it is, with its size in the header.
VERSION = 2
ABSENT = -(1 << 63)  # a number the allocator does not define here (never a real value)
# At most this many private pools per device travel in a record (the exporter serves 16 plus
# "other"; the rest are summed by the reader's budget, which needs to see them all).
MAX_POOLS = 64

PREFIX = struct.Struct("<4sHH")  # magic, version, size: the same in every version
HEADER = struct.Struct("<4sHHHIdH")
POOL = struct.Struct("<QQq")

# Allocator stat family -> the reading's gauge key, for `.all.current` and `.all.peak`.
CURRENT = {
    "allocated_bytes": "allocated_bytes",
    "reserved_bytes": "reserved_bytes",
    "active_bytes": "active_bytes",
    "inactive_split_bytes": "inactive_split_bytes",
    "requested_bytes": "requested_bytes",
    "segment": "segments",
    "allocation": "allocations",
}
PEAK = {
    "allocated_bytes": "allocated_peak_bytes",
    "reserved_bytes": "reserved_peak_bytes",
}
COUNTERS = {
    "num_alloc_retries": "alloc_retries",
    "num_ooms": "ooms",
    "num_device_alloc": "device_malloc",
    "num_device_free": "device_free",
    "num_sync_all_streams": "sync_all_streams",
}
POOLS = {"large_pool": "large", "small_pool": "small"}
# The per-pool gauges (catalog group "pool"; tests/probe/test_record.py holds them equal).
POOL_GAUGES = (
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
# What cudaMallocAsync actually tracks (everything else reads 0 there).
ASYNC_DEFINED = {"allocated_bytes", "reserved_bytes", "active_bytes"}
# Expandable segments are left out of inactive_split on purpose (pytorch/pytorch#159564) and
# the segment count collapses (read 0 with 280 MB reserved on an H200): 0 there means "not
# tracked", not "no fragmentation".
NOT_TRACKED_WITH_EXPANDABLE = {"inactive_split_bytes", "segment"}
ASYNC = "cudaMallocAsync"

# (where it goes in a reading, its key) in record order. "gauge": AllocatorReading.gauges;
# "pool:<name>": .pools[name]; "counter": .counters; "max_split": .max_split_size_bytes;
# "pinned": the process's pinned host memory (held, in use), the same in each device's record.
FIELDS: tuple[tuple[str, str], ...] = (
    *(("gauge", key) for key in CURRENT.values()),
    *(("gauge", key) for key in PEAK.values()),
    ("gauge", "memory_limit_bytes"),
    *((f"pool:{pool}", family) for pool in POOLS.values() for family in POOL_GAUGES),
    *(("counter", key) for key in COUNTERS.values()),
    ("max_split", "max_split_size_bytes"),
    ("pinned", "held_bytes"),
    ("pinned", "in_use_bytes"),
)
VALUES = struct.Struct("<" + "q" * len(FIELDS))
# Header and values in one call: a tick packs with one struct call where no pool follows.
_WHOLE = struct.Struct(HEADER.format + "q" * len(FIELDS))
MAX_BYTES = _WHOLE.size + MAX_POOLS * POOL.size
# torch 2.13's reserved bytes per private pool (absent before): a record with pools.
PRIVATE_POOLS_KEY = "reserved_bytes_by_private_pools"
# Where the probe finds each field in the nested stats dict: (family, pool, stat), or a top
# level key (family, "", ""), or None for what the probe adds itself (limit, pinned).
_PATHS: tuple[tuple[str, str, str] | None, ...] = (
    *((family, "all", "current") for family in CURRENT),
    *((family, "all", "peak") for family in PEAK),
    None,
    *((family, pool_stat, "current") for pool_stat in POOLS for family in POOL_GAUGES),
    *((stat, "", "") for stat in COUNTERS),
    ("max_split_size", "", ""),
    None,
    None,
)
LIMIT = FIELDS.index(("gauge", "memory_limit_bytes"))
MAX_SPLIT = FIELDS.index(("max_split", "max_split_size_bytes"))
PINNED = FIELDS.index(("pinned", "held_bytes"))
RETRIES = FIELDS.index(("counter", "alloc_retries"))
OOMS = FIELDS.index(("counter", "ooms"))


class RecordError(ValueError):
    """A record that cannot be read; `reason` is a short label value."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


_INF = float("inf")


def family_defined(family: str, backend: str, expandable_segments: bool) -> bool:
    """Whether this backend and setting track a stat family (where they do not, it reads 0,
    which is "not tracked", not "none")."""
    if backend == ASYNC and family not in ASYNC_DEFINED:
        return False
    return not (expandable_segments and family in NOT_TRACKED_WITH_EXPANDABLE)


def plan(backend: str, expandable_segments: bool) -> tuple[tuple[str, str, str] | None, ...]:
    """Each field's path in the stats dict, None where this backend and setting do not define
    it: worked out once, so that a tick is one flat loop of lookups."""

    def defined(family: str) -> bool:
        return family_defined(family, backend, expandable_segments)

    paths: list[tuple[str, str, str] | None] = []
    for (kind, _), path in zip(FIELDS, _PATHS, strict=True):
        if path is None:
            paths.append(None)
        elif kind == "gauge" and path[2] == "current":
            paths.append(path if defined(path[0]) else None)
        elif kind.startswith("pool:") or kind == "counter":
            paths.append(path if backend != ASYNC and defined(path[0]) else None)
        else:
            paths.append(path)
    return tuple(paths)


def values_from_stats(
    stats: Mapping[str, Any], paths: tuple[tuple[str, str, str] | None, ...]
) -> list[int]:
    """The record's values from one `_cuda_memoryStats(i)` result (ABSENT where undefined)."""
    values = []
    for path in paths:
        if path is None:
            values.append(ABSENT)
            continue
        family, pool, stat = path
        try:
            value = stats[family][pool][stat] if pool else stats[family]
        except (KeyError, TypeError):
            value = ABSENT
        values.append(value if type(value) is int and value >= 0 else ABSENT)
    return values


def packer(
    paths: tuple[tuple[str, str, str] | None, ...],
) -> Callable[[Mapping[str, Any], int, int, float, int], tuple[bytes, tuple[Any, Any]]]:
    """pack(device, sequence, time, values_from_stats(stats, paths) with the limit, []) as
    one expression compiled for these paths, with (allocation retries, OOMs) beside it: a
    tick runs one call into struct with the stats' lookups as its arguments, no list, no
    loop (what a serving process pays at 1 Hz is mostly cold caches, so less code touched
    is less time). It raises KeyError or TypeError where the dict lacks a path, struct.error
    where a value is no int64, and takes values as they are but max_split_size (-1 where
    unset): the caller falls back to values_from_stats; the reader refuses a negative."""
    parts = []
    for index, path in enumerate(paths):
        if index == LIMIT:
            parts.append("L")
        elif path is None:
            parts.append("A")
        elif index == MAX_SPLIT:
            parts.append("M(s.get('max_split_size'))")
        else:
            parts.append(_lookup(path))
    counts = (paths[RETRIES], paths[OOMS])
    source = (
        f"lambda s, d, q, t, L: (P(G, {VERSION}, {_WHOLE.size}, d, q & 0xFFFFFFFF, t, 0, "
        + ", ".join(parts)
        + "), ("
        + ", ".join("A" if path is None else _lookup(path) for path in counts)
        + "))"
    )
    # Compiled from this module's own constants (the paths above), never from input.
    compiled: Callable[[Mapping[str, Any], int, int, float, int], tuple[bytes, tuple[Any, Any]]]
    compiled = eval(source, {"A": ABSENT, "M": _size_or_absent, "P": _WHOLE.pack, "G": MAGIC})
    return compiled


def _lookup(path: tuple[str, str, str]) -> str:
    family, pool, stat = path
    return f"s[{family!r}][{pool!r}][{stat!r}]" if pool else f"s[{family!r}]"


def _size_or_absent(value: Any) -> int:
    return value if type(value) is int and value >= 0 else ABSENT


def private_pools(stats: Mapping[str, Any]) -> list[tuple[int, int, int]]:
    """(pool id, pool id, reserved bytes) of torch 2.13's per-private-pool stats; [] before."""
    by_pool = stats.get(PRIVATE_POOLS_KEY)
    if not isinstance(by_pool, Mapping):
        return []
    found = []
    for pool_id, value in by_pool.items():
        ids = pool_id if isinstance(pool_id, tuple) else (pool_id,)
        try:
            first, second = (int(ids[0]), int(ids[1]) if len(ids) > 1 else 0)
            found.append((first, second, int(value["all"]["current"])))
        except (KeyError, TypeError, ValueError, IndexError):
            continue
        if len(found) == MAX_POOLS:
            break
    return found


def pack(
    device: int,
    sequence: int,
    timestamp: float,
    values: list[int],
    pools: list[tuple[int, int, int]],
) -> bytes:
    """One record. Values outside int64 (none the allocator gives) become ABSENT."""
    size = _WHOLE.size + len(pools) * POOL.size
    head = (MAGIC, VERSION, size, device, sequence & 0xFFFFFFFF, timestamp, len(pools))
    try:
        whole = _WHOLE.pack(*head, *values)
    except struct.error:
        whole = _WHOLE.pack(*head, *(v if -(1 << 63) <= v < (1 << 63) else ABSENT for v in values))
    if not pools:
        return whole
    return whole + b"".join(POOL.pack(*p) for p in pools)


def unpack(data: bytes) -> tuple[int, int, float, dict[str, Any]]:
    """(device, sequence, Unix time, parts) of one record, parts shaped as AllocatorReading's
    fields: gauges, counters, pools, max_split_size_bytes, private_pools (raw ids) and pinned
    (held, in use) or None. RecordError for anything that is not a record of this version."""
    if len(data) < PREFIX.size or data[:4] != MAGIC:
        raise RecordError("record", f"not a probe record ({len(data)} bytes)")
    _, version, size = PREFIX.unpack_from(data)
    if version != VERSION:
        raise RecordError("record_version", f"a record of version {version}, not {VERSION}")
    if len(data) < HEADER.size:
        raise RecordError("record", f"a record of {len(data)} bytes, shorter than its header")
    _, _, _, device, sequence, timestamp, count = HEADER.unpack_from(data)
    expected = HEADER.size + VALUES.size + count * POOL.size
    if count > MAX_POOLS or len(data) != expected or size != expected:
        raise RecordError("record", f"a record of {len(data)} bytes, not {expected}")
    if not 0 <= timestamp < _INF:  # NaN, negative or infinite
        raise RecordError("record", "a record without a valid time")
    values = VALUES.unpack_from(data, HEADER.size)
    parts: dict[str, Any] = {"gauges": {}, "counters": {}, "pools": {}}
    for (kind, key), value in zip(FIELDS, values, strict=True):
        if value == ABSENT:
            continue
        if value < 0:
            raise RecordError("record", f"{key} is negative")
        if kind == "gauge":
            parts["gauges"][key] = value
        elif kind == "counter":
            parts["counters"][key] = value
        elif kind.startswith("pool:"):
            parts["pools"].setdefault(kind[5:], {})[key] = value
    max_split = values[MAX_SPLIT]
    parts["max_split_size_bytes"] = None if max_split == ABSENT else max_split
    held, in_use = values[PINNED], values[PINNED + 1]
    parts["pinned"] = None if ABSENT in (held, in_use) else (held, in_use)
    offset = HEADER.size + VALUES.size
    pools = []
    for _ in range(count):
        first, second, reserved = POOL.unpack_from(data, offset)
        offset += POOL.size
        if reserved < 0:
            raise RecordError("record", "a private pool's reserved bytes are negative")
        pools.append((first, second, reserved))
    parts["private_pools"] = pools
    return device, sequence, timestamp, parts
