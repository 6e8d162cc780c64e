"""The actions interface every mode implements, and the per-process result shape.

Every action answers a list of `ProcessResult`s, one per process it ran in: one entry for an
embedded exporter or the demo, one per selected process under `gpumem-exporter run`. So one
client reads every mode the same way. The actions themselves are declared in
exporter.actions.spec; adding one means its declaration there and one method in
`ActionMethods` and each implementation of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from exporter.actions.errors import (  # noqa: F401 - where callers have always found them
    OUTCOME_STATUS,
    ActionConflict,
    ActionCooldown,
    ActionFailed,
    ActionInsufficientStorage,
    ActionUnavailable,
)
from exporter.sample import ProcessCounts

if TYPE_CHECKING:
    from exporter.actions.snapshots import SnapshotStore
    from exporter.detectors import Detectors
    from exporter.sampler import Listener

DEFAULT_HISTORY_ENTRIES = 100_000


@dataclass(frozen=True)
class Target:
    """Which processes an action is for: all (the default), or one pid or rank."""

    pid: int | None = None
    rank: int | None = None

    @property
    def selective(self) -> bool:
        return self.pid is not None or self.rank is not None

    def matches(self, process: Mapping[str, str]) -> bool:
        return (self.pid is None or process.get("pid") == str(self.pid)) and (
            self.rank is None or process.get("rank") == str(self.rank)
        )

    def describe(self) -> str:
        parts = [f"pid {self.pid}" if self.pid is not None else ""]
        parts.append(f"rank {self.rank}" if self.rank is not None else "")
        return " and ".join(p for p in parts if p) or "any process"


@dataclass
class ProcessResult:
    """What one action did in one process."""

    process: dict[str, str]
    ok: bool
    result: dict[str, Any] | None = None
    error: str | None = None
    outcome: str = "ok"
    retry_after_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class HistoryParams:
    max_entries: int = DEFAULT_HISTORY_ENTRIES
    stacks: str = "python"
    context: str = "all"


class ActionMethods(Protocol):
    """The actions, as methods of an implementation that runs them itself (this process's
    allocator, or the demo's recording). Every method returns one result per process it ran
    in; an empty list means no process matched `target` (or none uses CUDA yet)."""

    def snapshot(
        self, target: Target, *, record_s: float | None = None, history: HistoryParams
    ) -> list[ProcessResult]:
        """Snapshot now, or record history for `record_s` and then dump (status recording)."""
        ...

    def stop_capture(self, target: Target) -> list[ProcessResult]:
        """End a windowed capture now and write what it recorded (`stopped`: its entry, or
        None where none was recording)."""
        ...

    def empty_cache(self, target: Target, *, device: int | None = None) -> list[ProcessResult]: ...

    def history(self, target: Target) -> list[ProcessResult]: ...

    def set_history(
        self,
        target: Target,
        *,
        enabled: bool,
        history: HistoryParams,
        snapshot_before_stop: bool = True,
    ) -> list[ProcessResult]: ...

    def reset_peak(self, target: Target, *, device: int | None = None) -> list[ProcessResult]: ...


class Actions(Protocol):
    """The allocator actions of a mode, as the admin API calls them."""

    store: SnapshotStore

    def perform(
        self, action: str, target: Target, params: Mapping[str, Any]
    ) -> list[ProcessResult]:
        """Run the action of this name (exporter.actions.spec) with its checked parameters:
        in this process, or in each selected process of a `run` server."""
        ...

    def counts(self) -> list[ProcessCounts]:
        """Counts of actions done so far, per process (for /metrics)."""
        ...

    def sample_listeners(self, detectors: Detectors) -> list[Listener]:
        """Features that run in the process owning the allocator (OOM capture, history from
        start-up, remediation): this mode's listeners for the sampler."""
        ...
