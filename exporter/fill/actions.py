"""What the admin API did, per process (snapshots, empty_cache, remediations, the probe's
own counts), the admin requests and failed renders, and the endpoint's security."""

from __future__ import annotations

from collections.abc import Iterator

from exporter import catalog
from exporter.fill.render import ActionStats, EndpointState, Render
from exporter.fill.rows import FamilyRows, Plans


def families(render: Render, stats: ActionStats) -> Iterator[tuple[FamilyRows, bool]]:
    new, processes = render.plans.new, render.processes
    # Per process under `gpumem-exporter run` (each process's own monotonic counts).
    per_process = any(p.process for p in stats.processes)
    snapshots = new(catalog.family("gpumem_exporter_snapshots"), per_process)
    released = new(catalog.family("torch_cuda_empty_cache_released_bytes"), per_process)
    remediations = new(catalog.family("gpumem_exporter_remediations"), per_process)
    dropped = new(catalog.family("gpumem_exporter_probe_records_dropped"), per_process)
    problems = new(catalog.family("gpumem_exporter_component_problems"), per_process)
    restarts = new(catalog.family("gpumem_exporter_helper_restarts"), per_process)
    reports = new(
        catalog.family("gpumem_exporter_agent_last_report_timestamp_seconds"), per_process
    )
    for entry in stats.processes:
        ids, counts = processes.labels(entry.process), entry.counts
        for trigger, count in sorted(counts.snapshots.items()):
            snapshots.add({**ids, "trigger": trigger}, count)
        released.add(ids, counts.empty_cache_released_bytes)
        for key, count in sorted(counts.remediations.items()):
            action, _, outcome = key.partition("/")
            remediations.add({**ids, "action": action, "outcome": outcome}, count)
        # Only where they happened, and served only then: not even their HELP before (the
        # traces' text stays as it was).
        if counts.records_dropped:
            dropped.add(ids, counts.records_dropped)
        for problem, count in sorted(counts.component_problems.items()):
            problems.add({**ids, "problem": problem}, count)
        if counts.helper_restarts:
            restarts.add(ids, counts.helper_restarts)
        if entry.last_report is not None:
            reports.add(ids, entry.last_report)
    yield from ((snapshots, True), (released, True), (remediations, True))
    yield from ((dropped, False), (restarts, False), (problems, False))
    yield reports, False
    yield from _requests(render)
    if stats.endpoint is not None:
        yield from _endpoint(render.plans, stats.endpoint)


def _requests(render: Render) -> Iterator[tuple[FamilyRows, bool]]:
    new, requests, failed = (
        render.plans.new,
        render.about.admin_requests,
        render.about.render_failures,
    )
    if requests is not None:
        admin = new(catalog.family("gpumem_exporter_admin_requests"))
        for (action, outcome), count in sorted(requests.read().items()):
            admin.add({"action": action, "outcome": outcome}, count)
        yield admin, True
    if failed is not None and failed.count:
        failures = new(catalog.family("gpumem_exporter_render_failures"))
        failures.add({}, failed.count)
        yield failures, True


def _endpoint(plans: Plans, endpoint: EndpointState) -> Iterator[tuple[FamilyRows, bool]]:
    new = plans.new
    web = new(catalog.family("gpumem_exporter_web"))
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
    ok = new(catalog.family("gpumem_exporter_web_config_last_reload_successful"))
    ok.add({}, 1.0 if endpoint.reload_ok else 0.0)
    at = new(catalog.family("gpumem_exporter_web_config_last_reload_success_timestamp_seconds"))
    at.add({}, endpoint.reload_ok_at)
    yield from ((ok, True), (at, True))
    if endpoint.certificate_not_after is not None:
        expiry = new(catalog.family("gpumem_exporter_tls_certificate_expiry_timestamp_seconds"))
        expiry.add({}, endpoint.certificate_not_after)
        yield expiry, True
