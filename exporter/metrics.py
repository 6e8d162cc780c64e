"""Turns the latest sample into Prometheus metric families: the one place names are made.

A custom collector renders whatever the sampler published last, so a GPU or process that is
gone from the sample is gone from the scrape (no stale gauges), and counters are the
allocator's own monotonic values rather than re-counted here.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from exporter import catalog
from exporter.alerts import allocator_settings
from exporter.attribution import Attribution, attribute
from exporter.catalog import PROCESS_LABELS, Family
from exporter.exposition import RenderFailures
from exporter.ledger import ledger
from exporter.process_labels import ProcessLabels
from exporter.request_counts import RequestCounts
from exporter.sample import (
    AllocatorReading,
    ExporterState,
    ProcessCounts,
    Sample,
)
from exporter.traits import Traits

_GPU_MEMORY = catalog.group("gpu_memory")
_MIG_MEMORY = catalog.group("gpu_mig_memory")
_MACHINE_HOST = catalog.group("machine_host")
_OWN_PROCESS_HOST = catalog.group("own_process_host")
_PINNED_HOST = catalog.group("pinned_host")
_HOST_PROCESS = catalog.group("host_process")


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


class SettingsChanged(Protocol):
    changes: int
    last: dict[str, tuple[str, str]]  # setting -> (from, to), its last change


class Labels(dict[str, object]):
    """The labels of one subject (a reading, a GPU), given to many families: the tuple of
    values for a family's label names is made once per set of names, not once per family
    (most of a render's work before, at ~30 families per allocator reading)."""

    __slots__ = ("_values",)

    def __init__(self, *args: Mapping[str, object], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._values: dict[tuple[tuple[str, ...], tuple[str, ...]], tuple[str, ...]] = {}

    def values_for(self, names: tuple[str, ...], const_values: tuple[str, ...]) -> tuple[str, ...]:
        key = (names, const_values)
        found = self._values.get(key)
        if found is None:
            found = self._values[key] = (*const_values, *(str(self.get(n, "")) for n in names))
        return found


class FamilyRows:
    """One family being filled, as plain rows: label values are given by name, so a label
    that is constant on this process (an embedded exporter with RANK set has `rank`
    everywhere) is left out in one place.

    Plain rows rather than prometheus_client's families: the exposition is written from them
    through templates (exporter.exposition_templates), and a Metric is made only for the
    registry's own collect() (attach(), the multiprocess bridge)."""

    __slots__ = ("const_values", "entry", "labels", "names", "rows")

    def __init__(
        self,
        entry: Family,
        labels: tuple[str, ...],
        names: tuple[str, ...],
        const_values: tuple[str, ...],
    ):
        self.entry, self.labels, self.names, self.const_values = entry, labels, names, const_values
        # (label values, value): a number, or the info labels of an info family.
        self.rows: list[tuple[tuple[str, ...], float | Mapping[str, str]]] = []

    def _values(self, labels: Mapping[str, object]) -> tuple[str, ...]:
        if type(labels) is Labels:
            return labels.values_for(self.names, self.const_values)
        return (*self.const_values, *(str(labels.get(n, "")) for n in self.names))

    def add(self, labels: Mapping[str, object], value: float) -> None:
        self.rows.append((self._values(labels), value))

    def add_info(self, labels: Mapping[str, object], info: Mapping[str, str]) -> None:
        self.rows.append((self._values(labels), info))

    def shape(self) -> Hashable:
        """Everything the text depends on but the values: equal shapes, equal text between
        the values."""
        if self.entry.kind == "info":
            rows = tuple((values, tuple(info.items())) for values, info in self.rows)  # type: ignore[union-attr]
            return (self.entry.name, self.labels, rows)
        return (self.entry.name, self.labels, tuple([values for values, _ in self.rows]))

    def values(self) -> list[float]:
        """One per row, in the order of to_metric()'s samples (an info series' value is 1)."""
        if self.entry.kind == "info":
            return [1.0] * len(self.rows)
        return [value for _, value in self.rows]  # type: ignore[misc]

    def to_metric(self) -> Metric:
        entry = self.entry
        metric: Metric
        if entry.kind == "gauge":
            metric = GaugeMetricFamily(entry.name, entry.help, labels=self.labels)
        elif entry.kind == "counter":
            metric = CounterMetricFamily(entry.name, entry.help, labels=self.labels)
        else:
            metric = InfoMetricFamily(entry.name, entry.help, labels=self.labels)
        for values, value in self.rows:
            metric.add_metric(values, value)  # type: ignore[arg-type]
        return metric


def with_deprecated_names(served: list[FamilyRows]) -> list[FamilyRows]:
    """Each family followed by its deprecated names (exporter.contract), with its samples:
    a dashboard of the old name keeps working for a minor release beside the new one."""
    if not catalog.DEPRECATED:  # every render, while no name is deprecated: nothing to add
        return served
    found = []
    for family in served:
        found.append(family)
        for old in catalog.DEPRECATED.get(family.entry.name, ()):
            alias = FamilyRows(old, family.labels, family.names, family.const_values)
            alias.rows = family.rows
            found.append(alias)
    return found


class _LeftOut(FamilyRows):
    """A family this mode or detail level does not serve: what is added to it is dropped."""

    __slots__ = ()

    def add(self, labels: Mapping[str, object], value: float) -> None:
        pass

    def add_info(self, labels: Mapping[str, object], info: Mapping[str, str]) -> None:
        pass


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


# Allocator families in the order /metrics has always listed them (the catalog's order).
_ALLOCATOR = tuple(f for f in catalog.FAMILIES if f.source == "torch" and f.group != "pinned_host")
_ALLOCATOR_GROUPS = tuple(dict.fromkeys(f.group for f in _ALLOCATOR))
_ALLOCATOR_INFO = _ALLOCATOR.index(catalog.family("torch_cuda_allocator"))
# (group, key) of each, in that order: where a render files each new family. In a tuple, not
# a map by Family: a Family's hash is its 13 fields' (dataclass).
_ALLOCATOR_PLACES = tuple((f.group, f.key) for f in _ALLOCATOR)
# Families filled from a reading's attribute of the same name, where it is not None.
_ATTRIBUTE_GROUPS = ("ratio", "non_allocator")


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
        self._requests = admin_requests
        self._render_failures = render_failures
        # Families this mode does not serve, or not at this detail level (catalog.Family).
        mode = traits.name
        has = traits.has
        self._left_out = frozenset(
            f.name
            for f in catalog.FAMILIES
            if not f.served(has) or (f.full_only_in(has) and detail != "full")
        )
        self._state = state
        # A replay serves no `process_` family: those belong to the process that serves them.
        self._host = _MACHINE_HOST + (_OWN_PROCESS_HOST if traits.own_process else ())
        self._alerts = alerts
        self._const_names = tuple(const_labels)
        self._const_values = tuple(const_labels.values())
        self._version = version
        self._mode = mode
        self._one_process = traits.one_process
        # pid -> whether its series keep it: decided once per process (exporter.process_labels).
        self._pids_decided: dict[str, tuple[tuple[str, str], bool]] = {}
        self._torch_version = torch_version
        # (family, per process) -> (label names, those not constant, the one _LeftOut of a
        # family not served here or None): the same every tick.
        self._plans: dict[
            tuple[str, bool], tuple[tuple[str, ...], tuple[str, ...], _LeftOut | None]
        ] = {}
        # The same for every allocator family at once, by per process (_allocator_rows).
        self._allocator_plans: dict[
            bool, list[tuple[Family, tuple[str, ...], tuple[str, ...], _LeftOut | None]]
        ] = {}

    def _fill(self, entry: Family, per_process: bool = False) -> FamilyRows:
        """A new family of the catalog, with its labels (and the process labels where one
        endpoint serves several processes), less those constant on this process."""
        found = self._plans.get((entry.name, per_process))
        if found is None:
            found = self._plan(entry, per_process)
        labels, names, left_out = found
        if left_out is not None:  # not served at this detail level: nothing to fill
            return left_out
        return FamilyRows(entry, labels, names, self._const_values)

    def _plan(
        self, entry: Family, per_process: bool
    ) -> tuple[tuple[str, ...], tuple[str, ...], _LeftOut | None]:
        names = entry.labels + (PROCESS_LABELS if per_process and entry.per_process else ())
        names = tuple(n for n in names if n not in self._const_names)
        labels = self._const_names + names
        # One for every render: what is added to it is dropped, so it stays empty.
        left_out = (
            _LeftOut(entry, labels, names, self._const_values)
            if entry.name in self._left_out
            else None
        )
        self._plans[(entry.name, per_process)] = (labels, names, left_out)
        return labels, names, left_out

    def fingerprint(self) -> tuple[object, ...]:
        """Everything collect() reads that can change: equal fingerprints, equal output
        (exporter.exposition caches the rendered bytes on it). A tick publishes a new state
        object, so the state is compared by identity first, which is cheap."""
        alerts = self._alerts.evaluations if self._alerts is not None else None
        actions = self._actions() if self._actions is not None else None
        requests = self._requests.changes if self._requests is not None else None
        failed = self._render_failures.count if self._render_failures is not None else None
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
        served = self._served(self._exporter_families(state, stats, processes))
        if sample is None:
            return with_deprecated_names(served)
        served += self._served(self._allocator_families(sample, processes))
        served += self._served(self._gpu_families(sample))
        served += self._served(self._kubernetes_families(sample))
        served += self._served(self._host_families(sample, processes))
        return with_deprecated_names(served)

    def _served(self, families: Iterable[tuple[FamilyRows, bool]]) -> list[FamilyRows]:
        """Those of the families served at this detail level (_fill decided): with samples,
        or always."""
        return [
            family
            for family, always in families
            if not isinstance(family, _LeftOut) and (always or family.rows)
        ]

    # Each part yields (family, always): a family is served when it has samples, or always.

    def _exporter_families(
        self, state: ExporterState, stats: ActionStats | None, processes: ProcessLabels
    ) -> Iterator[tuple[FamilyRows, bool]]:
        info = self._fill(catalog.family("gpumem_exporter_build"))
        info.add_info({}, {"version": self._version, "mode": self._mode})
        yield info, True
        up = self._fill(catalog.family("gpumem_exporter_source_up"))
        duration = self._fill(catalog.family("gpumem_exporter_source_duration_seconds"))
        errors = self._fill(catalog.family("gpumem_exporter_source_errors"))
        unavailable = self._fill(catalog.family("gpumem_exporter_source_unavailable"))
        for name, status in sorted(state.sources.items()):
            source = {"source": name}
            up.add(source, 1.0 if status.up else 0.0)
            duration.add(source, status.duration_s)
            errors.add(source, status.errors)
            if status.unavailable:
                unavailable.add_info(source, {"reason": status.unavailable})
        yield from ((up, True), (duration, True), (errors, True), (unavailable, False))
        if self._alerts is not None:
            # Only what fires: a state that is not firing says nothing a fleet needs stored,
            # and one series per alert and subject would outnumber the data.
            firing = self._fill(catalog.family("gpumem_exporter_alert_firing"))
            for alert, labels in self._alerts.firing_subjects():
                firing.add(processes.labels({**labels, "alert": alert}), 1.0)
            yield firing, False
            changes = self._fill(catalog.family("gpumem_exporter_allocator_settings_changes"))
            change = self._fill(catalog.family("gpumem_exporter_allocator_settings_change"))
            for labels, seen in self._alerts.settings_changes():
                changes.add(processes.labels(labels), seen.changes)
                for setting, (was, now) in sorted(seen.last.items()):
                    ids = processes.labels({**labels, "setting": setting})
                    change.add_info(ids, {"from": was, "to": now})
            yield changes, False
            yield change, False
        if processes.processes:  # served where the catalog declares it (run)
            info = self._fill(catalog.family("gpumem_exporter_process"))
            for pid, process in sorted(processes.processes.items()):
                info.add_info(process, {"pid": pid})
            yield info, False
        sample = state.sample
        if sample is not None and sample.rejected_messages:
            rejected = self._fill(catalog.family("gpumem_exporter_agent_messages_rejected"))
            for reason, count in sorted(sample.rejected_messages.items()):
                rejected.add({"reason": reason}, count)
            yield rejected, True
        if sample is not None and sample.over_budget:
            over = self._fill(catalog.family("gpumem_exporter_readings_over_budget"))
            for name, count in sorted(sample.over_budget.items()):
                over.add({"budget": name}, count)
            yield over, False
        if stats is not None:
            yield from self._action_families(stats, processes)
        if sample is not None:
            last = self._fill(catalog.family("gpumem_exporter_last_sample_timestamp_seconds"))
            last.add({}, sample.timestamp)
            yield last, True

    def _action_families(
        self, stats: ActionStats, processes: ProcessLabels
    ) -> Iterator[tuple[FamilyRows, bool]]:
        # Per process under `gpumem-exporter run` (each process's own monotonic counts).
        per_process = any(p.process for p in stats.processes)
        snapshots = self._fill(catalog.family("gpumem_exporter_snapshots"), per_process)
        released = self._fill(catalog.family("torch_cuda_empty_cache_released_bytes"), per_process)
        remediations = self._fill(catalog.family("gpumem_exporter_remediations"), per_process)
        for entry in stats.processes:
            ids, counts = processes.labels(entry.process), entry.counts
            for trigger, count in sorted(counts.snapshots.items()):
                snapshots.add({**ids, "trigger": trigger}, count)
            released.add(ids, counts.empty_cache_released_bytes)
            for key, count in sorted(counts.remediations.items()):
                action, _, outcome = key.partition("/")
                remediations.add({**ids, "action": action, "outcome": outcome}, count)
        dropped = self._fill(catalog.family("gpumem_exporter_probe_records_dropped"), per_process)
        for entry in stats.processes:
            if entry.counts.records_dropped:  # only where it happened: the traces' text stays
                dropped.add(processes.labels(entry.process), entry.counts.records_dropped)
        problems = self._fill(catalog.family("gpumem_exporter_component_problems"), per_process)
        for entry in stats.processes:
            for problem, count in sorted(entry.counts.component_problems.items()):
                problems.add({**processes.labels(entry.process), "problem": problem}, count)
        restarts = self._fill(catalog.family("gpumem_exporter_helper_restarts"), per_process)
        for entry in stats.processes:
            if entry.counts.helper_restarts:
                restarts.add(processes.labels(entry.process), entry.counts.helper_restarts)
        reports = self._fill(
            catalog.family("gpumem_exporter_agent_last_report_timestamp_seconds"), per_process
        )
        for entry in stats.processes:
            if entry.last_report is not None:
                reports.add(processes.labels(entry.process), entry.last_report)
        yield from ((snapshots, True), (released, True), (remediations, True))
        if any(entry.counts.records_dropped for entry in stats.processes):
            yield dropped, True  # not even its HELP before: the traces' text stays as it was
        if any(entry.counts.helper_restarts for entry in stats.processes):
            yield restarts, True
        if any(entry.counts.component_problems for entry in stats.processes):
            yield problems, True
        yield reports, False
        if self._requests is not None:
            admin = self._fill(catalog.family("gpumem_exporter_admin_requests"))
            for (action, outcome), count in sorted(self._requests.read().items()):
                admin.add({"action": action, "outcome": outcome}, count)
            yield admin, True
        if self._render_failures is not None and self._render_failures.count:
            failures = self._fill(catalog.family("gpumem_exporter_render_failures"))
            failures.add({}, self._render_failures.count)
            yield failures, True
        if stats.endpoint is not None:
            yield from self._endpoint_families(stats.endpoint)

    def _endpoint_families(self, endpoint: EndpointState) -> Iterator[tuple[FamilyRows, bool]]:
        web = self._fill(catalog.family("gpumem_exporter_web"))
        web.add_info(
            {},
            {
                "tls": "on" if endpoint.tls else "off",
                "client_auth": endpoint.client_auth,
                "basic_auth": "on" if endpoint.basic_auth else "off",
                "admin_auth": endpoint.admin_auth,
                "admin_cleartext": "n/a" if endpoint.tls else endpoint.cleartext_admin,
            },
        )
        yield web, True
        if not endpoint.configured:
            return
        ok = self._fill(catalog.family("gpumem_exporter_web_config_last_reload_successful"))
        ok.add({}, 1.0 if endpoint.reload_ok else 0.0)
        at = self._fill(
            catalog.family("gpumem_exporter_web_config_last_reload_success_timestamp_seconds")
        )
        at.add({}, endpoint.reload_ok_at)
        yield from ((ok, True), (at, True))
        if endpoint.certificate_not_after is not None:
            expiry = self._fill(
                catalog.family("gpumem_exporter_tls_certificate_expiry_timestamp_seconds")
            )
            expiry.add({}, endpoint.certificate_not_after)
            yield expiry, True

    def _allocator_families(
        self, sample: Sample, processes: ProcessLabels
    ) -> list[tuple[FamilyRows, bool]]:
        if not sample.allocators:
            return []
        # One endpoint for several processes (gpumem-exporter run): label each by process.
        per_process = any(reading.process for reading in sample.allocators)
        families = self._allocator_rows(per_process)
        by_key: dict[str, dict[str, FamilyRows]] = {group: {} for group in _ALLOCATOR_GROUPS}
        for (group, key), filling in zip(_ALLOCATOR_PLACES, families, strict=True):
            by_key[group][key] = filling
        info = families[_ALLOCATOR_INFO]
        for reading in sample.allocators:
            ids = Labels(
                processes.labels(reading.process),
                device=reading.device,
                gpu_uuid=reading.gpu_uuid,
            )
            self._add_allocator_reading(by_key, info, reading, ids)
        # A list, not a generator: the allocator's ~40 families each passed up through
        # nested generators were a fifth of this group's render.
        found = [(filling, False) for filling in families]
        found += self._pinned_host_families(sample, processes)
        return found

    def _allocator_rows(self, per_process: bool) -> list[FamilyRows]:
        """A new family for each of _ALLOCATOR, in its order (the shared _LeftOut of one not
        served here), from plans looked up once per endpoint shape rather than once per
        family and render (_fill)."""
        plans = self._allocator_plans.get(per_process)
        if plans is None:
            plans = self._allocator_plans[per_process] = [
                (entry, *self._plan(entry, per_process)) for entry in _ALLOCATOR
            ]
        const = self._const_values
        return [
            FamilyRows(entry, labels, names, const) if left_out is None else left_out
            for entry, labels, names, left_out in plans
        ]

    def _add_allocator_reading(
        self,
        by_key: dict[str, dict[str, FamilyRows]],
        info: FamilyRows,
        reading: AllocatorReading,
        ids: dict[str, object],
    ) -> None:
        for key, value in reading.gauges.items():
            by_key["allocator_gauge"][key].add(ids, value)
        for key, value in reading.counters.items():
            by_key["allocator_counter"][key].add(ids, value)
        for pool, pool_gauges in sorted(reading.pools.items()):
            pool_ids = Labels(ids, pool=pool)
            for key, value in pool_gauges.items():
                by_key["pool"][key].add(pool_ids, value)
        for group in _ATTRIBUTE_GROUPS:
            for key, filling in by_key[group].items():
                if (value := getattr(reading, key)) is not None:
                    filling.add(ids, value)
        for key, value in reading.layout.items():
            by_key["layout"][key].add(ids, value)
        if reading.layout_age_s is not None:
            by_key["layout_state"]["layout_age_s"].add(ids, reading.layout_age_s)
        if reading.layout_skipped:
            skipped = by_key["layout_state"]["layout_skipped"]
            skipped.add_info(ids, {"reason": reading.layout_skipped})
        self._add_oom(by_key["oom"], reading, ids)
        for name, nbytes in reading.components.items():
            by_key["component"]["components"].add({**ids, "component": name}, nbytes)
        for part, nbytes in ledger(reading):
            by_key["ledger"]["ledger"].add({**ids, "component": part}, nbytes)
        for pool_id, pool_gauges in sorted(reading.private_pools.items()):
            pool_ids = Labels(ids, pool_id=pool_id)
            for key, value in pool_gauges.items():
                by_key["private_pool"][key].add(pool_ids, value)
        for pool_id, described in sorted(reading.private_pool_info.items()):
            by_key["private_pool_info"]["private_pool_info"].add_info(
                Labels(ids, pool_id=pool_id), described
            )
        info.add_info(
            ids,
            {
                **allocator_settings(reading),  # as the settings-change alert compares them
                "settings_source": reading.settings.get("source", "environment"),
                "torch_version": self._torch_version,
            },
        )

    @staticmethod
    def _add_oom(
        families: Mapping[str, FamilyRows], reading: AllocatorReading, ids: Mapping[str, object]
    ) -> None:
        for verdict, count in sorted(reading.ooms_by_verdict.items()):
            families["ooms_by_verdict"].add({**ids, "verdict": verdict}, count)
        last = reading.last_oom
        if last is None:
            return
        families["last_timestamp"].add({**ids, "verdict": last.verdict}, last.timestamp)
        for name, value in last.deciding_bytes().items():
            families["last_bytes"].add({**ids, "reading": name}, value)

    def _pinned_host_families(
        self, sample: Sample, processes: ProcessLabels
    ) -> list[tuple[FamilyRows, bool]]:
        if not sample.pinned_host:
            return []
        per_process = any(reading.process for reading in sample.pinned_host)
        found = []
        for entry in _PINNED_HOST:
            family = self._fill(entry, per_process)
            for reading in sample.pinned_host:
                family.add(processes.labels(reading.process), getattr(reading, entry.key))
            found.append((family, True))
        return found

    def _gpu_families(self, sample: Sample) -> Iterator[tuple[FamilyRows, bool]]:
        if not sample.gpus:
            return
        memory = {entry.key: self._fill(entry) for entry in _GPU_MEMORY}
        up = self._fill(catalog.family("gpu_up"))
        info = self._fill(catalog.family("gpu"))
        refused = self._fill(catalog.family("gpu_memory_unavailable"))
        mig_mode = self._fill(catalog.family("gpu_mig_mode"))
        for gpu in sample.gpus:
            ids = Labels(gpu=gpu.index, gpu_uuid=gpu.uuid)
            up.add(ids, 1.0 if gpu.up else 0.0)
            if gpu.memory_unavailable:
                refused.add_info(ids, {"reason": gpu.memory_unavailable})
            if "enabled" in (gpu.mig_mode, gpu.mig_mode_pending):
                mig_mode.add_info(ids, {"current": gpu.mig_mode, "pending": gpu.mig_mode_pending})
            info.add_info(
                ids,
                {
                    "name": gpu.name,
                    "driver_version": gpu.driver_version,
                    "pci_bus_id": gpu.pci_bus_id,
                },
            )
            for key, family in memory.items():
                value = getattr(gpu, key)
                if value is not None:
                    family.add(ids, value)
        process = self._fill(catalog.family("gpu_process_memory_used_bytes"))
        in_instance = self._fill(catalog.family("gpu_process_mig_instance"))
        for entry in sample.processes:
            labels = {"gpu": entry.gpu_index, "gpu_uuid": entry.gpu_uuid, "pid": entry.pid}
            process.add(labels, entry.used_bytes)
            if entry.gpu_instance_id is not None:
                in_instance.add_info({**labels, "gpu_instance": entry.gpu_instance_id}, {})
        yield from ((family, False) for family in (*memory.values(), process, up, info))
        yield from ((refused, False), (mig_mode, False), (in_instance, False))
        if sample.mig_instances:
            yield from ((family, False) for family in self._mig_families(sample))

    def _mig_families(self, sample: Sample) -> Iterator[FamilyRows]:
        memory = {entry.key: self._fill(entry) for entry in _MIG_MEMORY}
        non_process = self._fill(catalog.family("gpu_mig_non_process_memory_bytes"))
        devices = self._fill(catalog.family("gpu_mig_device"))
        for instance in sample.mig_instances:
            ids = Labels(
                gpu=instance.gpu_index,
                gpu_uuid=instance.gpu_uuid,
                gpu_instance=instance.gpu_instance_id,
            )
            labels = Labels(ids, profile=instance.profile)
            for key, family in memory.items():
                value = getattr(instance, key)
                if value is not None:
                    family.add(labels, value)
            if instance.used_bytes is not None and instance.process_bytes is not None:
                non_process.add(labels, max(instance.used_bytes - instance.process_bytes, 0))
            for uuid in instance.mig_uuids:
                devices.add_info(Labels(ids, mig_uuid=uuid), {"profile": instance.profile})
        yield from (*memory.values(), non_process, devices)

    def _kubernetes_families(self, sample: Sample) -> Iterator[tuple[FamilyRows, bool]]:
        """The node daemon's attribution (exporter.attribution): info series joined to the
        device and process series by gpu_uuid or pid, which keep their identity when a GPU
        changes hands."""
        kubelet = sample.kubelet
        if kubelet is None:
            return
        up = self._fill(catalog.family("gpumem_exporter_kubelet_up"))
        up.add({}, 1.0 if kubelet.up else 0.0)
        yield up, True
        errors = self._fill(catalog.family("gpumem_exporter_kubelet_refresh_errors"))
        errors.add({}, kubelet.refresh_errors)
        yield errors, True
        if kubelet.last_success_s is not None:
            last = self._fill(
                catalog.family("gpumem_exporter_kubelet_last_success_timestamp_seconds")
            )
            last.add({}, kubelet.last_success_s)
            yield last, True
        if kubelet.error:
            error = self._fill(catalog.family("gpumem_exporter_kubelet_error"))
            error.add_info({}, {"error": kubelet.error, "socket": kubelet.socket})
            yield error, True
        if kubelet.logs_folder and kubelet.logs_error:  # as the kubelet's own error: no
            # series while all is well (the node's series budget, docs/performance.md)
            info = self._fill(catalog.family("gpumem_exporter_kubelet_container_logs_error"))
            info.add_info({}, {"error": kubelet.logs_error, "folder": kubelet.logs_folder})
            yield info, True
        if kubelet.pods_api:
            yield from self._reader_state("pods", kubelet.pods is not None, kubelet.pods_error)
        if kubelet.claims_api:
            yield from self._reader_state(
                "claims", kubelet.claims is not None, kubelet.claims_error
            )
        attribution = attribute(sample)
        if attribution is not None:
            yield from self._attribution_families(attribution)

    def _reader_state(
        self, reader: str, answered: bool, error: str
    ) -> Iterator[tuple[FamilyRows, bool]]:
        """gpumem_exporter_<reader>_api_up, and _error_info where it failed: the pod reader's
        and the claim reader's state."""
        up = self._fill(catalog.family(f"gpumem_exporter_{reader}_api_up"))
        up.add({}, 1.0 if answered else 0.0)
        yield up, True
        if error:
            info = self._fill(catalog.family(f"gpumem_exporter_{reader}_api_error"))
            info.add_info({}, {"error": error})
            yield info, True

    def _attribution_families(self, attribution: Attribution) -> Iterator[tuple[FamilyRows, bool]]:
        """Which pod holds each GPU and process, and the memory no pod owns."""
        gpu_pods = self._fill(catalog.family("gpu_pod_info"))
        for row in attribution.gpu_pods:
            gpu_pods.add(vars(row), 1.0)
        instances = self._fill(catalog.family("gpu_pod_mig_instance"))
        for placed in attribution.gpu_pod_instances:
            instances.add_info(vars(placed), {})
        claims = self._fill(catalog.family("gpu_dra_claim_info"))
        for claim in attribution.dra_claims:
            claims.add(vars(claim), 1.0)
        claimed = self._fill(catalog.family("gpu_dra_claim_memory_claimed_bytes"))
        claim_used = self._fill(catalog.family("gpu_dra_claim_memory_used_bytes"))
        for share in attribution.claim_memory:
            labels = {
                "gpu": share.gpu_index,
                "gpu_uuid": share.gpu_uuid,
                "claim_namespace": share.claim_namespace,
                "claim": share.claim,
                "share_id": share.share_id,
            }
            claimed.add(labels, share.claimed_bytes)
            if share.used_bytes is not None:
                claim_used.add(labels, share.used_bytes)
        containers = self._fill(catalog.family("gpu_process_container_info"))
        named = self._fill(catalog.family("gpu_process_pod_info"))
        for process in attribution.process_pods:
            containers.add(vars(process), 1.0)
            if process.pod:
                named.add(vars(process), 1.0)
        by_container = self._fill(catalog.family("gpu_container_memory_used_bytes"))
        for (index, uuid, namespace, pod, container), used in sorted(
            attribution.container_memory.items()
        ):
            labels = {"gpu": index, "gpu_uuid": uuid, "namespace": namespace, "pod": pod}
            by_container.add({**labels, "container": container}, used)
        unattributed = self._fill(catalog.family("gpu_memory_unattributed_bytes"))
        for uuid, (index, value) in sorted(attribution.unattributed_gpus.items()):
            unattributed.add({"gpu": index, "gpu_uuid": uuid}, value)
        per_instance = self._fill(catalog.family("gpu_mig_memory_unattributed_bytes"))
        for (uuid, instance), (index, value) in sorted(attribution.unattributed_instances.items()):
            per_instance.add({"gpu": index, "gpu_uuid": uuid, "gpu_instance": instance}, value)
        per_process = self._fill(catalog.family("gpu_process_memory_unattributed_bytes"))
        for entry in attribution.unattributed_processes:
            labels = {
                "gpu": entry.gpu_index,
                "gpu_uuid": entry.gpu_uuid,
                "pid": entry.pid,
                "reason": entry.reason,
            }
            per_process.add(labels, entry.used_bytes)
        families = (
            gpu_pods,
            instances,
            claims,
            claimed,
            claim_used,
            containers,
            named,
            by_container,
            unattributed,
            per_instance,
            per_process,
        )
        yield from ((family, False) for family in families)

    def _host_families(
        self, sample: Sample, processes: ProcessLabels
    ) -> Iterator[tuple[FamilyRows, bool]]:
        for entry in _HOST_PROCESS if sample.host_processes else ():
            family = self._fill(entry)
            for process in sample.host_processes:
                value = getattr(process, entry.key)
                if value is not None:
                    family.add(processes.labels(vars(process)), value)
            yield family, False
        host = sample.host
        if host is None:
            return
        for entry in self._host:
            value = getattr(host, entry.key)
            if value is not None:
                family = self._fill(entry)
                family.add({}, value)
                yield family, True


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
