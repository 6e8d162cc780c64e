"""`gpumem-exporter demo`: a trace recorded on a real GPU, replayed."""

from __future__ import annotations

from collections.abc import Sequence

from exporter import catalog
from exporter.actions.base import Actions
from exporter.actions.snapshots import SnapshotStore
from exporter.config import Config, ConfigError
from exporter.modes.mode import Mode, first_sample
from exporter.sources import Source
from exporter.traits import Traits


def replay_actions(config: Config, sources: Sequence[Source]) -> Actions:
    """The demo answers from its recording, at the moment its replay source plays, as the
    recorded process; it keeps its snapshots in a folder of its own (unless one is set),
    never among other exporters' in the shared default folder."""
    from exporter.actions.replay import ReplayActions, recorded_snapshots
    from exporter.sources.replay import ReplaySource

    replays = [s for s in sources if isinstance(s, ReplaySource)]
    replay = replays[0] if replays else None
    snapshots = []
    if replay is not None and replay.snapshots is not None:
        try:
            snapshots = recorded_snapshots(replay.snapshots)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"snapshots of the trace ({replay.snapshots}): {exc}") from None
    process = replay.recorded_process() if replay else None
    folder = None if config.snapshot_dir else demo_folder()
    store = SnapshotStore.for_config(config, directory=folder, process=process)
    return ReplayActions(
        store,
        config=config,
        moment=replay.moment if replay else None,
        snapshots=snapshots,
        ooms=replay.recorded_ooms() if replay else None,
        process=process,
    )


def demo_folder() -> str:
    """A private folder for one demo's snapshots, removed when the demo exits (the CLI turns
    SIGTERM into a normal exit for this)."""
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="gpumem-demo-")  # 0700, this user's alone
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


MODE = Mode(
    # The recording's allocator, GPUs, host and process; the process that serves is not it.
    Traits(
        "demo",
        frozenset({catalog.ALLOCATOR, catalog.DEVICES, catalog.HOST, catalog.HOST_PROCESSES}),
        recorded=True,
        admin_open=True,
    ),
    "`gpumem-exporter demo`: a trace recorded on a real GPU, replayed",
    "its own HTTP server",
    "the recording: the snapshot of the replayed moment; nothing changes",
    "the first sample is in",
    first_sample,
    replay_actions,
)
