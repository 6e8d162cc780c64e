"""What one render reads: the tick's published state, the exporter's own counts and facts,
and the plans of this endpoint's families (exporter.fill.rows.Plans)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from exporter.catalog import Family
from exporter.exposition import RenderFailures
from exporter.fill.rows import Plans
from exporter.process_labels import ProcessLabels
from exporter.request_counts import RequestCounts
from exporter.sample import ExporterState, ProcessCounts


class SettingsChanged(Protocol):
    changes: int
    last: dict[str, tuple[str, str]]  # setting -> (from, to), its last change


class AlertStates(Protocol):
    """The in-process detectors, as the collector reads them (exporter.detectors)."""

    # Changes whenever firing_subjects() may answer differently (cheaper than comparing).
    @property
    def evaluations(self) -> int: ...

    def firing_subjects(self) -> Iterable[tuple[str, dict[str, str]]]:
        """(alert, labels) of each alert firing now."""
        ...

    def settings_changes(self) -> Iterable[tuple[dict[str, str], SettingsChanged]]:
        """(allocator subject, what changed) for each allocator whose settings changed."""
        ...


@dataclass(frozen=True)
class EndpointState:
    """The endpoint's security as /metrics shows it (exporter.webconfig.security)."""

    tls: bool = False
    client_auth: str = "NoClientCert"
    basic_auth: bool = False
    admin_auth: str = "token"
    cleartext_admin: str = "loopback-only"
    configured: bool = False  # a web config file is in use
    reload_ok: bool = True
    reload_ok_at: float = 0.0
    certificate_not_after: float | None = None


@dataclass
class ActionStats:
    """Counts of allocator actions per process for /metrics, and the endpoint's security."""

    processes: list[ProcessCounts] = field(default_factory=list)
    endpoint: EndpointState | None = None


@dataclass(frozen=True)
class About:
    """The collector's own facts and counters, the same object for every render."""

    version: str
    mode: str
    torch_version: str
    # The host-memory families this mode serves: a replay serves no `process_` family, those
    # belong to the process that serves them.
    host: tuple[Family, ...]
    alerts: AlertStates | None
    admin_requests: RequestCounts | None
    render_failures: RenderFailures | None


@dataclass(frozen=True)
class Render:
    """One render's inputs: every subject module fills its families from these alone."""

    plans: Plans
    about: About
    state: ExporterState
    stats: ActionStats | None
    processes: ProcessLabels  # every process the render names (exporter.process_labels)
