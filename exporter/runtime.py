"""Wiring shared by every way of running: sources -> sampler -> collector -> registry, and the
actions implementation of the mode (exporter.actions), picked once here."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

from exporter import __version__
from exporter.actions.base import Actions
from exporter.actions.local import LocalActions
from exporter.actions.snapshots import SnapshotStore
from exporter.config import Config
from exporter.detectors import Detectors, load_thresholds
from exporter.detectors import Listener as AlertListener
from exporter.exposition import ExpositionCache
from exporter.http.admin import Admin
from exporter.identity import identity_labels
from exporter.metrics import ActionStats, SampleCollector
from exporter.sampler import Listener, Sampler
from exporter.sources import Source
from exporter.sources.non_allocator import NonAllocatorProbe
from exporter.window import SampleWindow

MODES = ("embedded", "node", "demo", "run")


@dataclass
class Runtime:
    config: Config
    mode: str
    sampler: Sampler
    registry: CollectorRegistry
    collector: SampleCollector
    detectors: Detectors
    actions: Actions
    admin: Admin
    window: SampleWindow  # recent samples, for the live page (exporter.http.page)
    # Why /readyz answers 503, or None when ready; picked once for the mode (readiness).
    not_ready: Callable[[], str | None]
    # /metrics bytes rendered once per tick; None where the registry is not ours (attach():
    # the host's other metrics change between our ticks and must not be served stale).
    exposition: ExpositionCache | None = None


def default_actions(mode: str, config: Config, sources: Sequence[Source] = ()) -> Actions:
    """The demo answers from its recording, at the moment its replay source plays; every
    other mode but `run` (which passes its fan-out) acts on this process's own allocator."""
    store = SnapshotStore.for_config(config)
    if mode == "demo":
        from exporter.actions.replay import ReplayActions
        from exporter.sources.replay import ReplaySource

        replays = [s for s in sources if isinstance(s, ReplaySource)]
        return ReplayActions(store, config=config, moment=replays[0].moment if replays else None)
    return LocalActions(store, config=config)


def live_sources(
    config: Config, *, torch: bool, gpu_users: Callable[[], Hashable] | None = None
) -> list[Source]:
    """The sources that read this machine, as the config enables them. `gpu_users` (under
    `run`: the reporting processes and their GPUs) makes NVML read its process list at once
    when it changes."""
    sources: list[Source] = []
    allocator = None
    if torch and config.torch:
        from exporter.sources.torch_allocator import TorchAllocatorSource

        allocator = TorchAllocatorSource(
            layout_interval_s=config.layout_interval_s,
            layout_max_blocks=config.layout_max_blocks,
            non_allocator=NonAllocatorProbe.for_config(config),
        )
        sources.append(allocator)
    if config.nvml:
        from exporter.sources.nvml import NvmlSource

        # Inside a server, only the GPUs this process uses (read after the allocator, in the
        # same tick): every GPU of the node in every process would be O(GPUs^2) series per
        # node. The node daemon and `run` read every GPU they can see.
        uuids = (lambda: allocator.uuids_in_use) if allocator is not None else None
        sources.append(
            NvmlSource(
                only_uuids=uuids, process_interval_s=config.process_interval_s, users=gpu_users
            )
        )
    if config.host_memory:
        from exporter.sources.host import HostMemorySource

        sources.append(HostMemorySource())
    return sources


def kubelet_source(
    config: Config, pids: Callable[[], Collection[int]], env: Mapping[str, str] = os.environ
) -> Source | None:
    """The node daemon's Kubernetes attribution, or None where it is off: "off", or no socket
    configured outside Kubernetes with no kubelet socket at the default path. Inside
    Kubernetes a missing socket is a state on /metrics, never a silent absence."""
    from exporter.kubernetes.podresources import DEFAULT_SOCKET

    socket = config.kubelet_socket
    if socket == "off":
        return None
    if not socket:
        if "KUBERNETES_SERVICE_HOST" not in env and not os.path.exists(DEFAULT_SOCKET):
            return None
        socket = DEFAULT_SOCKET
    from exporter.kubernetes.pods import PodsClient
    from exporter.sources.kubelet import DEFAULT_RESOURCES, KubeletSource

    def pods() -> PodsClient:
        return PodsClient.in_cluster(env, timeout_s=config.kubelet_timeout_s)

    return KubeletSource(
        pids,
        socket_path=socket,
        refresh_s=config.kubelet_refresh_s,
        timeout_s=config.kubelet_timeout_s,
        resources=(*DEFAULT_RESOURCES, *config.kubelet_resources),
        pods=pods if config.kubelet_pod_reader else None,
    )


def readiness(mode: str, sampler: Sampler) -> Callable[[], str | None]:
    """What /readyz asks: every mode needs its first sample; the node daemon, which exists to
    read NVML, also needs a GPU that answers it (blind_reason)."""
    if mode == "node":
        return lambda: blind_reason(sampler)
    return lambda: "no sample yet" if sampler.latest is None else None


def blind_reason(sampler: Sampler) -> str | None:
    """Why a node daemon cannot see any GPU, or None while it sees one. It exists to read
    NVML: without it (no library, no driver, no GPU visible, a container without the NVIDIA
    runtime) it is not ready, whatever else it serves."""
    state = sampler.state()
    nvml = state.sources.get("nvml")
    if nvml is None:
        return "NVML is turned off (GPUMEM_NVML)"
    if state.sample is None:
        return "no sample yet"
    if nvml.unavailable:
        return f"NVML: {nvml.unavailable}"
    if not nvml.up:
        return f"NVML read failed: {nvml.last_error or 'unknown error'}"
    if not any(gpu.up for gpu in state.sample.gpus):
        return "no GPU answers NVML" if state.sample.gpus else "NVML lists no GPU"
    return None


def build_runtime(
    config: Config,
    *,
    mode: str,
    sources: Sequence[Source],
    actions: Actions | None = None,
    registry: CollectorRegistry | None = None,
    listeners: Sequence[Listener] = (),
    on_alert: Sequence[AlertListener] = (),
) -> Runtime:
    """Create the sampler, detectors and admin state around `actions` (this process's own
    allocator unless the mode passes another implementation); register the collector.

    A new registry gets client_python's process metrics: this process's own, in every mode
    (a replay serves the recorded process as host_process_*, never under `process_` names).
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    if actions is None:
        actions = default_actions(mode, config, sources)
    owns_registry = registry is None
    if registry is None:
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
    detectors = Detectors(load_thresholds(), listeners=list(on_alert))
    features = actions.sample_listeners(detectors)
    window = SampleWindow(config.interval_s)
    sampler = Sampler(
        sources,
        interval_s=config.interval_s,
        listeners=[detectors, *features, window, *listeners],
    )
    admin = Admin(config, actions, sampler, detectors, mode)

    def action_stats() -> ActionStats:
        return ActionStats(processes=actions.counts(), admin_requests=dict(admin.requests))

    torch_module = sys.modules.get("torch")  # never import torch just to learn its version
    collector = SampleCollector(
        sampler.state,
        const_labels=identity_labels(os.environ, config.labels),
        version=__version__,
        mode=mode,
        torch_version=str(getattr(torch_module, "__version__", "")),
        own_process=not actions.replay,
        alerts=detectors.firing,
        actions=action_stats,
        alerts_version=lambda: detectors.evaluations,
    )
    registry.register(collector)
    exposition = ExpositionCache(registry, collector.fingerprint) if owns_registry else None
    return Runtime(
        config,
        mode,
        sampler,
        registry,
        collector,
        detectors,
        actions,
        admin,
        window,
        readiness(mode, sampler),
        exposition,
    )
