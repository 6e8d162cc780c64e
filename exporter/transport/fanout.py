"""`gpumem-exporter run`: each action runs in the server's processes, through their agents.

The launcher never uses CUDA; the processes that do run each action with the same LocalActions
an embedded exporter uses (exporter.transport.agent), so an action is sent by its name with its
checked parameters (exporter.actions.spec) and nothing here knows one action from another.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from exporter.actions.base import ProcessResult, Target
from exporter.actions.snapshots import SnapshotStore
from exporter.sample import ProcessCounts

if TYPE_CHECKING:
    from exporter.detectors import Detectors
    from exporter.sampler import Listener
    from exporter.transport.aggregator import Aggregator

# Seconds to wait for a process's answer beyond the work asked of it.
ANSWER_TIMEOUT_S = 60.0


class FanOutActions:
    def __init__(self, aggregator: Aggregator, store: SnapshotStore) -> None:
        self.aggregator = aggregator
        self.store = store  # the agents write into the same folder: one listing for the pod

    def perform(
        self, action: str, target: Target, params: Mapping[str, Any]
    ) -> list[ProcessResult]:
        return self.aggregator.command(action, dict(params), target, timeout_s=ANSWER_TIMEOUT_S)

    def counts(self) -> list[ProcessCounts]:
        return self.aggregator.action_counts()

    def sample_listeners(self, detectors: Detectors) -> list[Listener]:
        return []  # OOM capture, history and remediation run in each agent
