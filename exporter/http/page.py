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
from exporter.http.served import Served
from exporter.identity import identity_labels
from exporter.page_data import (
    alert_note,
    host_row,
    in_words,
    ledger_rows,
    oom_rows,
    process_rows,
)
from exporter.runbooks import runbook_url, runbooks_html
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
        **window.to_dict(since, upto=sample),
        "host": host_row(sample),
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
                    window=in_words(config.detect_counter_window_s)
                ),
                "value_unit": BY_NAME[firing.alert].unit,
                "runbook_url": runbook_url(config, firing.alert),
                "note": alert_note(sample, firing.alert, firing.labels),
            }
            for firing in runtime.detectors.firing_now()
        ],
    }
