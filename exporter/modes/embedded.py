"""Inside a PyTorch server: exporter.start() or attach() (exporter.embedded)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from exporter.actions.base import Actions
from exporter.actions.local import LocalActions
from exporter.actions.snapshots import SnapshotStore
from exporter.catalog import ALLOCATOR as ALLOCATOR_READ
from exporter.catalog import DEVICES, HOST, OWN_PROCESS
from exporter.config import Config
from exporter.modes.mode import Mode, first_sample
from exporter.sources import ALLOCATOR, DEVICE_MEMORY, HOST_MEMORY, OOM_VERDICTS, Source, providing
from exporter.traits import Traits


def local_actions(config: Config, sources: Sequence[Source]) -> Actions:
    """This process's own allocator (embedded, and the node daemon's empty one), with the
    allocator source reading its OOMs where one runs."""
    readers: list[Any] = providing(sources, OOM_VERDICTS)
    return LocalActions(
        SnapshotStore.for_config(config),
        config=config,
        oom_reader=readers[0] if readers else None,
    )


MODE = Mode(
    Traits("embedded", frozenset({ALLOCATOR_READ, DEVICES, HOST, OWN_PROCESS})),
    "inside a PyTorch server: exporter.start(), or attach() to its own app",
    "its own HTTP thread (start), or routes on the app and registry it has (attach)",
    "this process's allocator",
    "the first sample is in",
    first_sample,
    local_actions,
    reads=(ALLOCATOR, DEVICE_MEMORY, HOST_MEMORY),
)
