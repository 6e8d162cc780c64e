"""The OOM observer (exporter/actions/oom.py) when its readings fail and when OOMs storm: the OOM
is always counted with a verdict, nothing is raised into the OOM-ing thread, one log line per
verdict change, snapshots rate-limited and linked. The real observer on a real GPU:
tests/gpu/test_gpu_oom.py."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from typing import Any

import pytest

from exporter.actions.oom import OomCapture
from exporter.actions.snapshots import SnapshotStore
from exporter.oom_verdict import OomLog, OomVerdict
from tests.conftest import DATA_DIR

CAPTURED = {
    (run["scenario"], run["alloc_conf"]): run
    for run in json.loads((DATA_DIR / "oom_verdicts.json").read_text())["runs"]
}


class Reader:
    """The allocator source's part the observer calls, answering with the readings an H100
    took at a fragmentation OOM (or failing where a test says)."""

    def __init__(self, scenario: str = "fragmentation") -> None:
        self.ooms = OomLog()
        self.verdict = OomVerdict.from_dict(CAPTURED[(scenario, "")]["reading"]["last_oom"])
        self.fail_snapshot: Exception | None = None
        self.fail_read: Exception | None = None
        self.segments_seen: list[Any] = []

    def light_snapshot(self) -> dict[str, Any]:
        if self.fail_snapshot is not None:
            raise self.fail_snapshot
        return {"segments": ["light"]}

    def read_oom(self, device, requested, limit_or_total, device_free, segments=None, missing=None):
        if self.fail_read is not None:
            raise self.fail_read
        self.segments_seen.append(segments)
        return replace(
            self.verdict,
            verdict="unknown",
            snapshot="",
            timestamp=time.time(),
            missing="; ".join(missing or []),
        )


class Actions:
    def __init__(self, store: SnapshotStore) -> None:
        self.process = {"pid": "1"}
        self.store = store
        self.counted: list[str] = []

    def capture(self) -> dict[str, Any]:
        return {"segments": ["full"], "device_traces": []}

    def count_snapshot(self, trigger: str) -> None:
        self.counted.append(trigger)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _observer(tmp_path, reader: Reader, **kwargs: Any) -> tuple[OomCapture, Actions, Clock]:
    clock = Clock()
    folder = tmp_path / "snapshots"
    folder.mkdir(mode=0o700)  # the store serves only a folder of this user's alone
    actions = Actions(SnapshotStore(folder))
    return OomCapture(actions, reader, clock=clock, **kwargs), actions, clock


def _wait_for(condition: Any) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _wait_for_snapshot(reader: Reader, device: int = 0) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        last = reader.ooms.last(device)
        if last is not None and last.snapshot:
            return last.snapshot
        time.sleep(0.01)
    raise AssertionError("the OOM snapshot was never linked")


def test_an_oom_gets_its_verdict_and_a_listed_linked_snapshot(tmp_path) -> None:
    reader = Reader()
    capture, actions, _ = _observer(tmp_path, reader)
    capture.observe(0, 1 << 29, 6 << 30, 70 << 30)
    last = reader.ooms.last(0)
    assert last is not None and last.verdict == "fragmentation" and last.observe_s > 0
    assert reader.segments_seen == [["full"]]  # the file's snapshot gave the segments
    snapshot_id = _wait_for_snapshot(reader)
    (listed,) = actions.store.list()
    assert listed.id == snapshot_id and listed.trigger == "oom"
    assert listed.meta["oom"]["verdict"] == "fragmentation"
    assert actions.counted == ["oom"]


def test_the_oom_snapshot_carries_its_verdict_and_the_viewer_shows_it_offline(tmp_path) -> None:
    """A downloaded OOM snapshot keeps the verdict (in the pickle, beside the segments): the
    viewer shows it as a card, from the file alone, with the numbers and the action."""
    import pickle

    from exporter.oom_verdict import SNAPSHOT_KEY
    from exporter.viewer import render_html

    reader = Reader()
    capture, actions, _ = _observer(tmp_path, reader)
    capture.observe(0, 1 << 29, 6 << 30, 70 << 30)
    _wait_for_snapshot(reader)
    (listed,) = actions.store.list()
    kept = pickle.loads(actions.store.path(listed).read_bytes())
    assert kept["segments"] == ["full"]  # PyTorch's own keys as they were
    assert kept[SNAPSHOT_KEY]["verdict"] == "fragmentation"
    assert kept[SNAPSHOT_KEY]["requested_bytes"] == reader.verdict.requested_bytes
    page = render_html({"segments": [], SNAPSHOT_KEY: kept[SNAPSHOT_KEY]}, meta={"file": "x"})
    assert "Out of memory: fragmentation" in page
    assert "asked <b>512 MiB</b>" in page and "largest free block <b>160 MiB</b>" in page
    assert "<b>Do:</b> set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in page
    plain = render_html({"segments": []}, meta={"file": "x", "created": 0.0})
    assert "Out of memory" not in plain and "1970-01-01 00:00:00 UTC" in plain


def test_a_failing_reading_leaves_a_counted_unknown_and_raises_nothing(tmp_path) -> None:
    reader = Reader()
    reader.fail_read = RuntimeError("NVML is gone")
    capture, _, _ = _observer(tmp_path, reader, snapshots=False)
    capture.observe(0, 1 << 29, 6 << 30, 70 << 30)  # must not raise
    last = reader.ooms.last(0)
    assert last is not None and last.verdict == "unknown"
    assert "exporter error: RuntimeError: NVML is gone" in last.missing
    assert last.requested_bytes == 1 << 29 and last.device_free_bytes == 70 << 30
    assert reader.ooms.counts(0) == {"unknown": 1}


def test_the_verdict_is_dated_when_the_allocation_failed_not_when_the_readings_ended(
    tmp_path,
) -> None:
    """A traced snapshot can take seconds (history recording on): the OOM happened before."""
    reader = Reader()
    capture, actions, _ = _observer(tmp_path, reader)
    slow = actions.capture

    def capture_slowly() -> dict[str, Any]:
        time.sleep(0.3)
        return slow()

    actions.capture = capture_slowly  # type: ignore[method-assign]
    before = time.time()
    capture.observe(0, 1 << 29, 6 << 30, 70 << 30)
    last = reader.ooms.last(0)
    assert last is not None and last.observe_s >= 0.3
    assert before <= last.timestamp < before + 0.1


def test_a_failing_snapshot_is_named_and_the_verdict_still_decided(tmp_path) -> None:
    reader = Reader()
    reader.fail_snapshot = RuntimeError("history recording is on")
    capture, _, _ = _observer(tmp_path, reader, snapshots=False)
    capture.observe(0, 1 << 29, 6 << 30, 70 << 30)
    last = reader.ooms.last(0)
    assert last is not None and last.verdict == "fragmentation"
    assert "allocator snapshot: history recording is on" in last.missing
    assert reader.segments_seen == [None]


def test_an_exception_anywhere_in_the_observer_never_reaches_the_oom(tmp_path, caplog) -> None:
    reader = Reader()

    def broken(verdict: OomVerdict, **_: Any) -> bool:
        raise OSError("disk gone")

    reader.ooms.record = broken  # type: ignore[method-assign]
    capture, _, _ = _observer(tmp_path, reader)
    with caplog.at_level(logging.ERROR, "exporter.oom"):
        capture.observe(0, 1 << 29, 6 << 30, 70 << 30)
    assert "OOM verdict failed: OSError: disk gone" in caplog.text


def test_a_storm_logs_once_per_verdict_change_and_snapshots_once_per_cooldown(
    tmp_path, caplog
) -> None:
    reader = Reader()
    capture, actions, clock = _observer(tmp_path, reader, cooldown_s=60.0)
    with caplog.at_level(logging.WARNING, "exporter.oom"):
        for i in range(300):
            clock.now += 0.1  # 300 OOMs in 30 s
            if i == 150:
                reader.verdict = OomVerdict.from_dict(CAPTURED[("cap", "")]["reading"]["last_oom"])
            capture.observe(0, 1 << 29, 6 << 30, 70 << 30)
        _wait_for(lambda: actions.counted == ["oom"])
    verdict_lines = [r for r in caplog.records if r.getMessage().startswith("OOM on cuda:0")]
    assert [r.getMessage().split(": ")[1] for r in verdict_lines] == ["fragmentation", "cap"]
    assert reader.ooms.counts(0) == {"fragmentation": 150, "cap": 150}
    assert len(actions.store.list()) == 1  # one snapshot in the cooldown
    # Every OOM but the first read the light snapshot, not the file's.
    assert reader.segments_seen.count(["full"]) == 1
    assert reader.segments_seen.count(["light"]) == 299


@pytest.mark.parametrize("enabled", [False])
def test_a_disabled_observer_does_nothing(tmp_path, enabled: bool) -> None:
    reader = Reader()
    capture, _, _ = _observer(tmp_path, reader)
    capture.enabled = enabled
    capture.observe(0, 1 << 29, 6 << 30, 70 << 30)
    assert reader.ooms.last(0) is None
