"""exporter.probe.record: the probe's binary record carries exactly the numbers the full source
reads, on the stats captured on an H100 (tests/data/allocator_*.json: native, expandable
segments, cudaMallocAsync)."""

from __future__ import annotations

import json
import math
import struct

import pytest

from exporter import catalog
from exporter.probe import record
from exporter.probe.allocator import AllocatorProbe
from exporter.probe.record import RecordError, pack, plan, unpack, values_from_stats
from exporter.sources.torch_allocator import allocator_reading_from_stats, parse_alloc_conf
from tests.conftest import DATA_DIR
from tests.helpers import ProbedServer

CAPTURES = ("native", "expandable", "async")


def capture(name: str) -> tuple[dict, str, bool]:
    data = json.loads((DATA_DIR / f"allocator_{name}.json").read_text())
    conf = parse_alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": data["alloc_conf"]})
    expandable = conf.get("expandable_segments", "").lower() == "true"
    return data["memory_stats_as_nested_dict"], data["allocator_backend"], expandable


@pytest.mark.parametrize("name", CAPTURES)
def test_a_record_carries_what_the_full_source_reads(name):
    stats, backend, expandable = capture(name)
    full = allocator_reading_from_stats(
        stats, device=0, gpu_uuid="GPU-x", backend=backend, expandable_segments=expandable
    )
    values = values_from_stats(stats, plan(backend, expandable))
    values[record.LIMIT] = 22 << 30
    values[record.PINNED], values[record.PINNED + 1] = 4096, 1024
    device, sequence, at, parts = unpack(pack(0, 7, 1234.5, values, []))
    assert (device, sequence, at) == (0, 7, 1234.5)
    assert parts["gauges"] == {**full.gauges, "memory_limit_bytes": 22 << 30}
    assert parts["counters"] == full.counters
    assert parts["pools"] == full.pools
    assert parts["max_split_size_bytes"] == full.max_split_size_bytes
    assert parts["pinned"] == (4096, 1024)
    assert parts["private_pools"] == []


@pytest.mark.parametrize("name", CAPTURES)
def test_the_compiled_packer_packs_what_the_checked_path_does(name):
    stats, backend, expandable = capture(name)
    paths = plan(backend, expandable)
    values = values_from_stats(stats, paths)
    values[record.LIMIT] = 22 << 30
    data, counts = record.packer(paths)(stats, 1, 7, 1234.5, 22 << 30)
    assert data == pack(1, 7, 1234.5, values, [])
    assert counts == (values[record.RETRIES], values[record.OOMS])


def test_a_stats_dict_the_compiled_reader_cannot_take_is_read_one_by_one():
    """A torch without one of the families raises in the compiled reader; a value that is
    no int passes it and struct refuses it: the probe then reads them one by one."""
    server = ProbedServer()
    probe = AllocatorProbe(server.torch)
    probe.configure("native", False)
    server.stats["reserved_bytes"]["all"]["current"] = 1.5  # no int: struct refuses it
    [data] = probe.records()
    *_, parts = unpack(data)
    assert "reserved_bytes" not in parts["gauges"]
    assert parts["gauges"]["allocated_bytes"] == server.stats["allocated_bytes"]["all"]["current"]
    del server.stats["requested_bytes"]  # a family this torch lacks: KeyError
    [data] = probe.records()
    *_, parts = unpack(data)
    assert "requested_bytes" not in parts["gauges"]
    assert parts["gauges"]["allocated_bytes"] == server.stats["allocated_bytes"]["all"]["current"]


def test_the_record_names_every_allocator_number_the_catalog_serves():
    """A family added to the catalog without its place in the record fails here."""
    gauges = {key for kind, key in record.FIELDS if kind == "gauge"}
    assert gauges == set(catalog.keys("allocator_gauge"))
    assert {key for kind, key in record.FIELDS if kind == "counter"} == set(
        catalog.keys("allocator_counter")
    )
    assert catalog.keys("pool") == record.POOL_GAUGES


def test_private_pools_travel_with_their_ids():
    stats, backend, expandable = capture("native")
    by_pool = {(1, 0): {"all": {"current": 3 << 20}}, (0, 2): {"all": {"current": 5 << 20}}}
    stats = {**stats, "reserved_bytes_by_private_pools": by_pool}
    values = values_from_stats(stats, plan(backend, expandable))
    *_, parts = unpack(pack(1, 1, 1.0, values, record.private_pools(stats)))
    assert sorted(parts["private_pools"]) == [(0, 2, 5 << 20), (1, 0, 3 << 20)]


def test_what_is_not_a_number_of_this_allocator_is_absent_not_zero():
    """cudaMallocAsync does not track segments or pools; a negative or non-int value (a torch
    that changed a stat's type) is left out, never sent as a number."""
    stats, backend, expandable = capture("async")
    values = values_from_stats(stats, plan(backend, expandable))
    *_, parts = unpack(pack(0, 1, 1.0, values, []))
    assert "segments" not in parts["gauges"] and parts["pools"] == {}
    odd = {**stats, "allocated_bytes": {"all": {"current": -5, "peak": 1.5}}}
    *_, parts = unpack(pack(0, 1, 1.0, values_from_stats(odd, plan(backend, expandable)), []))
    assert "allocated_bytes" not in parts["gauges"]
    assert "allocated_peak_bytes" not in parts["gauges"]


V, SIZE = record.VERSION, record.HEADER.size + record.VALUES.size


def good() -> bytes:
    stats, backend, expandable = capture("native")
    return pack(0, 1, 1.0, values_from_stats(stats, plan(backend, expandable)), [(1, 0, 5)])


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "record"),
        (b"GMPX" + good()[4:], "record"),
        (good()[:-1], "record"),
        (good() + b"\0", "record"),
        (record.PREFIX.pack(record.MAGIC, 1, 8), "record_version"),
        (record.HEADER.pack(record.MAGIC, 99, 424, 0, 1, 1.0, 0) + b"\0" * 400, "record_version"),
        (record.HEADER.pack(record.MAGIC, V, SIZE, 0, 1, math.nan, 0) + b"\0" * record.VALUES.size,
         "record"),
        (record.HEADER.pack(record.MAGIC, V, SIZE, 0, 1, math.inf, 0) + b"\0" * record.VALUES.size,
         "record"),
        (record.HEADER.pack(record.MAGIC, V, SIZE, 0, 1, 1.0, 0) + struct.pack(
            "<" + "q" * len(record.FIELDS), *([-1] * len(record.FIELDS))), "record"),
        (record.HEADER.pack(record.MAGIC, V, SIZE + 1, 0, 1, 1.0, 0) + b"\0" * record.VALUES.size,
         "record"),
        (record.HEADER.pack(record.MAGIC, V, SIZE, 0, 1, 1.0, 0)[:12], "record"),
        (good()[: -record.POOL.size] + record.POOL.pack(1, 0, -1), "record"),
    ],
)  # fmt: skip
def test_a_record_of_another_version_or_shape_is_refused_never_misread(data, reason):
    with pytest.raises(RecordError) as raised:
        unpack(data)
    assert raised.value.reason == reason
