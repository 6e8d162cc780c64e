"""What the HTTP layer reads from a running exporter, and nothing more.

The assembly of a mode (exporter.runtime.Runtime) satisfies this; `http/` never imports the
assembly, so the arrows run one way: the runtime builds the endpoint, the endpoint serves it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from exporter.actions.base import Actions
    from exporter.config import Config
    from exporter.detectors import Detectors
    from exporter.exposition import ExpositionCache
    from exporter.http.admin import Admin
    from exporter.oom_pending import PendingOoms
    from exporter.sampler import Sampler
    from exporter.traits import Traits
    from exporter.webconfig.security import WebSecurity
    from exporter.window import SampleWindow


class Served(Protocol):
    config: Config
    sampler: Sampler
    registry: CollectorRegistry
    detectors: Detectors
    actions: Actions
    admin: Admin
    window: SampleWindow  # recent samples, for the live page
    pending_ooms: PendingOoms  # OOMs counted whose verdicts are not in yet
    exposition: ExpositionCache | None  # /metrics bytes rendered once per tick, where ours
    web: WebSecurity | None  # TLS, basic auth, headers, rate limit (the web config)

    @property
    def mode(self) -> str:
        """The mode's name (the `mode` label, the live page's)."""
        ...

    @property
    def traits(self) -> Traits:
        """What its mode decides (exporter.traits)."""
        ...

    def not_ready(self) -> str | None:
        """Why /readyz answers 503, or None when ready."""
        ...

    def silent_processes(self) -> list[str]:
        """`run`: the processes that stopped reporting, in words."""
        ...
