"""The demo's actions: answered from the snapshots recorded beside the trace it replays.

The recording asked its exporter for snapshots as it ran (scripts/record_demo_trace.py writes
them into a folder with an index.json, named by the second of the trace each shows); the demo
answers with the one taken at, or last before, the moment it replays, so a snapshot taken
during the OOM shows the OOM. A trace with no such folder (one made by `record` or
`exporter.start(record_to=...)`) says so instead of answering from another recording. Nothing
is freed or reset; every response says it is a replay. The recorded process stands in for
this one (its pid and role, as the page shows them), so the same client and CLI work against
the demo as against a real server.

The snapshot the recorded server's OOM observer took is put in the demo's own folder as soon
as the replay reaches that OOM, under the id the verdict links to: listed with trigger `oom`,
counted, and reachable for as long as the demo runs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporter.actions.base import ActionUnavailable
from exporter.actions.local import EmptyCacheResult, LocalActions
from exporter.actions.snapshots import ID_PATTERN, SnapshotInfo
from exporter.oom_verdict import OomVerdict
from exporter.sample import Sample
from exporter.sources.replay import demo_snapshots_folder

if TYPE_CHECKING:
    from exporter.detectors import Detectors
    from exporter.sampler import Listener

log = logging.getLogger("exporter.actions")


def recorded_snapshots(folder: Path | None = None) -> list[tuple[float, Path]]:
    """A recording's snapshots: (second of the trace it shows, file), in order; the packaged
    demo's without `folder`. OSError/ValueError where the folder holds no readable index."""
    folder = folder or demo_snapshots_folder()
    index = json.loads((folder / "index.json").read_text())
    return sorted((float(entry["offset_s"]), folder / entry["file"]) for entry in index)


def demo_snapshot_path(offset_s: float | None = None) -> Path:
    """The packaged demo's snapshot of second `offset_s` (the last one taken at or before it,
    the first one before any was taken); without `offset_s`, the OOM's."""
    return _snapshot_at(recorded_snapshots(), offset_s)[1]


def _snapshot_at(snapshots: list[tuple[float, Path]], offset_s: float | None) -> tuple[float, Path]:
    if offset_s is None:
        return next(s for s in snapshots if s[1].name.endswith("-oom.pickle.gz"))
    taken = [s for s in snapshots if s[0] <= offset_s]
    return taken[-1] if taken else snapshots[0]


class ReplayActions(LocalActions):
    def __init__(
        self,
        *args: Any,
        moment: Callable[[], float] | None = None,
        snapshots: list[tuple[float, Path]] | None = None,
        ooms: list[tuple[float, float, int, OomVerdict]] | None = None,
        **kwargs: Any,
    ) -> None:
        """`moment()`: the second of the trace being replayed now (ReplaySource.moment);
        `snapshots`: the recording's (recorded_snapshots), none for a trace without; `ooms`:
        its OOM verdicts that link a snapshot (ReplaySource.recorded_ooms)."""
        super().__init__(*args, **kwargs)
        self._moment = moment or (lambda: 0.0)
        self._snapshots = snapshots or []
        self._ooms = ooms or []
        self._loaded: tuple[Path, dict[str, Any]] | None = None
        self._writing: tuple[float, Path] | None = None  # the snapshot being written
        self._published: set[str] = set()  # OOM snapshots put in the demo's folder

    def _recording_at(self, offset_s: float | None) -> tuple[float, Path]:
        if not self._snapshots:
            raise ActionUnavailable(
                "this trace has no recorded snapshots: only a recording made with "
                "scripts/record_demo_trace.py --snapshots DIR has them (pass the folder with "
                "`demo --snapshots DIR`)",
                unsupported=True,
            )
        return _snapshot_at(self._snapshots, offset_s)

    def _load(self, path: Path) -> dict[str, Any]:
        if self._loaded is None or self._loaded[0] != path:  # loaded on use, not at start
            from exporter.viewer import load_snapshot

            self._loaded = (path, load_snapshot(path))
        return self._loaded[1]

    @property
    def _recorded(self) -> dict[str, Any]:
        return self._load((self._writing or self._recording_at(self._moment()))[1])

    def write_snapshot(
        self,
        trigger: str = "api",
        info: SnapshotInfo | None = None,
        meta: dict[str, Any] | None = None,
    ) -> SnapshotInfo:
        """The recorded snapshot of this moment of the trace, saying which moment it is."""
        self._writing = self._recording_at(self._moment())
        at, path = self._writing
        how = path.name.split("-", 1)[1].removesuffix(".pickle.gz")  # api, oom, record
        recorded = {"recorded": f"second {at:.0f} of the demo trace ({how} snapshot)"}
        try:
            return super().write_snapshot(trigger, info, {**recorded, **(meta or {})})
        finally:
            self._writing = None

    def _recorded_devices(self, device: int | None) -> list[int]:
        """The recorded devices; `device`, if given, must be one of them."""
        devices = sorted({s["device"] for s in self._recorded["segments"]})
        if device is not None and device not in devices:
            raise ActionUnavailable(f"device {device} is not in the recording ({devices})")
        return devices

    def sample_listeners(self, detectors: Detectors) -> list[Listener]:
        # Remediation acts on the replayed alerts; there is no allocator to watch for OOMs or
        # to record history from: the recorded OOMs' snapshots are published as they replay.
        self._arm_remediation(detectors)
        return [self.publish_oom_snapshots]

    def publish_oom_snapshots(self, sample: Sample) -> None:
        """Put the snapshot taken at each recorded OOM into the demo's folder once the replay
        has passed that OOM (a sampler listener), under the id its verdict links to. By the
        recording, not by the sample: a verdict may show for less than one tick."""
        oom_files = [s for s in self._snapshots if s[1].name.endswith("-oom.pickle.gz")]
        now = self._moment()
        for seen, at, device, verdict in self._ooms:
            if verdict.snapshot in self._published or seen > now:
                continue  # listed already, or not reached yet
            self._published.add(verdict.snapshot)
            # The observer's file, written once its snapshot was taken: the first at or after
            # the OOM.
            files = [f for f in oom_files if f[0] >= at - 1.0]
            if not files or not ID_PATTERN.fullmatch(verdict.snapshot):
                continue  # a recording without its OOM snapshot: the verdict has no link
            offset, path = files[0]
            info = SnapshotInfo(id=verdict.snapshot, trigger="oom", created=time.time())
            meta = {
                "process": self.process,
                "device": device,
                "oom": verdict.to_dict(),
                "recorded": f"second {offset:.0f} of the demo trace (oom snapshot)",
            }
            self.store.write(self._load(path), "oom", device=device, info=info, meta=meta)
            self.count_snapshot("oom")
            log.info("replayed OOM: its snapshot %s is listed", verdict.snapshot)

    def empty_cache_now(self, device: int | None = None, trigger: str = "api") -> EmptyCacheResult:
        # What empty_cache would have released: the segments with nothing active in them.
        devices = self._recorded_devices(device)
        segments = self._recorded["segments"]
        before = {d: sum(s["total_size"] for s in segments if s["device"] == d) for d in devices}
        after = {
            d: sum(s["total_size"] for s in segments if s["device"] == d and s["active_size"] > 0)
            for d in devices
        }
        return EmptyCacheResult(devices, before, after, 0.0)

    def _empty_cache_answer(self, result: EmptyCacheResult) -> dict[str, Any]:
        """What empty_cache would release at the replayed moment; nothing is released."""
        answer = result.public()
        would = answer.pop("released_bytes")
        moment = f"second {self._moment():.1f} of the replayed trace"
        return {"would_release_bytes": would, "recorded": moment, **answer}

    def capture(self) -> Any:
        return self._recorded

    def _history_recorder(self, *, starting: bool) -> Callable[..., None]:
        return lambda **settings: None  # the state is kept; nothing records

    def reset_peak_now(self, device: int | None = None) -> list[int]:
        devices = self._recorded_devices(device)
        return [device] if device is not None else devices
