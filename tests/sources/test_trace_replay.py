"""Trace files and their replay: atomic writes, clear errors, real pace, monotonic counters."""

from __future__ import annotations

import gzip
import json

import pytest

from exporter.ledger import ledger
from exporter.sample import Sample
from exporter.sources.replay import (
    ReplaySource,
    demo_trace_path,
    derive_recorded_non_allocator,
    derive_recorded_pool_kinds,
)
from exporter.trace import TraceError, TraceWriter, read_trace
from tests.conftest import REPO_ROOT


def demo_samples() -> list[Sample]:
    """The demo trace as the replay serves it (with the non-allocator bytes and the private
    pools' kinds derived)."""
    samples = read_trace(demo_trace_path())[1]
    derive_recorded_non_allocator(samples)
    derive_recorded_pool_kinds(samples)
    return samples


def test_a_recorded_trace_gets_non_allocator_bytes_from_its_own_fresh_lists_only():
    """The H200 trace (the demo until the H100 one) was recorded before processes took the
    value themselves: it is derived where the recorded tick read NVML's process list, and
    kept, aging, on the ticks between."""
    samples = read_trace(REPO_ROOT / "tests" / "data" / "h200_oom_storm_trace.jsonl.gz")[1]
    derive_recorded_non_allocator(samples)
    fresh = cached = 0
    last: tuple[int, float] | None = None
    for sample in samples:
        (reading,) = sample.allocators
        if not sample.processes_cached:
            (used,) = [p.used_bytes for p in sample.processes if p.pid == sample.self_pid]
            assert reading.non_allocator_bytes == used - reading.gauges["reserved_bytes"]
            assert reading.non_allocator_age_s == 0.0
            last = (reading.non_allocator_bytes, sample.timestamp)
            fresh += 1
        elif last is not None:
            assert reading.non_allocator_bytes == last[0]
            assert reading.non_allocator_age_s == pytest.approx(sample.timestamp - last[1])
            cached += 1
    assert fresh >= 5 and cached >= 5
    # A trace that carries the values keeps them as recorded.
    samples[0].allocators[0].non_allocator_bytes = 12345
    derive_recorded_non_allocator(samples)
    assert samples[0].allocators[0].non_allocator_bytes == 12345


def test_the_shipped_demo_trace_was_recorded_on_a_gpu_and_holds_an_incident():
    meta, samples = read_trace(demo_trace_path())
    assert "H200" in meta["device_name"] or "H100" in meta["device_name"]
    assert meta["script"] == "scripts/record_demo_trace.py"
    assert len(samples) > 100
    first, last = samples[0].allocators[0], samples[-1].allocators[0]
    assert last.counters["alloc_retries"] > first.counters["alloc_retries"]
    assert last.counters["ooms"] > first.counters["ooms"]
    # Its cache fragments: a fifth of reserved in split blocks, and before the OOM a free
    # cache of gigabytes whose largest block is under a tenth of it.
    ratios = [s.allocators[0].fragmentation_ratio for s in samples]
    assert max(r for r in ratios if r is not None) > 0.15
    shares = [s.allocators[0].largest_free_block_share for s in samples]
    assert min(r for r in shares if r is not None) < 0.1
    # The cap the OOMs come from, and the values the process took itself.
    assert {s.allocators[0].gauges.get("memory_limit_bytes") for s in samples[1:]} == {22 << 30}
    assert all(s.allocators[0].non_allocator_bytes is not None for s in samples[20:])
    assert all(s.gpus and s.host and s.processes for s in samples[1:])


def test_writer_publishes_the_file_only_on_close(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    writer = TraceWriter(path, meta={"k": "v"})
    for sample in demo_samples()[:3]:
        writer(sample)
    assert not path.exists()
    assert writer.close() == path
    meta, samples = read_trace(path)
    assert meta == {"k": "v"} and samples == demo_samples()[:3]
    assert list(tmp_path.iterdir()) == [path]  # no temporary left behind


def test_abort_leaves_nothing(tmp_path):
    writer = TraceWriter(tmp_path / "t.jsonl.gz")
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def _gz(data: bytes) -> bytes:
    """gzip with no time in its header: the same bytes, so the same test ids, in every process
    (pytest-xdist's workers must collect the same tests)."""
    return gzip.compress(data, mtime=0)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not gzip", "is not a gzip trace file"),
        (_gz(b""), "is empty"),
        (_gz(b'{"format": "other"}\n'), "is not a gpumem-trace file"),
        (_gz(b'{"format": "gpumem-trace", "version": 9}\n'), "unsupported trace version"),
        (_gz(b'{"format": "gpumem-trace", "version": 1}\n'), "holds no samples"),
        (_gz(b'{"format": "gpumem-trace", "version": 1}\n{"x": 1}\n'), "malformed"),
        (_gz(b'{"format": "gpumem-trace", "version": 1}\n{oops\n'), "malformed"),
    ],
)
def test_bad_trace_files_get_a_one_line_reason(tmp_path, content, message):
    path = tmp_path / "bad.gz"
    path.write_bytes(content)
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_missing_trace_file():
    with pytest.raises(TraceError, match="not found"):
        read_trace("/nonexistent/trace.gz")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_replay_follows_the_recorded_pace():
    samples = demo_samples()
    clock = Clock()
    replay = ReplaySource(clock=clock)
    t0 = samples[0].timestamp
    assert replay.read().allocators == samples[0].allocators
    for index in (1, 10, len(samples) // 2, len(samples) - 1):
        clock.now = samples[index].timestamp - t0 + 1e-6
        assert replay.position() == (0, index)
        assert replay.read().host == samples[index].host


@pytest.mark.slow
def test_counters_stay_monotonic_and_continuous_across_loops():
    samples = demo_samples()
    clock = Clock()
    replay = ReplaySource(clock=clock)
    values = []
    steps = int(replay.duration_s * 2.5 / 0.25)
    for step in range(steps):
        clock.now = step * 0.25
        values.append(replay.read().allocators[0].counters["alloc_retries"])
    assert values == sorted(values)
    increase = (
        samples[-1].allocators[0].counters["alloc_retries"]
        - samples[0].allocators[0].counters["alloc_retries"]
    )
    assert values[-1] >= 2 * increase  # two loops completed
    # Peaks never fall back after the first loop.
    clock.now = replay.duration_s + 0.1
    peak = replay.read().allocators[0].gauges["reserved_peak_bytes"]
    assert peak == max(s.allocators[0].gauges["reserved_peak_bytes"] for s in samples)


def test_a_later_loop_never_goes_back_to_the_recordings_start():
    """The demo's first sample is its server before it loaded anything (0 bytes allocated):
    played at every loop's seam, the live page's ledger and the charts dropped to nothing for
    a tick (a clean-clone CI run caught the page showing it). Only the first loop plays it."""
    samples = demo_samples()
    assert not samples[0].allocators[0].gauges.get("allocated_bytes")
    clock = Clock()
    replay = ReplaySource(clock=clock)
    assert replay.position() == (0, 0)
    for loop in (1, 2):
        clock.now = loop * replay.duration_s + 1e-6
        assert replay.position() == (loop, 1)
        assert replay.read().allocators[0].gauges["allocated_bytes"] > 0
        clock.now = loop * replay.duration_s + samples[2].timestamp - samples[0].timestamp + 1e-6
        assert replay.position() == (loop, 2)


def test_replay_without_loop_holds_the_last_sample():
    samples = demo_samples()
    clock = Clock()
    replay = ReplaySource(clock=clock, loop=False)
    replay.read()
    clock.now = replay.duration_s * 3
    assert replay.finished
    import dataclasses

    def undated(readings):  # a replayed OOM verdict is dated at its replayed moment
        return [
            dataclasses.replace(
                r, last_oom=r.last_oom and dataclasses.replace(r.last_oom, timestamp=0.0)
            )
            for r in readings
        ]

    assert undated(replay.read().allocators) == undated(samples[-1].allocators)


def test_replay_reports_the_recorded_process_identity():
    sample = demo_samples()[0]
    reading = ReplaySource(clock=Clock()).read()
    assert reading.self_pid == sample.self_pid
    assert json.dumps(Sample(timestamp=0, allocators=reading.allocators).to_dict())  # serialisable


def test_the_replay_serves_the_recorded_process_host_memory():
    """Traces carry the recording process's resident memory: the replay serves it as that
    process's host_process_* reading (pid as recorded), so per-process panels have data."""
    reading = ReplaySource(clock=lambda: 0.0).read()
    assert reading.host is not None and reading.self_pid is not None
    [process] = reading.host_processes
    assert process.pid == reading.self_pid and process.role == "server"
    assert process.resident_bytes == reading.host.process_resident_bytes
    assert process.resident_peak_bytes == reading.host.process_resident_peak_bytes
    assert process.swap_bytes is None  # not recorded: not invented


def test_a_replayed_oom_verdict_keeps_its_age_and_its_counts_rise_across_loops(tmp_path):
    """A trace with no OOM, then the verdicts of OOMs made on an H100 (1 at first, 3 later)."""
    import dataclasses
    import time

    from tests.helpers import captured_oom_samples

    (oom,) = [
        s
        for s in captured_oom_samples()
        if s.allocators[0].ooms_by_verdict.get("cap") and not s.allocators[0].expandable_segments
    ]
    reading = oom.allocators[0]
    verdict = reading.last_oom
    assert verdict is not None
    quiet = dataclasses.replace(reading, last_oom=None, ooms_by_verdict={})
    quiet.counters = {**reading.counters, "ooms": 0}
    three = dataclasses.replace(reading, ooms_by_verdict={"cap": 3})
    three.counters = {**reading.counters, "ooms": 3}
    writer = TraceWriter(tmp_path / "t.jsonl.gz")
    for t, allocator in (
        (100.0, quiet),
        (verdict.timestamp + 5, reading),
        (verdict.timestamp + 9, three),
    ):
        writer(dataclasses.replace(oom, timestamp=t, allocators=[allocator]))
    writer.close()
    clock = Clock()
    replay = ReplaySource(tmp_path / "t.jsonl.gz", clock=clock)
    assert replay.read().allocators[0].last_oom is None
    clock.now = verdict.timestamp + 5 - 100.0 + 1e-6
    replayed = replay.read().allocators[0].last_oom
    assert replayed is not None
    # Five seconds old at the recorded moment: five seconds old now.
    assert replayed.timestamp == pytest.approx(time.time() - 5, abs=0.5)
    assert dataclasses.replace(replayed, timestamp=verdict.timestamp) == verdict
    clock.now = replay.duration_s + (verdict.timestamp + 9 - 100.0) + 1e-6  # loop 1, last
    again = replay.read().allocators[0]
    assert again.counters["ooms"] == 6 and again.ooms_by_verdict == {"cap": 6}


def test_a_recorded_pools_kind_comes_from_its_id():
    """A trace recorded before pools had kinds (the demo's readings with their pool info
    taken away): the decoder's CUDA graphs captured in one pool of its own are kind graph."""
    samples = read_trace(demo_trace_path())[1]
    for s in samples:
        for r in s.allocators:
            r.private_pool_info = {}
    derive_recorded_pool_kinds(samples)
    kinds = {
        label: (info["kind"], info["name"])
        for s in samples
        for r in s.allocators
        for label, info in r.private_pool_info.items()
    }
    assert kinds and set(kinds.values()) == {("graph", "")}, kinds
    assert all(int(label.split("_")[0]) > 0 for label in kinds)


def test_the_demo_names_its_memory_for_the_ledger():
    """Recorded on the GPU with exporter.component("weights") around the model's load,
    set_component("kv_cache") at every decode step and name_pool(pool, "decode_graphs"): the
    demo's ledger has the server's own parts, and they, with the ledger's, sum to NVML's
    per-process used wherever the process is listed."""
    samples = demo_samples()
    named = {name for s in samples for r in s.allocators for name in r.components}
    assert named == {"weights", "kv_cache"}
    pools = {
        (info["kind"], info["name"])
        for s in samples
        for r in s.allocators
        for info in r.private_pool_info.values()
    }
    assert pools == {("graph", "decode_graphs")}
    # The weights do not change while it serves; the cache does, and is zero between batches.
    weights = {r.components.get("weights") for s in samples[5:] for r in s.allocators}
    assert len(weights) == 1 and (weights.pop() or 0) > 6 << 30
    caches = [r.components.get("kv_cache", 0) for s in samples for r in s.allocators]
    assert max(caches) > 1 << 30 and min(caches) == 0
    checked = 0
    for sample in samples:
        (reading,) = sample.allocators
        if reading.non_allocator_bytes is None or "weights" not in reading.components:
            continue  # NVML did not list it yet, or the model was not loaded yet
        parts = dict(ledger(reading))
        assert parts["weights"] == reading.components["weights"]  # under allocated, not cut
        total = reading.gauges["reserved_bytes"] + reading.non_allocator_bytes
        assert sum(parts.values()) == total
        checked += 1
    assert checked > len(samples) * 0.9
