"""What serves the agents' processes, `run`'s launcher and exporter.start()'s helper alike: the
runtime over the aggregator (the web stack: imported by the serving processes never)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from exporter.actions.snapshots import SnapshotStore
from exporter.config import Config
from exporter.runtime import Runtime, build_runtime, sources_for
from exporter.sources import Source
from exporter.sources.process_memory import ProcessMemorySource
from exporter.transport.aggregator import Aggregator
from exporter.transport.fanout import FanOutActions


def serving_runtime(
    config: Config, mode: str, aggregator: Aggregator, pids: Callable[[], Iterable[int]]
) -> tuple[Runtime, list[Source]]:
    """What serves the agents' processes, `run`'s launcher and exporter.start()'s helper
    alike: their allocators (the aggregator), the host memory of `pids`, this machine's
    sources, and admin actions fanned out to the agents. Also the machine's sources."""

    def agent_labels() -> dict[int, dict[str, str]]:
        return {int(p["pid"]): p for p in aggregator.processes() if p.get("pid")}

    server_processes = ProcessMemorySource(pids, labels=agent_labels)
    machine = sources_for(mode, config, gpu_users=aggregator.gpu_users)
    sources: list[Source] = [aggregator, server_processes, *machine]
    actions = FanOutActions(aggregator, SnapshotStore.for_config(config))
    return build_runtime(config, mode=mode, sources=sources, actions=actions), machine
