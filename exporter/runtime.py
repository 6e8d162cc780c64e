"""Wiring shared by every way of running: sources -> sampler -> collector -> registry, and the
actions implementation of the mode (exporter.actions), picked once here."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.registry import Collector

from exporter.actions.base import Actions
from exporter.actions.local import LocalActions
from exporter.actions.snapshots import SnapshotStore
from exporter.config import Config, ConfigError
from exporter.detectors import Detectors
from exporter.detectors import Listener as AlertListener
from exporter.exposition import ExpositionCache
from exporter.http.admin import Admin
from exporter.http.identities import KubernetesIdentities
from exporter.http.web import WebSecurity
from exporter.http.webconfig import WebConfigError
from exporter.identity import identity_labels
from exporter.kubernetes.api import ApiError, ApiServer
from exporter.metrics import ActionStats, EndpointState, SampleCollector
from exporter.request_counts import RequestCounts
from exporter.sampler import Listener, Sampler
from exporter.sources import Source
from exporter.sources.non_allocator import NonAllocatorProbe
from exporter.version import __version__
from exporter.window import SampleWindow


@dataclass(kw_only=True)
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
    # TLS, basic auth, headers and rate limit from the web config (exporter.http.web).
    web: WebSecurity | None = None

    def silent_processes(self) -> list[str]:
        """`run`: the processes that stopped reporting, in words (/healthz lists them)."""
        return silent_processes(self.sampler)


def web_security(config: Config) -> WebSecurity:
    """The endpoint's web config, read and checked now (ConfigError in one line)."""
    try:
        return WebSecurity(
            config.web_config_file,
            admin_has_credentials=lambda: (
                "kubernetes" in config.admin_auth
                or bool(config.admin_token or config.admin_token_file)
            ),
        )
    except WebConfigError as exc:
        raise ConfigError(str(exc)) from None


def kubernetes_identities(
    config: Config, env: Mapping[str, str] = os.environ
) -> KubernetesIdentities | None:
    """The API server's reviews of admin callers, where admin_auth names kubernetes."""
    if "kubernetes" not in config.admin_auth:
        return None
    try:
        api = ApiServer.in_cluster(env, credentials=Path(config.kubernetes_service_account_dir))
        return KubernetesIdentities(
            api,
            namespace=api.namespace() or env.get("POD_NAMESPACE", ""),
            authorization=config.admin_kubernetes_authorization,
            node_name=env.get("NODE_NAME", ""),
        )
    except ApiError as exc:
        raise ConfigError(f"admin_auth kubernetes: {exc}") from None


def endpoint_state(config: Config, web: WebSecurity) -> EndpointState:
    """What /metrics says of the endpoint's security (gpumem_exporter_web_*)."""
    admin = "+".join(config.admin_auth)
    return EndpointState(
        tls=web.tls,
        client_auth=web.config.client_auth,
        basic_auth=bool(web.config.users),
        admin_auth=admin,
        cleartext_admin="allowed" if config.allow_cleartext_admin else "loopback-only",
        reload_ok=web.reload_ok,
        reload_ok_at=web.reload_ok_at,
        certificate_not_after=web.not_after,
        configured=bool(web.path),
    )


def local_actions(config: Config, sources: Sequence[Source]) -> Actions:
    """This process's own allocator (embedded, and the node daemon's empty one), with the
    allocator source reading its OOMs where one runs."""
    from exporter.sources.torch_allocator import TorchAllocatorSource

    readers = [s for s in sources if isinstance(s, TorchAllocatorSource)]
    return LocalActions(
        SnapshotStore.for_config(config),
        config=config,
        oom_reader=readers[0] if readers else None,
    )


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


@dataclass(frozen=True)
class SourceKind:
    """One kind of source, declared once: the modes that read it, the setting that turns it
    off, and how it is made from the config and the sources of the mode made before it."""

    name: str
    modes: tuple[str, ...]
    enabled: Callable[[Config], bool]
    make: Callable[[Config, Mapping[str, Source], Callable[[], Hashable] | None], Source | None]


def _allocator(config: Config, made: Mapping[str, Source], users: object) -> Source:
    from exporter.sources.torch_allocator import TorchAllocatorSource

    return TorchAllocatorSource(
        layout_interval_s=config.layout_interval_s,
        layout_max_blocks=config.layout_max_blocks,
        non_allocator=NonAllocatorProbe.for_config(config),
    )


def _nvml(
    config: Config, made: Mapping[str, Source], users: Callable[[], Hashable] | None
) -> Source:
    """`users` (under `run`: the reporting processes and their GPUs) makes NVML read its
    process list at once when it changes."""
    from exporter.sources.nvml import NvmlSource

    # Inside a server, only the GPUs this process uses (read after the allocator, in the
    # same tick): every GPU of the node in every process would be O(GPUs^2) series per
    # node. The node daemon and `run` read every GPU they can see.
    allocator: Any = made.get("torch")
    uuids = (lambda: allocator.uuids_in_use) if allocator is not None else None
    return NvmlSource(only_uuids=uuids, process_interval_s=config.process_interval_s, users=users)


def _host(config: Config, made: Mapping[str, Source], users: object) -> Source:
    from exporter.sources.host import HostMemorySource

    return HostMemorySource()


def _gpu_pids(made: Mapping[str, Source]) -> Callable[[], Collection[int]] | None:
    """The host PIDs that held GPU memory at NVML's latest read, where NVML is read."""
    nvml: Any = made.get("nvml")
    return (lambda: nvml.last_pids) if nvml is not None else None


def _gpu_processes(config: Config, made: Mapping[str, Source], users: object) -> Source | None:
    """Host memory of every process with GPU memory (host PIDs: the DaemonSet's hostPID)."""
    from exporter.sources.process_memory import ProcessMemorySource

    pids = _gpu_pids(made)
    return ProcessMemorySource(pids) if pids is not None else None


def _kubelet(config: Config, made: Mapping[str, Source], users: object) -> Source | None:
    pids = _gpu_pids(made)
    return kubelet_source(config, pids) if pids is not None else None


# In reading order: a tick reads NVML after the allocator, whose GPUs it reads.
SOURCE_KINDS = (
    SourceKind("torch", ("embedded",), lambda config: config.torch, _allocator),
    SourceKind("nvml", ("embedded", "node", "run"), lambda config: config.nvml, _nvml),
    SourceKind("host", ("embedded", "node", "run"), lambda config: config.host_memory, _host),
    # What it reads (host_process_* at the node daemon) is served only at the full detail level.
    SourceKind(
        "process_memory",
        ("node",),
        lambda config: config.host_memory and config.detail == "full",
        _gpu_processes,
    ),
    SourceKind("kubelet", ("node",), lambda config: config.kubelet_socket != "off", _kubelet),
)


def sources_for(
    mode: str, config: Config, *, gpu_users: Callable[[], Hashable] | None = None
) -> list[Source]:
    """The sources of `mode` that read this machine, as the config enables them. (The demo's
    replay and `run`'s agents and process tree are its caller's, which owns what they read.)"""
    made: dict[str, Source] = {}
    for kind in SOURCE_KINDS:
        if mode in kind.modes and kind.enabled(config):
            source = kind.make(config, made, gpu_users)
            if source is not None:
                made[kind.name] = source
    return list(made.values())


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
    from exporter.kubernetes.api import ApiServer
    from exporter.kubernetes.claims import ClaimsClient
    from exporter.kubernetes.pods import PodsClient
    from exporter.sources.kubelet import DEFAULT_RESOURCES, KubeletSource

    def pods() -> PodsClient:
        return PodsClient.in_cluster(
            env,
            timeout_s=config.kubelet_timeout_s,
            credentials=Path(config.kubernetes_service_account_dir),
        )

    def claims() -> ClaimsClient:
        api = ApiServer.in_cluster(
            env,
            credentials=Path(config.kubernetes_service_account_dir),
            deadline_s=config.kubelet_timeout_s,
        )
        return ClaimsClient(api, env.get("NODE_NAME", ""))

    return KubeletSource(
        pids,
        socket_path=socket,
        refresh_s=config.kubelet_refresh_s,
        timeout_s=config.kubelet_timeout_s,
        resources=(*DEFAULT_RESOURCES, *config.kubelet_resources),
        pods=pods if config.kubelet_pod_reader else None,
        claims=claims if config.kubelet_claim_reader else None,
    )


def first_sample(sampler: Sampler) -> str | None:
    """Ready once the first sample is in."""
    return "no sample yet" if sampler.latest is None else None


def silent_processes(sampler: Sampler) -> list[str]:
    """The processes of `run` that stopped reporting (exporter.run.aggregator), in words."""
    found = []
    for source in sampler.sources:
        silent = getattr(source, "silent_processes", None)
        if silent is None:
            continue
        for labels, quiet_s in silent():
            name = labels.get("role") or "process"
            found.append(f"pid {labels.get('pid', '?')} ({name}) silent for {quiet_s:.0f} s")
    return found


def every_process_reports(sampler: Sampler) -> str | None:
    """`run`: ready once the first sample is in and while every process of the server
    reports; a stopped or hung one is named (its numbers are withdrawn meanwhile)."""
    reason = first_sample(sampler)
    if reason is not None:
        return reason
    silent = silent_processes(sampler)
    return "not every process reports: " + "; ".join(silent) if silent else None


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


@dataclass(frozen=True)
class Mode:
    """One way of running, declared once: where it runs, what serves it, how its admin
    actions act and when it is ready (docs/architecture.md)."""

    name: str  # the `mode` label of gpumem_exporter_build_info, and the catalog's modes
    runs: str  # where, in words
    endpoint: str  # what serves /metrics
    acts: str  # what its admin actions act on
    ready_when: str  # when /readyz answers 200
    ready: Callable[[Sampler], str | None]  # why /readyz answers 503, or None
    # The mode's actions, from its config and sources; None where the caller owns them (the
    # launcher of `run` passes its fan-out).
    actions: Callable[[Config, Sequence[Source]], Actions] | None
    own_process: bool = True  # the process that serves is one it reports (process_* families)


MODES = {
    mode.name: mode
    for mode in (
        Mode(
            "embedded",
            "inside a PyTorch server: exporter.start(), or attach() to its own app",
            "its own HTTP thread (start), or routes on the app and registry it has (attach)",
            "this process's allocator",
            "the first sample is in",
            first_sample,
            local_actions,
        ),
        Mode(
            "node",
            "the node daemon, `gpumem-exporter serve`: NVML, host memory, Kubernetes",
            "its own HTTP server",
            "its own process, which holds no allocator: actions answer 409",
            "NVML answers for a GPU (it exists to read NVML)",
            blind_reason,
            local_actions,
        ),
        Mode(
            "demo",
            "`gpumem-exporter demo`: a trace recorded on a real GPU, replayed",
            "its own HTTP server",
            "the recording: the snapshot of the replayed moment; nothing changes",
            "the first sample is in",
            first_sample,
            replay_actions,
            own_process=False,  # the recorded process is served as host_process_*
        ),
        Mode(
            "run",
            "`gpumem-exporter run -- CMD`: a launcher for every process of a server, an "
            "agent in each",
            "the launcher's HTTP server, one /metrics for every process",
            "each process of the server (or the one chosen), through its agent",
            "the first sample is in and every process reports (none silent for "
            "max(3 intervals, 5 s))",
            every_process_reports,
            None,
        ),
    )
}


def markdown_table() -> str:
    """The modes, for docs/architecture.md (written by exporter.reference)."""
    rows = [
        "| mode | runs | serves /metrics | admin actions act on | ready when |",
        "| --- | --- | --- | --- | --- |",
    ]
    for m in MODES.values():
        rows.append(f"| `{m.name}` | {m.runs} | {m.endpoint} | {m.acts} | {m.ready_when} |")
    return "\n".join(rows)


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
    declared = MODES.get(mode)
    if declared is None:
        raise ValueError(f"unknown mode {mode!r}")
    if actions is None:
        if declared.actions is None:
            raise ValueError(f"the {mode} mode's caller passes its actions")
        actions = declared.actions(config, sources)
    owns_registry = registry is None
    own_collectors: list[Collector] = []
    if registry is None:
        registry = CollectorRegistry()
        own_collectors = [ProcessCollector(registry=registry), PlatformCollector(registry=registry)]
    detectors = Detectors(config, listeners=list(on_alert))
    features = actions.sample_listeners(detectors)
    window = SampleWindow(config.interval_s)
    sampler = Sampler(
        sources,
        interval_s=config.interval_s,
        listeners=[detectors, *features, window, *listeners],
    )
    web = web_security(config)
    requests = RequestCounts()
    admin = Admin(
        config,
        actions,
        sampler,
        detectors,
        mode,
        identities=kubernetes_identities(config),
        requests=requests,
    )

    def action_stats() -> ActionStats:
        return ActionStats(processes=actions.counts(), endpoint=endpoint_state(config, web))

    torch_module = sys.modules.get("torch")  # never import torch just to learn its version
    collector = SampleCollector(
        sampler.state,
        const_labels=identity_labels(os.environ, config.labels),
        version=__version__,
        mode=mode,
        torch_version=str(getattr(torch_module, "__version__", "")),
        own_process=declared.own_process,
        alerts=detectors,
        actions=action_stats,
        admin_requests=requests,
        detail=config.detail,
    )
    registry.register(collector)
    return Runtime(
        config=config,
        mode=mode,
        sampler=sampler,
        registry=registry,
        collector=collector,
        detectors=detectors,
        actions=actions,
        admin=admin,
        window=window,
        not_ready=lambda: declared.ready(sampler),
        web=web,
        exposition=(
            ExpositionCache([*own_collectors, collector], collector.fingerprint)
            if owns_registry
            else None
        ),
    )
