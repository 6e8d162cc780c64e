"""Inside a PyTorch server: exporter.start() or attach() (exporter.embedded)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from exporter import catalog, sources
from exporter.actions.base import Actions
from exporter.actions.local import LocalActions
from exporter.actions.snapshots import SnapshotStore
from exporter.config import Config
from exporter.modes.mode import Mode, first_sample
from exporter.sources import Source, providing
from exporter.traits import Traits


def local_actions(config: Config, made: Sequence[Source]) -> Actions:
    """This process's own allocator (embedded, and the node daemon's empty one), with the
    allocator source reading its OOMs where one runs."""
    readers: list[Any] = providing(made, sources.OOM_VERDICTS)
    return LocalActions(
        SnapshotStore.for_config(config),
        config=config,
        oom_reader=readers[0] if readers else None,
        component_problems=getattr(readers[0], "component_problems", None) if readers else None,
    )


MODE = Mode(
    Traits(
        "embedded",
        frozenset({catalog.ALLOCATOR, catalog.DEVICES, catalog.HOST, catalog.OWN_PROCESS}),
    ),
    "inside a PyTorch server: attach() to its own app, or exporter.start() where the host's "
    "code takes the samples (on_alert, listeners, record_to, serve_http=False, helper=False)",
    "routes on the app and registry it has (attach), or its own HTTP thread (start)",
    "this process's allocator",
    "the first sample is in",
    first_sample,
    local_actions,
    reads=(sources.ALLOCATOR, sources.DEVICE_MEMORY, sources.HOST_MEMORY),
)
