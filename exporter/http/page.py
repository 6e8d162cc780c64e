"""The live page at `/`: recent memory per GPU, firing alerts, processes and snapshots, for an
on-call engineer without Grafana.

Routes (open, like /metrics: they show what /metrics already exposes, and nothing else):
`/` (the page), `/static/...` (its script, styles and the vendored uPlot), `/api/window`
(the window of recent samples as JSON, which the page polls with `?since=`) and `/runbooks`.
Snapshots and actions stay behind the admin API; the page calls it with the token the user
gives it. Nothing loads from another origin, and the Content-Security-Policy allows scripts
from this origin only (no inline script).

Added by create_app, not by add_routes: exporter.attach() mounts our routes on the host's
own app, whose `/` is not ours to take.
"""

from __future__ import annotations

import os
import time
from functools import lru_cache
from importlib import resources
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse, JSONResponse, Response

from exporter.alerts import BY_NAME
from exporter.http.runbooks import runbook_url, runbooks_html
from exporter.http.served import Served
from exporter.identity import identity_labels
from exporter.ledger import ledger
from exporter.oom_verdict import retry_pressure
from exporter.sample import Sample
from exporter.version import __version__

# Styles may be inline because a snapshot view that the page opens with the admin token (a
# blob: document) inherits this policy, and the viewer's page is styled inline.
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": PAGE_CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# The files under exporter/static/ that are served, and as what: nothing else is.
STATIC_FILES = {
    # The page's ES modules (page.js imports the others).
    **{
        f"{name}.js": "text/javascript; charset=utf-8"
        for name in ("page", "errors", "format", "state", "gpus", "status", "admin", "oom")
    },
    "page.css": "text/css; charset=utf-8",
    "uplot/uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uplot/uPlot.min.css": "text/css; charset=utf-8",
    "uplot/LICENSE": "text/plain; charset=utf-8",
}
# Rows of the process table: a node daemon may see every process of a busy node.
MAX_PROCESS_ROWS = 256
# OOM verdicts in the page's banner (the newest first): one per process and device.
MAX_OOM_ROWS = 16


@lru_cache(maxsize=len(STATIC_FILES) + 1)
def static_file(name: str) -> bytes:
    return (resources.files("exporter") / "static" / name).read_bytes()


def add_page_routes(app: FastAPI, runtime: Served) -> None:
    tags: list[Any] = ["page"]

    @app.get("/", include_in_schema=False)
    def page() -> Response:
        return HTMLResponse(static_file("index.html"), headers=PAGE_HEADERS)

    @app.get("/runbooks", include_in_schema=False)
    def runbooks() -> Response:
        return HTMLResponse(runbooks_html(), headers=PAGE_HEADERS)

    @app.get("/static/{name:path}", include_in_schema=False)
    def static(name: str) -> Response:
        media_type = STATIC_FILES.get(name)
        if media_type is None:
            return JSONResponse({"detail": f"no static file {name!r}"}, status_code=404)
        return Response(static_file(name), media_type=media_type, headers=PAGE_HEADERS)

    @app.get("/api/window", tags=tags)
    def window(
        since: float | None = Query(
            None,
            ge=0,
            allow_inf_nan=False,
            description="Only samples newer than this Unix time (the last timestamp the "
            "caller has); all of the window without it.",
        ),
    ) -> JSONResponse:
        """The live page's data: recent samples per GPU as columns (`timestamps`, and per GPU
        one list per field, null where unknown), with the latest sample's processes and host
        memory and the firing in-process alerts. Bounded: see docs/metrics.md."""
        body = window_payload(runtime, since)
        return JSONResponse(body, headers={"Cache-Control": "no-store"})


def window_payload(runtime: Served, since: float | None) -> dict[str, Any]:
    window, sampler, config = runtime.window, runtime.sampler, runtime.config
    state = sampler.state()
    sample = state.sample
    age = sampler.sample_age_s()
    return {
        "mode": runtime.mode,
        "version": __version__,
        "replay": runtime.traits.recorded,
        "labels": identity_labels(os.environ, config.labels),
        "interval_s": window.interval_s,
        "capacity": window.capacity,
        "now": round(time.time(), 3),
        "sample_age_s": None if age is None else round(age, 3),
        "stale_after_s": config.stale_threshold_s,
        "sources_up": {name: status.up for name, status in state.sources.items()},
        # Why a source gives nothing (no NVML, no allocator yet): the page says it where it
        # would otherwise show only "No GPU reading yet".
        "sources_why": {
            name: status.unavailable or status.last_error
            for name, status in state.sources.items()
            if status.unavailable or (status.last_error and not status.up)
        },
        **window.to_dict(since),
        "host": _host(sample),
        "processes": process_rows(sample) if sample else [],
        "ledgers": ledger_rows(sample) if sample else {},
        "ooms": (
            oom_rows(
                sample,
                runbook_url(config, "out-of-memory-verdicts"),
                runtime.pending_ooms.rows(),
            )
            if sample
            else []
        ),
        "alerts": [
            {
                "alert": firing.alert,
                "labels": firing.labels,
                "severity": firing.severity,
                "since": firing.since,
                "value": firing.value,
                "value_label": BY_NAME[firing.alert].measures.format(
                    window=_in_words(config.detect_counter_window_s)
                ),
                "value_unit": BY_NAME[firing.alert].unit,
                "runbook_url": runbook_url(config, firing.alert),
                "note": alert_note(sample, firing.alert, firing.labels),
            }
            for firing in runtime.detectors.firing_now()
        ],
    }


def _host(sample: Sample | None) -> dict[str, int] | None:
    if sample is None or sample.host is None:
        return None
    host = sample.host
    return {
        "total_bytes": host.total_bytes,
        "available_bytes": host.available_bytes,
        "swap_total_bytes": host.swap_total_bytes,
        "swap_used_bytes": host.swap_used_bytes,
    }


def alert_note(sample: Sample | None, alert: str, labels: dict[str, str]) -> str:
    """What a firing alert's process shows now, in words: for allocation retries, whether
    fragmentation or the cap is building (exporter.oom_verdict.retry_pressure)."""
    if alert != "GpuMemAllocRetries" or sample is None:
        return ""
    for reading in sample.allocators:
        ids = {"device": str(reading.device), "gpu_uuid": reading.gpu_uuid, **reading.process}
        if all(ids.get(name, "") == value for name, value in labels.items()):
            return retry_pressure(
                reading.layout.get("free_in_used_segments_bytes"),
                reading.layout.get("largest_free_block_bytes"),
                reading.gauges.get("reserved_bytes"),
                reading.gauges.get("memory_limit_bytes"),
                reading.last_oom,
            )
    return ""


def _in_words(seconds: float) -> str:
    """10 min, 90 s, 2 h: a window as the page says it."""
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


def oom_rows(
    sample: Sample, runbook: str, pending: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The latest OOM of each process and device that had one, newest first: its verdict with
    the deciding numbers and the action (exporter/oom_verdict.py), for the page's banner; an
    OOM whose verdict is not in yet (exporter.oom_pending) comes first, as pending."""
    latest: list[tuple[float, dict[str, Any]]] = [
        (row["since"], {**row, "pending": True, "runbook_url": runbook}) for row in pending or []
    ]
    for reading in sample.allocators:
        last = reading.last_oom
        if last is None:
            continue
        pid = sample.allocator_pid(reading)
        latest.append(
            (
                last.timestamp,
                {
                    "pid": pid,
                    "rank": reading.process.get("rank", ""),
                    "role": reading.process.get("role", ""),
                    "device": reading.device,
                    "gpu_uuid": reading.gpu_uuid,
                    "ooms": reading.counters.get("ooms"),
                    "ooms_by_verdict": dict(reading.ooms_by_verdict),
                    "verdict": last.to_dict(),
                    "runbook_url": runbook,
                },
            )
        )
    latest.sort(key=lambda entry: -entry[0])
    return [row for _, row in latest[:MAX_OOM_ROWS]]


def ledger_rows(sample: Sample) -> dict[str, list[list[Any]]]:
    """Per GPU (the window's key: its UUID, or cuda:N) the latest sample's ledger, its
    processes' parts summed by name in ledger order: [[part, bytes], ...]."""
    found: dict[str, dict[str, int]] = {}
    for reading in sample.allocators:
        parts = found.setdefault(reading.gpu_uuid or f"cuda:{reading.device}", {})
        for part, nbytes in ledger(reading):
            parts[part] = parts.get(part, 0) + nbytes
    return {key: [[part, nbytes] for part, nbytes in parts.items()] for key, parts in found.items()}


def process_rows(sample: Sample) -> list[dict[str, Any]]:
    """One row per process: its GPU memory (NVML, and its allocators where it has them) and
    its host memory. Under `run` the allocators carry the process labels; elsewhere the one
    allocator process is the sample's own (`self_pid`, the recorded one in a replay)."""
    rows: dict[int, dict[str, Any]] = {}

    def row(pid: int) -> dict[str, Any]:
        if pid not in rows:
            rows[pid] = {
                "pid": pid,
                "role": "",
                "rank": "",
                "gpus": [],
                "gpu_used_bytes": None,
                "allocated_bytes": None,
                "reserved_bytes": None,
                "host_resident_bytes": None,
                "host_resident_peak_bytes": None,
                "host_swap_bytes": None,
            }
        return rows[pid]

    def add(entry: dict[str, Any], name: str, value: int | None) -> None:
        if value is not None:
            entry[name] = (entry[name] or 0) + value

    def on_gpu(entry: dict[str, Any], key: str) -> None:
        if key not in entry["gpus"]:
            entry["gpus"].append(key)

    for reading in sample.allocators:
        pid = sample.allocator_pid(reading)
        if pid is None:
            continue
        entry = row(pid)
        entry["role"] = reading.process.get("role", "") or entry["role"]
        entry["rank"] = reading.process.get("rank", "") or entry["rank"]
        on_gpu(entry, reading.gpu_uuid or f"cuda:{reading.device}")
        add(entry, "allocated_bytes", reading.gauges.get("allocated_bytes"))
        add(entry, "reserved_bytes", reading.gauges.get("reserved_bytes"))
    for process in sample.processes:
        entry = row(process.pid)
        on_gpu(entry, process.gpu_uuid)
        add(entry, "gpu_used_bytes", process.used_bytes)
    for host_process in sample.host_processes:
        entry = row(host_process.pid)
        entry["role"] = host_process.role or entry["role"]
        entry["rank"] = host_process.rank or entry["rank"]
        entry["host_resident_bytes"] = host_process.resident_bytes
        entry["host_resident_peak_bytes"] = host_process.resident_peak_bytes
        entry["host_swap_bytes"] = host_process.swap_bytes
    own = rows.get(sample.self_pid) if sample.self_pid is not None else None
    if own is not None and own["host_resident_bytes"] is None and sample.host is not None:
        # Outside `run` the exporter's own process is the allocator's: its resident memory.
        own["host_resident_bytes"] = sample.host.process_resident_bytes
        own["host_resident_peak_bytes"] = sample.host.process_resident_peak_bytes
    ordered = sorted(
        rows.values(),
        key=lambda r: (-(r["gpu_used_bytes"] or r["reserved_bytes"] or 0), r["pid"]),
    )
    return ordered[:MAX_PROCESS_ROWS]
