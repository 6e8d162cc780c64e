"""/metrics served from bytes rendered once per tick, and scrapes over kept-alive connections.

prometheus_client stays the format's authority: the cached bytes must equal its own rendering
of the same registry, in every format a scraper can ask for, and pass `promtool check metrics`.
"""

from __future__ import annotations

import gzip
import http.client
import statistics
import subprocess
import time
from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from exporter.config import load_config
from exporter.http.server import HttpServer, add_routes, create_app
from exporter.runtime import Runtime, build_runtime
from exporter.sources.replay import ReplaySource
from tests.conftest import require_tool

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


@pytest.fixture
def demo() -> Iterator[Runtime]:
    """The demo's runtime (a real recorded trace), ticked by hand."""
    runtime = build_runtime(load_config(env={}), mode="demo", sources=[ReplaySource()])
    runtime.sampler.tick()
    yield runtime
    runtime.sampler.stop()


def without_process_metrics(text: str) -> str:
    """Without client_python's process lines: they read /proc at render time."""
    return "".join(
        line
        for line in text.splitlines(keepends=True)
        if not line.startswith(("process_", "# HELP process_", "# TYPE process_"))
    )


def test_cached_bytes_equal_prometheus_clients_rendering_in_every_format(demo: Runtime) -> None:
    client = TestClient(create_app(demo))
    plain = client.get("/metrics")
    assert plain.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    # client_python's process lines read /proc when rendered: equal but for their values.
    assert without_process_metrics(plain.text) == without_process_metrics(
        generate_latest(demo.registry).decode()
    )
    assert "process_resident_memory_bytes" in plain.text
    om = client.get("/metrics", headers={"Accept": OPENMETRICS})
    assert om.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert without_process_metrics(om.text) == without_process_metrics(
        openmetrics_latest(demo.registry).decode()
    )
    # gzip as Prometheus asks for it: the same bytes once decompressed.
    raw = client.get("/metrics", headers={"Accept-Encoding": "gzip"})
    assert raw.headers["content-encoding"] == "gzip"
    assert raw.text == plain.text  # httpx decompressed it
    assert demo.exposition is not None and demo.exposition.renders == 2  # text and OpenMetrics


def test_one_render_per_tick_whoever_scrapes(demo: Runtime) -> None:
    client = TestClient(create_app(demo))
    exposition = demo.exposition
    assert exposition is not None
    first = client.get("/metrics").text
    for _ in range(5):  # two Prometheus replicas and a dashboard: still one render
        assert client.get("/metrics").text == first
        client.get("/metrics", headers={"Accept-Encoding": "gzip"})
    assert exposition.renders == 1
    demo.sampler.tick()
    second = client.get("/metrics").text
    assert exposition.renders == 2
    assert second != first  # a new sample (its timestamp at least) is served at once


def test_action_counts_between_ticks_are_not_served_stale(demo: Runtime) -> None:
    client = TestClient(create_app(demo))
    client.get("/metrics")
    client.post("/empty-cache")  # no token configured: refused, and counted
    text = client.get("/metrics").text
    assert 'gpumem_exporter_admin_requests_total{action="empty_cache",outcome=' in text
    assert demo.exposition is not None and demo.exposition.renders == 2


def test_alerts_evaluated_after_the_state_was_published_are_not_served_stale() -> None:
    runtime = build_runtime(load_config(env={}), mode="demo", sources=[ReplaySource()])
    exposition = runtime.exposition
    assert exposition is not None
    # A scrape lands between the publication of a new state and the detectors' evaluation
    # of it (the sampler publishes first, then calls its listeners).
    runtime.sampler.listeners.remove(runtime.detectors)
    sample = runtime.sampler.tick()
    exposition.body("", "")
    runtime.detectors(sample)
    exposition.body("", "")
    assert exposition.renders == 2


def test_cached_bytes_pass_promtool(demo: Runtime) -> None:
    promtool = require_tool("promtool")
    exposition = demo.exposition
    assert exposition is not None
    text = gzip.decompress(exposition.body("", "gzip").data).decode()  # promtool reads text only
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout + proc.stderr == "", proc.stdout + proc.stderr


def test_attach_renders_the_hosts_registry_live() -> None:
    """attach() serves a registry that is not ours: the host's metrics change between our
    ticks and must show at once, so nothing is cached there."""
    registry = CollectorRegistry()
    requests = Gauge("host_app_requests", "the host's own metric", registry=registry)
    runtime = build_runtime(load_config(env={}), mode="embedded", sources=[], registry=registry)
    assert runtime.exposition is None
    app = FastAPI()
    add_routes(app, runtime)
    client = TestClient(app)
    runtime.sampler.tick()
    assert "host_app_requests 0.0" in client.get("/metrics").text
    requests.set(7)
    assert "host_app_requests 7.0" in client.get("/metrics").text


def scrape_times(port: int, *, reuse: bool, count: int = 12) -> list[float]:
    """Wall time of each GET /metrics, on one kept-alive connection (as Prometheus scrapes)
    or on a new connection each time."""
    times = []
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for _ in range(count):
        if not reuse:
            connection.close()
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        started = time.perf_counter()
        connection.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
        response = connection.getresponse()
        response.read()
        times.append(time.perf_counter() - started)
        assert response.status == 200 and not response.will_close
    connection.close()
    return times[2:]  # the first requests of each kind warm up the server


def test_a_scrape_over_a_kept_alive_connection_is_not_slower_than_over_a_new_one(
    demo: Runtime,
) -> None:
    """Prometheus keeps its connection open. Without TCP_NODELAY on accepted connections
    every response after the first waited ~40 ms for the client's delayed ACK (Nagle)."""
    server = HttpServer(create_app(demo), "127.0.0.1", 0)
    server.start()
    try:
        fresh = statistics.median(scrape_times(server.port, reuse=False))
        reused = statistics.median(scrape_times(server.port, reuse=True))
    finally:
        server.stop()
    # Generous against a loaded CI machine, far below the 40 ms of a delayed ACK.
    assert reused <= max(2 * fresh, 0.010), (reused, fresh)


def test_the_demo_serves_the_recorded_process_as_host_process_never_as_its_own(demo: Runtime):
    """`process_` names belong to the process that serves them (client_python's process
    collector): the demo's are its own; the recorded server's RSS is a host_process series
    with the recorded pid, its peak never below its current value."""
    import os

    import psutil
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(demo.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (own,) = families["process_resident_memory_bytes"].samples
    assert abs(own.value - psutil.Process(os.getpid()).memory_info().rss) < 512 << 20
    assert "process_resident_memory_peak_bytes" not in families
    recorded = {
        s.labels["pid"]: s.value for s in families["host_process_resident_memory_bytes"].samples
    }
    peak = {
        s.labels["pid"]: s.value
        for s in families["host_process_resident_memory_peak_bytes"].samples
    }
    assert str(os.getpid()) not in recorded and recorded
    assert all(peak[pid] >= recorded[pid] for pid in recorded)


def test_every_help_text_is_written_for_people(demo: Runtime):
    """No HELP is generated from a field name ("Host memory (total_bytes)."), and no two
    families share one."""
    import re

    from prometheus_client.parser import text_string_to_metric_families

    ours = [
        f
        for f in text_string_to_metric_families(generate_latest(demo.registry).decode())
        if not f.name.startswith(("process_", "python_"))
    ]
    generated = [
        # "X (field_name).": a field name where a sentence should be (a series named there is fine)
        f.name
        for f in ours
        if re.search(r"\((?!torch_|gpu_|host_)[a-z]+_[a-z_]+\)\.$", f.documentation)
    ]
    assert generated == []
    docs = [f.documentation for f in ours]
    assert len(set(docs)) == len(docs), sorted(d for d in docs if docs.count(d) > 1)
