"""Turns the latest sample into Prometheus metric families: the one place names are made.

A custom collector renders whatever the sampler published last, so a GPU or process that is
gone from the sample is gone from the scrape (no stale gauges), and counters are the
allocator's own monotonic values rather than re-counted here. Each subject's families are
filled in its own module (exporter.fill); this collector decides what this endpoint serves
and calls them in /metrics' order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from exporter import catalog
from exporter.exposition import RenderFailures
from exporter.fill import allocator, devices, health, host, kubernetes
from exporter.fill.render import About, ActionStats, AlertStates, Render
from exporter.fill.rows import FamilyRows, Plans, served, with_deprecated_names
from exporter.process_labels import ProcessLabels
from exporter.request_counts import RequestCounts
from exporter.sample import ExporterState, Sample
from exporter.traits import Traits

# The subjects filled from a sample, in /metrics' order (exporter.fill.health comes first,
# with or without one).
_SUBJECTS = (allocator, devices, kubernetes, host)


class SampleCollector(Collector):
    def __init__(
        self,
        state: Callable[[], ExporterState],
        *,
        const_labels: Mapping[str, str],
        version: str,
        traits: Traits,
        torch_version: str = "",
        alerts: AlertStates | None = None,
        actions: Callable[[], ActionStats] | None = None,
        admin_requests: RequestCounts | None = None,
        render_failures: RenderFailures | None = None,
        detail: str = "basic",
    ) -> None:
        self._actions = actions
        # Families this mode does not serve, or not at this detail level (catalog.Family).
        has = traits.has
        self._left_out = frozenset(
            f.name
            for f in catalog.FAMILIES
            if not f.served(has) or (f.full_only_in(has) and detail != "full")
        )
        self._state = state
        self._plans = Plans(self._left_out, const_labels)
        self._about = About(
            version=version,
            mode=traits.name,
            torch_version=torch_version,
            host=host.MACHINE + (host.OWN_PROCESS if traits.own_process else ()),
            alerts=alerts,
            admin_requests=admin_requests,
            render_failures=render_failures,
        )
        self._one_process = traits.one_process
        # pid -> whether its series keep it: decided once per process (exporter.process_labels).
        self._pids_decided: dict[str, tuple[tuple[str, str], bool]] = {}

    def fingerprint(self) -> tuple[object, ...]:
        """Everything collect() reads that can change: equal fingerprints, equal output
        (exporter.exposition caches the rendered bytes on it). A tick publishes a new state
        object, so the state is compared by identity first, which is cheap."""
        about = self._about
        alerts = about.alerts.evaluations if about.alerts is not None else None
        actions = self._actions() if self._actions is not None else None
        requests = about.admin_requests.changes if about.admin_requests is not None else None
        failed = about.render_failures.count if about.render_failures is not None else None
        return (self._state(), alerts, actions, requests, failed)

    def collect(self) -> Iterator[Metric]:
        for family in self.families():
            yield family.to_metric()

    def describe(self) -> Iterator[Metric]:
        """Every family this collector may serve (its mode, its detail level), without
        samples: what client_python's registry checks a new collector's names against, so
        that a clash with the host's metrics (attach()) is refused when registering, not
        found later as a broken scrape."""
        for entry in catalog.FAMILIES:
            if entry.name not in self._left_out:
                yield FamilyRows(entry, (), (), ()).to_metric()

    def families(self) -> list[FamilyRows]:
        """The families /metrics serves, in order, as rows (what collect() yields, before it
        is made into prometheus_client's families)."""
        state = self._state()
        stats = self._actions() if self._actions is not None else None
        sample = state.sample
        processes = _processes(
            sample, stats, every_pid=self._one_process, decided=self._pids_decided
        )
        render = Render(self._plans, self._about, state, stats, processes)
        found = served(health.families(render))
        if sample is not None:
            for subject in _SUBJECTS:
                found += served(subject.families(render, sample))
        return with_deprecated_names(found)


def _processes(
    sample: Sample | None,
    stats: ActionStats | None,
    *,
    every_pid: bool,
    decided: dict[str, tuple[tuple[str, str], bool]],
) -> ProcessLabels:
    """Every process the rendering names: the allocators', pinned memory's, host memory's and
    the actions' counts (exporter.process_labels)."""
    found: list[Mapping[str, object]] = []
    if sample is not None:
        found += [r.process for r in sample.allocators]
        found += [r.process for r in sample.pinned_host]
        found += [vars(p) for p in sample.host_processes]
    if stats is not None:
        found += [p.process for p in stats.processes]
    return ProcessLabels(found, every_pid=every_pid, decided=decided)
