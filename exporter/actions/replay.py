"""The demo's actions: answered from the snapshot recorded beside the demo trace.

Nothing is freed or reset; every response says it is a replay. The recorded process stands in
for this one, so the same client and CLI work against the demo as against a real server.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporter.actions.base import ActionUnavailable
from exporter.actions.local import EmptyCacheResult, LocalActions

if TYPE_CHECKING:
    from exporter.detectors import Detectors
    from exporter.sampler import Listener


def demo_snapshot_path() -> Path:
    return Path(str(resources.files("exporter") / "data" / "demo_snapshot.pickle.gz"))


class ReplayActions(LocalActions):
    replay = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._snapshot: dict[str, Any] | None = None

    @property
    def _recorded(self) -> dict[str, Any]:
        if self._snapshot is None:  # loaded on first use: the demo starts without it
            from exporter.viewer import load_snapshot

            self._snapshot = load_snapshot(demo_snapshot_path())
        return self._snapshot

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
