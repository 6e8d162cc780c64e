"""The exporter's own state: its build, each source's health, the alerts firing, the
processes it serves, the messages it refused, its budgets, then what the admin API did
(exporter.fill.actions) and when it last sampled."""

from __future__ import annotations

from collections.abc import Iterator

from exporter import catalog
from exporter.fill import actions
from exporter.fill.render import Render
from exporter.fill.rows import FamilyRows, Filled


def families(render: Render) -> Filled:
    return list(_families(render))


def _families(render: Render) -> Iterator[tuple[FamilyRows, bool]]:
    new, about, state = render.plans.new, render.about, render.state
    info = new(catalog.family("gpumem_exporter_build"))
    info.add_info({}, {"version": about.version, "mode": about.mode})
    yield info, True
    up = new(catalog.family("gpumem_exporter_source_up"))
    duration = new(catalog.family("gpumem_exporter_source_duration_seconds"))
    errors = new(catalog.family("gpumem_exporter_source_errors"))
    unavailable = new(catalog.family("gpumem_exporter_source_unavailable"))
    for name, status in sorted(state.sources.items()):
        source = {"source": name}
        up.add(source, 1.0 if status.up else 0.0)
        duration.add(source, status.duration_s)
        errors.add(source, status.errors)
        if status.unavailable:
            unavailable.add_info(source, {"reason": status.unavailable})
    yield from ((up, True), (duration, True), (errors, True), (unavailable, False))
    yield from _alerts(render)
    processes = render.processes
    if processes.processes:  # served where the catalog declares it (run)
        served = new(catalog.family("gpumem_exporter_process"))
        for pid, process in sorted(processes.processes.items()):
            served.add_info(process, {"pid": pid})
        yield served, False
    sample = state.sample
    if sample is not None and sample.rejected_messages:
        rejected = new(catalog.family("gpumem_exporter_agent_messages_rejected"))
        for reason, count in sorted(sample.rejected_messages.items()):
            rejected.add({"reason": reason}, count)
        yield rejected, True
    if sample is not None and sample.over_budget:
        over = new(catalog.family("gpumem_exporter_readings_over_budget"))
        for name, count in sorted(sample.over_budget.items()):
            over.add({"budget": name}, count)
        yield over, False
    if render.stats is not None:
        yield from actions.families(render, render.stats)
    if sample is not None:
        last = new(catalog.family("gpumem_exporter_last_sample_timestamp_seconds"))
        last.add({}, sample.timestamp)
        yield last, True


def _alerts(render: Render) -> Iterator[tuple[FamilyRows, bool]]:
    alerts, new, processes = render.about.alerts, render.plans.new, render.processes
    if alerts is None:
        return
    # Only what fires: a state that is not firing says nothing a fleet needs stored, and one
    # series per alert and subject would outnumber the data.
    firing = new(catalog.family("gpumem_exporter_alert_firing"))
    for alert, labels in alerts.firing_subjects():
        firing.add(processes.labels({**labels, "alert": alert}), 1.0)
    yield firing, False
    changes = new(catalog.family("gpumem_exporter_allocator_settings_changes"))
    change = new(catalog.family("gpumem_exporter_allocator_settings_change"))
    for labels, seen in alerts.settings_changes():
        changes.add(processes.labels(labels), seen.changes)
        for setting, (was, now) in sorted(seen.last.items()):
            ids = processes.labels({**labels, "setting": setting})
            change.add_info(ids, {"from": was, "to": now})
    yield changes, False
    yield change, False
