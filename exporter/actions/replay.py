"""The demo's actions: answered from the snapshots recorded beside the demo trace.

The recording asked its exporter for snapshots as it ran (scripts/record_demo_trace.py); the
demo answers with the one taken at, or last before, the moment of the trace it replays, so a
snapshot taken during the OOM shows the OOM. Nothing is freed or reset; every response says
it is a replay. The recorded process stands in for this one, so the same client and CLI work
against the demo as against a real server.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporter.actions.base import ActionUnavailable
from exporter.actions.local import EmptyCacheResult, LocalActions
from exporter.actions.snapshots import SnapshotInfo

if TYPE_CHECKING:
    from exporter.detectors import Detectors
    from exporter.sampler import Listener


DEMO_SNAPSHOTS = "demo_snapshots"


def demo_snapshots() -> list[tuple[float, Path]]:
    """The demo's recorded snapshots: (second of the trace it shows, file), in order."""
    folder = Path(str(resources.files("exporter") / "data" / DEMO_SNAPSHOTS))
    index = json.loads((folder / "index.json").read_text())
    return sorted((float(entry["offset_s"]), folder / entry["file"]) for entry in index)


def demo_snapshot_path(offset_s: float | None = None) -> Path:
    """The snapshot of second `offset_s` of the demo trace: the last one taken at or before
    it (the first one before any was taken); without `offset_s`, the OOM's."""
    return _snapshot_at(offset_s)[1]


def _snapshot_at(offset_s: float | None) -> tuple[float, Path]:
    snapshots = demo_snapshots()
    if offset_s is None:
        return next(s for s in snapshots if s[1].name.endswith("-oom.pickle.gz"))
    taken = [s for s in snapshots if s[0] <= offset_s]
    return taken[-1] if taken else snapshots[0]


class ReplayActions(LocalActions):
    replay = True

    def __init__(
        self, *args: Any, moment: Callable[[], float] | None = None, **kwargs: Any
    ) -> None:
        """`moment()`: the second of the trace being replayed now (ReplaySource.moment)."""
        super().__init__(*args, **kwargs)
        self._moment = moment or (lambda: 0.0)
        self._loaded: tuple[Path, dict[str, Any]] | None = None
        self._writing: tuple[float, Path] | None = None  # the snapshot being written

    @property
    def _recorded(self) -> dict[str, Any]:
        path = (self._writing or _snapshot_at(self._moment()))[1]
        if self._loaded is None or self._loaded[0] != path:  # loaded on use, not at start
            from exporter.viewer import load_snapshot

            self._loaded = (path, load_snapshot(path))
        return self._loaded[1]

    def write_snapshot(
        self,
        trigger: str = "api",
        info: SnapshotInfo | None = None,
        meta: dict[str, Any] | None = None,
    ) -> SnapshotInfo:
        """The recorded snapshot of this moment of the trace, saying which moment it is."""
        self._writing = _snapshot_at(self._moment())
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
        # to record history from.
        self._arm_remediation(detectors)
        return []

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

    def capture(self) -> Any:
        return self._recorded

    def _history_recorder(self, *, starting: bool) -> Callable[..., None]:
        return lambda **settings: None  # the state is kept; nothing records

    def reset_peak_now(self, device: int | None = None) -> list[int]:
        devices = self._recorded_devices(device)
        return [device] if device is not None else devices
