"""The OOM verdict's rule (exporter/oom_verdict.py), on the readings an H100 took in the OOM
observer for each cause (tests/data/oom_verdicts.json), and on those readings with one changed."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from exporter.oom_verdict import RULES, VERDICTS, OomLog, OomVerdict, Rule, decide, describe
from tests.conftest import DATA_DIR

GiB = 1 << 30
CAPTURED = json.loads((DATA_DIR / "oom_verdicts.json").read_text())
# The causes of issue 52, made on purpose on an H200 (a live MemPool under a cap; CuPy's pool
# in the same process), by the same scenarios (tests/support/oom_scenarios.py).
CAPTURED["runs"] += json.loads((DATA_DIR / "oom_verdicts_2026.json").read_text())["runs"]


def _captured(scenario: str, alloc_conf: str = "") -> OomVerdict:
    for run in CAPTURED["runs"]:
        if run["scenario"] == scenario and run["alloc_conf"] == alloc_conf:
            return OomVerdict.from_dict(run["reading"]["last_oom"])
    raise LookupError(scenario)


def _undecided(verdict: OomVerdict) -> OomVerdict:
    return replace(verdict, verdict="unknown", reason="", action="")


@pytest.mark.parametrize(
    "scenario",
    ["fragmentation", "pools", "cap", "other_processes", "outside_allocator", "exhaustion"],
)
def test_the_rule_gives_each_captured_oom_its_cause(scenario: str) -> None:
    decided = decide(_undecided(_captured(scenario)))
    assert decided.verdict == scenario
    assert decided == _captured(scenario)  # the same reason and action as on the GPU


def test_fragmentation_names_the_deciding_numbers_and_the_setting() -> None:
    verdict = _captured("fragmentation")
    assert verdict.free_in_holes_bytes >= verdict.requested_bytes  # type: ignore[operator]
    assert "asked 512 MiB" in verdict.reason and "largest free block 160 MiB" in verdict.reason
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in verdict.action
    with_expandable = decide(replace(_undecided(verdict), expandable_segments=True))
    assert with_expandable.verdict == "fragmentation"
    assert "expandable_segments:True" not in with_expandable.action


def test_cap_says_how_high_the_cap_must_go() -> None:
    verdict = _captured("cap")
    assert verdict.cap_room_bytes == verdict.memory_limit_bytes - verdict.reserved_bytes  # type: ignore[operator]
    # reserved 1.5 GiB + asked 1 GiB
    assert "cap of at least 2.50 GiB" in verdict.action


def test_other_processes_names_the_biggest_pid() -> None:
    verdict = _captured("other_processes")
    pid = verdict.other_processes[0][0]
    assert f"stop or move pid {pid}" in verdict.action
    assert f"pid {pid} " in verdict.reason


def test_other_processes_under_a_tenth_of_the_gpu_are_not_the_cause() -> None:
    """A sidecar's CUDA context does not explain a server that filled the GPU itself."""
    verdict = _undecided(_captured("exhaustion"))
    small = replace(
        verdict,
        other_processes_bytes=verdict.requested_bytes,
        other_processes=[[4242, verdict.requested_bytes]],
    )
    assert decide(small).verdict == "exhaustion"
    big = replace(small, other_processes_bytes=GiB * 9, other_processes=[[4242, GiB * 9]])
    assert decide(big).verdict == "other_processes"


def test_free_bytes_stranded_in_private_pools_that_cover_what_was_missing_is_pools() -> None:
    """A MemPool or a CUDA graph's pool holds free memory the default pool cannot use: where
    it covers what the cap (here) or the GPU left missing, that is the cause, not the cap."""
    verdict = _undecided(_captured("cap"))
    assert verdict.cap_room_bytes is not None
    missing = verdict.requested_bytes - verdict.cap_room_bytes
    short = replace(verdict, private_pools_free_bytes=missing - 1, private_pools_free={"0_1": 1})
    assert decide(short).verdict == "cap"
    stranded = {"0_1": missing, "2_0": 0}
    enough = replace(verdict, private_pools_free_bytes=missing, private_pools_free=stranded)
    decided = decide(enough)
    assert decided.verdict == "pools"
    assert "pool 0_1 " in decided.reason and "the default pool cannot use" in decided.reason
    assert "torch.cuda.MemPool" in decided.action
    assert decided.deciding_bytes()["private_pools_free"] == missing


def test_this_process_filling_the_gpu_outside_the_allocator_is_outside_allocator() -> None:
    """CuPy, NCCL or a CuMem pool in the same process: their bytes are NVML's used minus
    reserved; a CUDA context's worth is not the cause, a tenth of the GPU that covers the
    request is."""
    verdict = _undecided(_captured("exhaustion"))
    assert verdict.device_total_bytes is not None
    context = replace(verdict, outside_allocator_bytes=512 << 20)
    assert decide(context).verdict == "exhaustion"
    held = verdict.device_total_bytes // 2
    decided = decide(replace(verdict, outside_allocator_bytes=held))
    assert decided.verdict == "outside_allocator"
    assert "outside PyTorch's allocator" in decided.reason and "CuPy" in decided.action
    # Other processes come first where both would explain it.
    other = replace(verdict, other_processes_bytes=held, other_processes=[[4242, held]])
    assert decide(replace(other, outside_allocator_bytes=held)).verdict == "other_processes"


def test_the_new_readings_round_trip_and_malformed_pools_are_refused() -> None:
    verdict = replace(
        _captured("cap"),
        private_pools_free_bytes=3 * GiB,
        private_pools_free={"0_1": 3 * GiB},
        outside_allocator_bytes=GiB,
    )
    assert OomVerdict.from_dict(verdict.to_dict()) == verdict
    for bad in ({"0_1": -1}, {"x" * 65: 1}, {str(i): 1 for i in range(4)}, ["0_1", 1]):
        with pytest.raises(ValueError, match="private_pools_free"):
            OomVerdict.from_dict({**verdict.to_dict(), "private_pools_free": bad})


@pytest.mark.parametrize(
    ("scenario", "cleared", "needed"),
    [
        ("fragmentation", "free_in_holes_bytes", "free bytes in the cache"),
        ("cap", "device_free_bytes", "the GPU's free memory"),
        ("exhaustion", "other_processes_bytes", "the GPU's other processes"),
        ("exhaustion", "allocated_bytes", "allocated bytes"),
    ],
)
def test_a_missing_reading_that_a_rule_needs_is_unknown_and_named(
    scenario: str, cleared: str, needed: str
) -> None:
    gone: dict[str, Any] = {cleared: None}
    verdict = replace(_undecided(_captured(scenario)), **gone, missing="other processes: gone")
    decided = decide(verdict)
    assert decided.verdict == "unknown"
    assert needed in decided.reason and "(other processes: gone)" in decided.reason
    assert "snapshot" in decided.action


def test_a_missing_reading_no_rule_reaches_does_not_hide_the_verdict() -> None:
    verdict = replace(_undecided(_captured("fragmentation")), other_processes_bytes=None)
    assert decide(verdict).verdict == "fragmentation"


def test_a_verdict_round_trips_and_malformed_ones_are_refused() -> None:
    verdict = _captured("other_processes")
    assert OomVerdict.from_dict(verdict.to_dict()) == verdict
    assert verdict.to_dict()["cap_room_bytes"] is None
    bad: Any
    for bad in (
        {**verdict.to_dict(), "verdict": "bad luck"},
        {**verdict.to_dict(), "requested_bytes": -1},
        {**verdict.to_dict(), "requested_bytes": None},
        {**verdict.to_dict(), "reason": 7},
        {**verdict.to_dict(), "other_processes": [[1, 2, 3]]},
        {**verdict.to_dict(), "other_processes": [[1, 2]] * 4},
        {**verdict.to_dict(), "expandable_segments": "yes"},
        {**verdict.to_dict(), "timestamp": float("nan")},
        {"device": 0},
        [],
    ):
        with pytest.raises(ValueError):
            OomVerdict.from_dict(bad)


def test_describe_is_one_line_with_verdict_reason_and_action() -> None:
    line = describe(_captured("cap"))
    assert line.startswith("cap: asked 1.00 GiB;") and "-> raise" in line and "\n" not in line


def test_the_log_keeps_the_latest_per_device_counts_and_reports_verdict_changes() -> None:
    log = OomLog()
    first = _captured("fragmentation")
    assert log.record(first) is True
    assert log.record(replace(first, timestamp=first.timestamp + 1)) is False  # same verdict
    assert log.record(replace(_captured("cap"), device=0)) is True
    assert log.counts(0) == {"fragmentation": 2, "cap": 1}
    last = log.last(0)
    assert last is not None and last.verdict == "cap"
    log.set_snapshot(0, first.timestamp, "too-old")  # not the latest OOM: not linked
    assert log.last(0).snapshot == last.snapshot  # type: ignore[union-attr]
    log.set_snapshot(0, last.timestamp, "20261126T000000Z-00000000")
    assert log.last(0).snapshot == "20261126T000000Z-00000000"  # type: ignore[union-attr]
    assert set(log.counts(0)) <= set(VERDICTS)


def test_in_a_burst_the_most_complete_record_stays_and_counts_what_followed() -> None:
    """A storm: the first OOM has every reading and its snapshot coming; the next ones lack
    the layout's readings (history recording on) and get no snapshot (cooldown). The first
    stays shown, linked to its snapshot, with how many followed; a more complete one of the
    burst takes its place; after a quiet gap a new burst starts with whatever comes."""
    from exporter.oom_verdict import BURST_GAP_S

    log = OomLog()
    first = _captured("fragmentation")
    poor = replace(
        first,
        free_in_holes_bytes=None,
        largest_free_block_bytes=None,
        verdict="unknown",
        missing="allocator snapshot: history recording is on: a snapshot would build every stack",
    )
    log.record(first, snapshot_coming=True)
    for i in range(1, 4):
        log.record(replace(poor, timestamp=first.timestamp + 2 * i))
    shown = log.last(0)
    assert shown is not None and shown.timestamp == first.timestamp and shown.followed == 3
    assert log.counts(0) == {"fragmentation": 1, "unknown": 3}
    log.set_snapshot(0, first.timestamp, "20261127T000000Z-00000001")  # written after it
    assert log.last(0).snapshot == "20261127T000000Z-00000001"  # type: ignore[union-attr]
    richer = replace(first, timestamp=first.timestamp + 10, snapshot="", missing="")
    log.record(richer, snapshot_coming=True)  # as complete, and newer: it is shown
    assert log.last(0) == richer
    later = replace(poor, timestamp=richer.timestamp + BURST_GAP_S + 1)  # a new burst
    log.record(later)
    assert log.last(0) == later


@pytest.mark.parametrize(
    ("holes", "largest", "reserved", "limit", "says"),
    [
        (3 * GiB, 160 << 20, 6 * GiB, 20 * GiB, "fragmentation building: 3.00 GiB free between"),
        (3 * GiB, 1 * GiB, 6 * GiB, 20 * GiB, ""),  # the free cache is in big pieces
        (256 << 20, 16 << 20, 6 * GiB, 20 * GiB, ""),  # too little free to matter
        (1 * GiB, 1 * GiB, 19 * GiB + (600 << 20), 20 * GiB, "close to the cap: 424 MiB left"),
        (None, None, 6 * GiB, None, ""),  # no layout, no cap: nothing to say
    ],
)
def test_a_retry_says_what_is_building(holes, largest, reserved, limit, says) -> None:
    from exporter.oom_verdict import retry_pressure

    note = retry_pressure(holes, largest, reserved, limit)
    assert note.startswith(says) if says else note == ""


# Each rule alone: the readings at its edge, as a bare OomVerdict (nothing else set), so that
# what holds is the rule's own condition, not the order of the table around it.
_ALONE: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # (readings where it holds, the same with one reading on the other side of its edge)
    "fragmentation": ({"free_in_holes_bytes": 2 * GiB}, {"free_in_holes_bytes": 2 * GiB - 1}),
    "pools": (
        {"device_free_bytes": GiB, "private_pools_free_bytes": GiB},
        {"device_free_bytes": GiB, "private_pools_free_bytes": GiB - 1},
    ),
    "cap": (
        {"device_free_bytes": 2 * GiB, "memory_limit_bytes": 10 * GiB, "reserved_bytes": 9 * GiB},
        {
            "device_free_bytes": 2 * GiB - 1,
            "memory_limit_bytes": 10 * GiB,
            "reserved_bytes": 9 * GiB,
        },
    ),
    "other_processes": (
        {
            "device_free_bytes": GiB,
            "other_processes_bytes": 8 * GiB,
            "device_total_bytes": 80 * GiB,
        },
        {
            "device_free_bytes": GiB,
            "other_processes_bytes": 8 * GiB - 1,
            "device_total_bytes": 80 * GiB,
        },
    ),
    "outside_allocator": (
        {
            "device_free_bytes": GiB,
            "outside_allocator_bytes": 8 * GiB,
            "device_total_bytes": 80 * GiB,
        },
        {
            "device_free_bytes": GiB,
            "outside_allocator_bytes": 8 * GiB - 1,
            "device_total_bytes": 80 * GiB,
        },
    ),
}


def test_the_rules_are_the_verdicts_in_the_documented_order() -> None:
    assert [rule.verdict for rule in RULES] == [v for v in VERDICTS if v != "unknown"]


@pytest.mark.parametrize("rule", RULES[:-1], ids=lambda rule: rule.verdict)
def test_each_rule_alone_holds_at_its_edge_and_says_its_numbers(rule: Rule) -> None:
    holds, short = (OomVerdict(0, 0.0, 2 * GiB, **readings) for readings in _ALONE[rule.verdict])
    assert rule.holds(holds) and not rule.holds(short)
    reason, action = rule.says(holds)
    assert reason.startswith("asked 2.00 GiB; ") and action, (reason, action)


def test_exhaustion_holds_whenever_it_is_reached_and_names_the_room() -> None:
    exhaustion = RULES[-1]
    verdict = OomVerdict(
        0,
        0.0,
        GiB,
        allocated_bytes=70 * GiB,
        free_in_holes_bytes=0,
        device_free_bytes=0,
        device_total_bytes=80 * GiB,
    )
    assert exhaustion.holds(verdict)
    assert "live tensors hold 70.0 GiB of 80.0 GiB" in exhaustion.says(verdict)[0]


def test_a_named_pool_is_said_by_its_name_and_id_and_the_names_are_checked() -> None:
    verdict = _undecided(_captured("cap"))
    assert verdict.cap_room_bytes is not None
    missing = verdict.requested_bytes - verdict.cap_room_bytes
    stranded = replace(
        verdict,
        private_pools_free_bytes=missing,
        private_pools_free={"0_1": missing},
        private_pool_names={"0_1": "decode_graphs"},
    )
    decided = decide(stranded)
    assert decided.verdict == "pools" and "pool decode_graphs (0_1) " in decided.reason
    assert OomVerdict.from_dict(decided.to_dict()) == decided
    for bad in ({"0_1": 7}, {"0_1": "x" * 65}, {str(i): "p" for i in range(4)}, ["0_1"]):
        with pytest.raises(ValueError, match="private_pool_names"):
            OomVerdict.from_dict({**decided.to_dict(), "private_pool_names": bad})
