"""Wiring shared by every way of running: sources -> sampler -> collector -> registry."""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

from exporter import __version__
from exporter.actions import Actions, ReplayActions
from exporter.admin import Admin
from exporter.aggregator import Aggregator
from exporter.config import Config
from exporter.detectors import Detectors, load_thresholds
from exporter.detectors import Listener as AlertListener
from exporter.metrics import (
    HOST_GAUGES,
    REPLAY_HOST_GAUGES,
    ActionStats,
    SampleCollector,
    identity_labels,
)
from exporter.oom import OomCapture
from exporter.remediation import Remediation
from exporter.sample import Sample
from exporter.sampler import Listener, Sampler
from exporter.snapshots import SnapshotStore
from exporter.sources import Source


@dataclass
class Runtime:
    config: Config
    mode: str
    sampler: Sampler
    registry: CollectorRegistry
    collector: SampleCollector
    detectors: Detectors
    actions: Actions
    remediation: Remediation | None
    admin: Admin


def live_sources(config: Config, *, torch: bool) -> list[Source]:
    """The sources that read this machine, as the config enables them."""
    sources: list[Source] = []
    if torch and config.torch:
        from exporter.sources.torch_allocator import TorchAllocatorSource

        sources.append(TorchAllocatorSource())
    if config.nvml:
        from exporter.sources.nvml import NvmlSource

        sources.append(NvmlSource())
    if config.host_memory:
        from exporter.sources.host import HostMemorySource

        sources.append(HostMemorySource())
    return sources


def when_cuda_ready(action: Callable[[], object], name: str) -> Listener:
    """A sampler listener that runs `action` once, on the first sample where this process
    has a CUDA device in use: hooks that could initialize CUDA must wait for the host."""
    done = False

    def listener(sample: Sample) -> None:
        nonlocal done
        if not done and sample.allocators:
            done = True
            action()

    listener.__name__ = name
    return listener


def build_runtime(
    config: Config,
    *,
    mode: str,
    sources: Sequence[Source],
    registry: CollectorRegistry | None = None,
    listeners: Sequence[Listener] = (),
    on_alert: Sequence[AlertListener] = (),
    aggregator: Aggregator | None = None,
) -> Runtime:
    """Create the sampler, detectors, actions and admin state; register the collector.

    A new registry gets client_python's process metrics, except in a replay, which serves the
    recorded process's resident memory instead of its own.
    """
    replay = mode == "demo"
    if registry is None:
        registry = CollectorRegistry()
        if not replay:
            ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
    detectors = Detectors(load_thresholds(), listeners=list(on_alert))
    store = SnapshotStore(
        config.snapshot_directory,
        max_count=config.snapshot_max_count,
        max_bytes=config.snapshot_max_bytes,
    )
    actions: Actions = ReplayActions(store) if replay else Actions(store)
    all_listeners: list[Listener] = [detectors]
    remediation = None
    if config.remediate:
        remediation = Remediation(actions, detectors, cooldown_s=config.remediate_cooldown_s)
        detectors.listeners.append(remediation)
    if config.oom_snapshot and not replay:
        oom = OomCapture(actions, cooldown_s=config.oom_snapshot_cooldown_s)
        all_listeners.append(when_cuda_ready(oom.attach, "oom_capture"))
    if config.history_max_entries and not replay:
        all_listeners.append(
            when_cuda_ready(
                lambda: actions.start_history(
                    max_entries=config.history_max_entries, owner="startup"
                ),
                "history_startup",
            )
        )
    sampler = Sampler(sources, interval_s=config.interval_s, listeners=[*all_listeners, *listeners])
    admin = Admin(config, actions, sampler, detectors, mode, aggregator=aggregator)

    def action_stats() -> ActionStats:
        counts = remediation.counts if remediation is not None else Counter()
        return ActionStats(
            snapshots=dict(actions.counts.snapshots),
            empty_cache_released_bytes=actions.counts.released_bytes_total,
            remediations=dict(counts),
            admin_requests=dict(admin.requests),
        )

    torch_module = sys.modules.get("torch")  # never import torch just to learn its version
    collector = SampleCollector(
        sampler.state,
        const_labels=identity_labels(os.environ, config.labels),
        version=__version__,
        mode=mode,
        torch_version=str(getattr(torch_module, "__version__", "")),
        host_gauges=REPLAY_HOST_GAUGES if replay else HOST_GAUGES,
        alerts=detectors.firing,
        actions=action_stats,
    )
    registry.register(collector)
    return Runtime(
        config, mode, sampler, registry, collector, detectors, actions, remediation, admin
    )
