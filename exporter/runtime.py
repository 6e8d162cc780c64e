"""Wiring shared by every way of running: sources -> sampler -> collector -> registry, and the
actions implementation of the mode (exporter.actions), picked once here."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, PlatformCollector
from prometheus_client.registry import Collector

from exporter.actions.base import Actions
from exporter.config import Config
from exporter.detectors import Detectors
from exporter.detectors import Listener as AlertListener
from exporter.exposition import ExpositionCache, RenderFailures
from exporter.fill.render import ActionStats, EndpointState
from exporter.http.admin import Admin
from exporter.http.server import HttpServer, create_app, create_health_app
from exporter.identity import identity_labels
from exporter.kubernetes.identities import kubernetes_identities
from exporter.metrics import SampleCollector
from exporter.modes import MODES, Mode
from exporter.modes.run import silent_processes
from exporter.oom_pending import PendingOoms
from exporter.own_process_metrics import OwnProcessMetrics
from exporter.request_counts import RequestCounts
from exporter.sampler import Listener, Sampler
from exporter.sources import Source, kinds
from exporter.traits import Traits
from exporter.version import __version__
from exporter.webconfig.security import WebSecurity, web_security
from exporter.window import SampleWindow


@dataclass(kw_only=True)
class Runtime:
    config: Config
    declared: Mode  # the mode's declaration (exporter.modes): its traits decide, not its name
    sampler: Sampler
    registry: CollectorRegistry
    collector: SampleCollector
    detectors: Detectors
    actions: Actions
    admin: Admin
    window: SampleWindow  # recent samples, for the live page (exporter.http.page)
    pending_ooms: PendingOoms  # OOMs counted, their verdicts not in yet (page, /stats)
    # Why /readyz answers 503, or None when ready; picked once for the mode (readiness).
    not_ready: Callable[[], str | None]
    # /metrics bytes rendered once per tick; None where the registry is not ours (attach():
    # the host's other metrics change between our ticks and must not be served stale).
    exposition: ExpositionCache | None = None
    # TLS, basic auth, headers and rate limit from the web config (exporter.webconfig.security).
    web: WebSecurity | None = None

    def silent_processes(self) -> list[str]:
        """`run`: the processes that stopped reporting, in words (/healthz lists them)."""
        return silent_processes(self.sampler)

    @property
    def mode(self) -> str:
        return self.declared.name

    @property
    def traits(self) -> Traits:
        return self.declared.traits

    def server(self) -> HttpServer:
        """Its own HTTP server (/metrics, health, admin, the live page) on the configured host
        and port, not started: the entry point runs it in the foreground (serve, demo) or in
        the background (start(), run's launcher). ServerStartError in one line where the
        address is taken or invalid."""
        return HttpServer(create_app(self), self.config.host, self.config.port)

    def health_server(self) -> HttpServer | None:
        """The plain-HTTP server of /healthz and /readyz on health_port (None where 0), not
        started; ServerStartError in one line where the address is taken or invalid."""
        if not self.config.health_port:
            return None
        return HttpServer(create_health_app(self), self.config.host, self.config.health_port)


def admin_auth_label(config: Config, traits: Traits) -> str:
    """How admin callers can be identified, as gpumem_exporter_web_info says it: the methods
    of admin_auth that have what they need ("token" only with a token or a token file; it
    said "token" with none, when every admin request was refused), else "open" (the demo,
    whose actions change nothing) or "none" (admin actions off)."""
    if ready := config.admin_methods_ready():
        return "+".join(ready)
    return "open" if traits.admin_open else "none"


def endpoint_state(config: Config, web: WebSecurity, traits: Traits) -> EndpointState:
    """What /metrics says of the endpoint's security (gpumem_exporter_web_*)."""
    admin = admin_auth_label(config, traits)
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


def endpoint_states(
    config: Config, web: WebSecurity, traits: Traits
) -> Callable[[], EndpointState]:
    """endpoint_state(), built again only when the web config changes (a reload, or one that
    failed): every scrape's fingerprint and render ask for it."""
    built: dict[int, EndpointState] = {}  # web.changes -> what it was then

    def current() -> EndpointState:
        seen = web.changes  # read first: a reload while it is built is seen by the next call
        found = built.get(seen)
        if found is None:
            built.clear()
            found = built[seen] = endpoint_state(config, web, traits)
        return found

    return current


class MetricNameClash(ValueError):
    """The registry given (the host's, attach()) already has metrics of these names."""

    def __init__(self, names: list[str]) -> None:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        super().__init__(
            f"the registry already has metrics named {shown}, which this exporter serves: "
            "two collectors of one name would break every scrape (pass attach() a "
            "registry of its own, or stop the other exporter)"
        )
        self.names = names


def sources_for(
    mode: str, config: Config, *, gpu_users: Callable[[], Hashable] | None = None
) -> list[Source]:
    """The sources that `mode` reads from this machine (its Mode's `reads`), as the config
    enables them (exporter.sources.kinds). The demo's replay and `run`'s agents and process
    tree are its caller's, which owns what they read."""
    return kinds.sources_for(MODES[mode].reads, config, gpu_users=gpu_users)


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
    traits = declared.traits
    if actions is None:
        if declared.actions is None:
            raise ValueError(f"the {mode} mode's caller passes its actions")
        actions = declared.actions(config, sources)
    owns_registry = registry is None
    own_collectors: list[Collector] = []
    if registry is None:
        registry = CollectorRegistry()
        own_process = OwnProcessMetrics()  # client_python's ProcessCollector's families
        registry.register(own_process)
        own_collectors = [own_process, PlatformCollector(registry=registry)]
    detectors = Detectors(config, listeners=list(on_alert))
    features = actions.sample_listeners(detectors)
    window = SampleWindow(config.interval_s)
    pending_ooms = PendingOoms()
    sampler = Sampler(
        sources,
        interval_s=config.interval_s,
        # Pending OOMs first: a sample with a verdict must not be served beside the "verdict
        # pending" of the same OOM while slower listeners run (the demo's publishing of its
        # OOM snapshot took 1-6 s: `why` and the page said both).
        listeners=[pending_ooms, detectors, *features, window, *listeners],
    )
    web = web_security(config)
    requests = RequestCounts()
    admin = Admin(
        config,
        actions,
        sampler,
        detectors,
        traits,
        identities=kubernetes_identities(config),
        requests=requests,
        pending_ooms=pending_ooms,
    )

    endpoint = endpoint_states(config, web, traits)

    def action_stats() -> ActionStats:
        return ActionStats(processes=actions.counts(), endpoint=endpoint())

    render_failures = RenderFailures()
    torch_module = sys.modules.get("torch")  # never import torch just to learn its version
    collector = SampleCollector(
        sampler.state,
        const_labels=identity_labels(os.environ, config.labels),
        version=__version__,
        traits=traits,
        torch_version=str(getattr(torch_module, "__version__", "")),
        alerts=detectors,
        actions=action_stats,
        admin_requests=requests,
        render_failures=render_failures,
        detail=config.detail,
    )
    try:
        registry.register(collector)
    except ValueError as exc:  # a name taken: only in a registry the caller passed (attach())
        # client_python 0.26+ says which (DuplicateTimeseries.duplicates); before, its message.
        names = getattr(exc, "duplicates", None) or re.findall(r"'([^']+)'", str(exc))
        raise MetricNameClash(sorted(names)) from None
    return Runtime(
        config=config,
        declared=declared,
        sampler=sampler,
        registry=registry,
        collector=collector,
        detectors=detectors,
        actions=actions,
        admin=admin,
        window=window,
        pending_ooms=pending_ooms,
        not_ready=lambda: declared.ready(sampler),
        web=web,
        exposition=(
            ExpositionCache([*own_collectors, collector], collector.fingerprint, render_failures)
            if owns_registry
            else None
        ),
    )
