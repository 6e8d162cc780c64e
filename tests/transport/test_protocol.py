"""The agent protocol of `gpumem-exporter run`: what the aggregator accepts and refuses."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from exporter.oom_verdict import OomVerdict
from exporter.probe import record
from exporter.sample import ActionCounts, AllocatorReading
from exporter.sources.replay import demo_trace_path
from exporter.trace import read_trace
from exporter.transport import protocol
from tests.conftest import DATA_DIR

GOOD = {"device": 0, "gpu_uuid": "GPU-a", "backend": "native", "expandable_segments": False}


def reason(call, *args) -> str:
    with pytest.raises(protocol.ProtocolError) as caught:
        call(*args)
    return caught.value.reason


def test_a_sample_round_trips():
    message = protocol.sample([{**GOOD, "gauges": {"allocated_bytes": 5}}], ActionCounts())
    line = protocol.encode(message)
    readings, counts = protocol.parse_sample(protocol.decode(line.rstrip(b"\n")))
    assert readings[0].gauges == {"allocated_bytes": 5} and counts == ActionCounts()


@pytest.mark.parametrize(
    ("allocator", "why"),
    [
        ({**GOOD, "gauges": {"allocated_bytes": True}}, "a bool is not a count"),
        ({**GOOD, "gauges": {"allocated_bytes": -1}}, "negative"),
        ({**GOOD, "gauges": {"made_up_bytes": 1}}, "unknown gauge"),
        ({**GOOD, "surprise": 1}, "unknown field"),
        ({**GOOD, "device": 5000}, "device out of range"),
        ({**GOOD, "pools": {"huge": {}}}, "unknown pool"),
        ({**GOOD, "expandable_segments": "no"}, "not a bool"),
    ],
)
def test_bad_allocator_fields_are_refused(allocator, why):
    assert reason(protocol.parse_sample, {"type": "sample", "allocators": [allocator]}) == "field"


def test_hello_needs_this_protocol_version():
    hello = protocol.hello({"pid": "1", "role": "w", "rank": "", "local_rank": ""})
    assert protocol.parse_hello(hello)["role"] == "w"
    assert reason(protocol.parse_hello, {**hello, "version": 2}) == "version"


def test_lines_are_bounded_with_or_without_a_newline():
    reader = protocol.StreamReader(max_line_bytes=10)
    assert list(reader.feed(b"short\nrest")) == [b"short"]
    assert list(reader.feed(b"\n")) == [b"rest"]
    assert reason(lambda: list(protocol.StreamReader(10).feed(b"x" * 11 + b"\n"))) == "too_long"
    assert reason(lambda: list(protocol.StreamReader(10).feed(b"x" * 11))) == "too_long"


def test_records_between_lines_are_taken_whole_however_the_stream_is_cut():
    """Records go as they are, no line around them: the reader finds where each ends by the
    size at its start, whichever byte the kernel cuts the stream at."""
    values = [record.ABSENT] * len(record.FIELDS)
    first = record.pack(0, 1, 1.0, values, [(1, 0, 5)])
    second = record.pack(1, 2, 2.0, values, [])
    line = protocol.encode({"type": "sample", "allocators": []})
    stream = first + line + second + second + line
    for cut in range(1, 40):
        reader = protocol.StreamReader()
        found: list[bytes] = []
        for at in range(0, len(stream), cut):
            found += reader.feed(stream[at : at + cut])
        assert found == [first, line[:-1], second, second, line[:-1]], cut


@pytest.mark.parametrize(
    "stream",
    [
        record.PREFIX.pack(record.MAGIC, 2, 4),  # a size shorter than its own prefix
        record.PREFIX.pack(record.MAGIC, 2, record.MAX_BYTES + 1),
        b"GMPX" + bytes(100),
        b"Gx",
    ],
)
def test_a_record_without_a_size_to_trust_ends_the_stream(stream):
    """Nothing after it could be told apart again: the connection is dropped, not misread."""
    assert reason(lambda: list(protocol.StreamReader().feed(stream))) == "record"


def test_json_and_types_are_checked():
    assert reason(protocol.decode, b"{nope") == "json"
    assert reason(protocol.decode, b'{"type": "x"}') == "type"
    assert reason(protocol.decode, b'{"type": "sample", "n": NaN}') == "json"


def test_layout_private_pools_settings_and_pinned_memory_travel_from_agents():
    allocator = {
        **GOOD,
        "layout": {"largest_free_block_bytes": 7, "default_pool_free_bytes": 9},
        "layout_age_s": 1.5,
        "layout_skipped": "",
        "private_pools": {"1_0": {"reserved_bytes": 4, "allocated_bytes": 3}},
        "settings": {"expandable_segments": "true", "source": "live"},
        "non_allocator_bytes": 543_162_368,
        "non_allocator_age_s": 2.0,
    }
    pinned = protocol.PinnedHostReading(held_bytes=8, in_use_bytes=2)
    message = protocol.decode(protocol.encode(protocol.sample([allocator], ActionCounts(), pinned)))
    (reading,), _ = protocol.parse_sample(message)
    assert reading.layout == allocator["layout"] and reading.layout_age_s == 1.5
    assert reading.private_pools == {"1_0": {"reserved_bytes": 4, "allocated_bytes": 3}}
    assert reading.settings["source"] == "live"
    assert (reading.non_allocator_bytes, reading.non_allocator_age_s) == (543_162_368, 2.0)
    parsed = protocol.parse_pinned_host(message)
    assert parsed is not None and (parsed.held_bytes, parsed.in_use_bytes) == (8, 2)
    assert protocol.parse_pinned_host(protocol.sample([allocator], ActionCounts())) is None


@pytest.mark.parametrize(
    "allocator",
    [
        {**GOOD, "layout": {"made_up_bytes": 1}},
        {**GOOD, "layout": {"largest_free_block_bytes": -1}},
        {**GOOD, "layout_age_s": -1},
        {**GOOD, "layout_age_s": True},
        {**GOOD, "private_pools": {"1_0": {"free_bytes": 1}}},
        {**GOOD, "private_pools": {f"1_{i}": {} for i in range(40)}},
        {**GOOD, "settings": {"a": 1}},
        {**GOOD, "settings": {f"k{i}": "v" for i in range(40)}},
        {**GOOD, "layout_skipped": "x" * 100},
        {**GOOD, "non_allocator_bytes": -1},
        {**GOOD, "non_allocator_bytes": 1.5},
        {**GOOD, "non_allocator_age_s": float("inf")},
        {**GOOD, "non_allocator_age_s": "1"},
    ],
)
def test_bad_layout_fields_are_refused(allocator):
    assert reason(protocol.parse_sample, {"type": "sample", "allocators": [allocator]}) == "field"


@pytest.mark.parametrize(
    "pinned",
    [{"held_bytes": -1, "in_use_bytes": 0}, {"held_bytes": 1}, {"held_bytes": 1, "x": 1}, 5],
)
def test_bad_pinned_host_memory_is_refused(pinned):
    assert reason(protocol.parse_pinned_host, {"type": "sample", "pinned_host": pinned}) == "field"


def test_an_oom_verdict_travels_from_agents_and_a_malformed_one_is_refused():
    """What an agent's OOM observer decided reaches the launcher as it was (its reading from
    an H100, tests/data/oom_verdicts.json); a verdict of the wrong shape is dropped."""
    import json
    from dataclasses import asdict

    from tests.conftest import DATA_DIR

    run = json.loads((DATA_DIR / "oom_verdicts.json").read_text())["runs"][0]
    verdict = run["reading"]["last_oom"]
    allocator = {**GOOD, "last_oom": verdict, "ooms_by_verdict": {verdict["verdict"]: 2}}
    line = protocol.encode(protocol.sample([allocator], ActionCounts()))
    (reading,), _ = protocol.parse_sample(protocol.decode(line.rstrip(b"\n")))
    assert reading.last_oom is not None
    # As recorded on the H100, with the fields added since at their defaults.
    sent = {k: v for k, v in verdict.items() if k != "cap_room_bytes"}
    assert asdict(reading.last_oom) == {**asdict(OomVerdict(0, 0.0, 0)), **sent}
    assert reading.ooms_by_verdict == {verdict["verdict"]: 2}
    for bad in (
        {**allocator, "last_oom": {**verdict, "verdict": "bad luck"}},
        {**allocator, "last_oom": "fragmentation"},
        {**allocator, "ooms_by_verdict": {"made_up": 1}},
        {**allocator, "ooms_by_verdict": {"cap": -1}},
    ):
        assert reason(protocol.parse_sample, {"type": "sample", "allocators": [bad]}) == "field"


def test_every_part_of_an_allocator_reading_has_its_check_on_the_wire():
    """AllocatorReading declares the parts; the launcher checks each one an agent sends."""
    declared = {f.name for f in fields(AllocatorReading)}
    assert set(protocol.ALLOCATOR_CHECKS) | set(protocol.FROM_LAUNCHER) == declared


@pytest.mark.slow
def test_every_recorded_reading_travels_whole_from_an_agent():
    """The allocator readings of the recorded traces (layouts, private pools, OOM verdicts),
    sent as an agent sends them, arrive equal; only the process is the launcher's to set."""
    sent = verdicts = 0
    for path in (demo_trace_path(), DATA_DIR / "h200_oom_storm_trace.jsonl.gz"):
        for sample in read_trace(path)[1]:
            allocators = [protocol.allocator_fields(r) for r in sample.allocators]
            message = protocol.sample(allocators, ActionCounts())
            line = protocol.encode(message).rstrip(b"\n")
            readings, _ = protocol.parse_sample(protocol.decode(line))
            assert readings == [replace(r, process={}) for r in sample.allocators]
            sent += len(readings)
            verdicts += sum(r.last_oom is not None for r in readings)
    assert sent > 500 and verdicts > 0


@pytest.mark.parametrize(
    "components",
    [
        {"other_live": 5},  # a ledger part's name: two series with one label set
        {"weights": 1 << 63},  # past what set_component() takes
        {"": 5},
    ],
)
def test_components_the_call_refuses_are_refused_on_the_wire_too(components):
    """One rule on both sides: what exporter.set_component() refuses at the call, an agent's
    sample cannot bring in either (issue 63 item 4)."""
    from exporter import components as named

    message = protocol.sample([{**GOOD, "components": components}], ActionCounts())
    assert reason(protocol.parse_sample, message) == "field"
    [(name, nbytes)] = components.items()
    with pytest.raises(named.ComponentError):
        named.Components(allocated=dict).set(name, nbytes)


def test_the_overflow_and_the_largest_size_are_taken_on_both_sides():
    from exporter import components as named

    sizes = {"weights": named.MAX_BYTES, named.OVERFLOW: 7}
    message = protocol.sample([{**GOOD, "components": sizes}], ActionCounts())
    [reading], _ = protocol.parse_sample(message)
    assert reading.components == sizes
    named.Components(allocated=dict).set("weights", named.MAX_BYTES)
