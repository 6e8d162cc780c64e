"""`gpumem-exporter run`: each action runs in the server's processes, through their agents.

The launcher never uses CUDA; the processes that do answer with the same LocalActions methods
an embedded exporter uses (exporter.run.agent), so each method here is one line.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from exporter.actions.base import HistoryParams, ProcessResult, Target
from exporter.actions.snapshots import SnapshotStore
from exporter.sample import ProcessCounts

if TYPE_CHECKING:
    from exporter.detectors import Detectors
    from exporter.run.aggregator import Aggregator
    from exporter.sampler import Listener

# Seconds to wait for a process's answer beyond the work asked of it.
ANSWER_TIMEOUT_S = 60.0


class FanOutActions:
    replay = False

    def __init__(self, aggregator: Aggregator, store: SnapshotStore) -> None:
        self.aggregator = aggregator
        self.store = store  # the agents write into the same folder: one listing for the pod

    def _all(self, target: Target, action: str, **params: Any) -> list[ProcessResult]:
        return self.aggregator.command(action, params, target, timeout_s=ANSWER_TIMEOUT_S)

    def snapshot(
        self, target: Target, *, record_s: float | None = None, history: HistoryParams
    ) -> list[ProcessResult]:
        return self._all(target, "snapshot", record_s=record_s, history=asdict(history))

    def stop_capture(self, target: Target) -> list[ProcessResult]:
        return self._all(target, "stop_capture")

    def empty_cache(self, target: Target, *, device: int | None = None) -> list[ProcessResult]:
        return self._all(target, "empty_cache", device=device)

    def history(self, target: Target) -> list[ProcessResult]:
        return self._all(target, "history")

    def set_history(
        self,
        target: Target,
        *,
        enabled: bool,
        history: HistoryParams,
        snapshot_before_stop: bool = True,
    ) -> list[ProcessResult]:
        return self._all(
            target,
            "set_history",
            enabled=enabled,
            history=asdict(history),
            snapshot_before_stop=snapshot_before_stop,
        )

    def reset_peak(self, target: Target, *, device: int | None = None) -> list[ProcessResult]:
        return self._all(target, "reset_peak", device=device)

    def counts(self) -> list[ProcessCounts]:
        return self.aggregator.action_counts()

    def sample_listeners(self, detectors: Detectors) -> list[Listener]:
        return []  # OOM capture, history and remediation run in each agent
