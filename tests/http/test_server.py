"""HTTP routes, the embedded start()/attach() API, and what the host process is promised."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Gauge

import exporter
from exporter.config import ConfigError
from exporter.helper import join
from exporter.http.server import HTTP_THREAD, ServerStartError, bind_socket, create_app
from exporter.sample import HostReading, SourceReading
from exporter.sampler import Sampler


class HostSource:
    name = "host"

    def read(self) -> SourceReading:
        return SourceReading(host=HostReading(100, 50, 10, 1, 5, 6))

    def close(self) -> None:
        pass


def app_with_clock(now: list[float]) -> tuple[FastAPI, Sampler]:
    from exporter.config import load_config
    from exporter.runtime import build_runtime

    runtime = build_runtime(load_config(env={}), mode="embedded", sources=[HostSource()])
    runtime.sampler._clock = lambda: now[0]
    app = create_app(runtime)
    return app, runtime.sampler


def test_health_readiness_and_metrics():
    now = [1000.0]
    app, sampler = app_with_clock(now)
    client = TestClient(app)
    assert client.get("/readyz").status_code == 503
    assert client.get("/healthz").json()["status"] == "starting"
    sampler.tick()
    assert client.get("/readyz").status_code == 200
    assert client.get("/healthz").status_code == 200
    now[0] += 6  # no sample for longer than stale_after_s
    health = client.get("/healthz")
    assert health.status_code == 503 and health.json()["status"] == "stale"
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "host_memory_total_bytes 100.0" in metrics.text
    openmetrics = client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.rstrip().endswith("# EOF")


def test_no_page_loads_from_a_cdn():
    app, _ = app_with_clock([0.0])
    client = TestClient(app)
    assert client.get("/docs").status_code == 404
    assert client.get("/openapi.json").status_code == 200


def test_the_api_schema_is_served_without_a_warning_and_the_open_routes_answer_head():
    """GET of each open route is one operation in the schema (FastAPI warned of duplicate
    operation IDs when GET and HEAD were one route), and HEAD is answered as before."""
    app, _ = app_with_clock([0.0])
    client = TestClient(app)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schema = client.get("/openapi.json").json()
    for path in ("/metrics", "/healthz", "/readyz"):
        assert set(schema["paths"][path]) == {"get"}, schema["paths"][path]
        head = client.head(path)
        assert head.status_code in (200, 503) and head.content == b"", (path, head)
        assert client.post(path).status_code == 405


def test_bind_reports_a_taken_port_clearly():
    taken = bind_socket("127.0.0.1", 0)
    port = taken.getsockname()[1]
    with pytest.raises(ServerStartError, match=f"port {port} on 127.0.0.1 is already in use"):
        bind_socket("127.0.0.1", port)
    taken.close()


@pytest.fixture
def stopped():
    yield
    exporter.stop()


def test_start_serves_and_is_idempotent(stopped):
    handle = exporter.start(port=0, interval_s=0.05, labels={"model": "test"})
    assert handle.error is None and handle.url
    assert exporter.start() is handle
    with urllib.request.urlopen(handle.url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    assert 'gpumem_exporter_build_info{mode="helper",model="test",version=' in text
    handle.stop()
    handle.stop()  # safe twice
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(handle.url + "/metrics", timeout=2)


def test_a_cpu_only_host_is_no_data_with_its_reason_not_an_error(stopped, caplog):
    """No GPU in use (here: none at all): nothing is logged as an error, no source counts
    errors (GpuMemExporterSourceFailing would page), and the reason is visible. In-process:
    the helper's case is test_a_cpu_only_host_served_by_the_helper."""
    import sys

    from exporter.sources.torch_allocator import NO_CUDA_BUILD

    handle = exporter.start(port=0, interval_s=0.02, helper=False)
    assert handle.url is not None
    time.sleep(0.3)  # many ticks
    torch = sys.modules.get("torch")  # imported by another test, or not
    if torch is not None and not (torch.version.cuda or getattr(torch.version, "hip", None)):
        # This machine's CPU-only wheel: said so, by both (issue 54).
        assert handle.unavailable == {"nvml": NO_CUDA_BUILD, "torch": NO_CUDA_BUILD}
    else:
        assert handle.unavailable == {"nvml": "no GPU in use by this process (yet)"}
    assert handle.error is None
    state = handle.sampler.state()
    assert all(status.errors == 0 and status.up for status in state.sources.values())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    with urllib.request.urlopen(handle.url + "/healthz", timeout=5) as response:
        health = json.loads(response.read())
    assert health["status"] == "ok"
    assert health["unavailable_sources"] == handle.unavailable


def test_a_cpu_only_host_served_by_the_helper(stopped, caplog):
    """The same through the helper: ready, every source up, the reason on the handle (asked
    of the helper), nothing logged here above INFO."""
    handle = exporter.start(port=0, interval_s=0.05)
    assert handle.url is not None
    deadline = time.monotonic() + 10
    while True:
        try:
            with urllib.request.urlopen(handle.url + "/healthz", timeout=5) as response:
                health = json.loads(response.read())
        except urllib.error.HTTPError as answer:  # 503 while it starts
            health = json.loads(answer.read())
        if health["status"] == "ok" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert health["status"] == "ok", health
    assert "nvml" in health["unavailable_sources"]
    assert handle.unavailable == health["unavailable_sources"]
    assert handle.error is None
    with urllib.request.urlopen(handle.url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    assert 'gpumem_exporter_source_errors_total{source="nvml"} 0.0' in text, text
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, loud


def test_a_taken_port_is_logged_not_raised(stopped, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        handle = exporter.start(port=port, interval_s=0.05)
        assert handle.url is None
        said_in_use = f"port {port} on 127.0.0.1 is already in use (held by uid {os.getuid()}"
        assert str(handle.error).startswith(said_in_use), handle.error
        [said] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert said.startswith(f"gpumem-exporter: {handle.error}; /metrics is not served")
        # Nothing left behind while it waits for the port: no helper, no folder.
        assert not join.folder_for(handle.config).exists()


def test_a_taken_port_in_process_keeps_the_sampler(stopped, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        handle = exporter.start(port=port, interval_s=0.05, helper=False)
    assert handle.url is None
    assert handle.error == f"port {port} on 127.0.0.1 is already in use"
    assert "already in use" in caplog.text
    assert handle.sampler._thread is not None  # the sampler still runs


def _sigpipe_blocked(native_id: int) -> bool:
    """Whether SIGPIPE is blocked in this process's thread `native_id` (its SigBlk mask)."""
    import signal
    from pathlib import Path

    status = Path(f"/proc/self/task/{native_id}/status").read_text()
    mask = int(next(line for line in status.splitlines() if line.startswith("SigBlk:"))[7:], 16)
    return bool(mask & (1 << (signal.SIGPIPE - 1)))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc")
def test_the_in_process_server_thread_cannot_be_killed_by_a_client_gone_mid_answer(stopped):
    """A host that put SIGPIPE back to its default would die when the exporter's HTTP thread
    writes to a client that hung up: that thread blocks SIGPIPE (the write fails with EPIPE),
    and the host's own threads keep their mask."""
    handle = exporter.start(port=0, interval_s=0.05, helper=False)
    assert handle.url is not None
    with urllib.request.urlopen(handle.url + "/healthz", timeout=5):
        pass
    (http,) = [t for t in threading.enumerate() if t.name == HTTP_THREAD]
    assert http.native_id is not None and _sigpipe_blocked(http.native_id)
    assert not _sigpipe_blocked(threading.main_thread().native_id or 0)


def test_invalid_arguments_raise_config_error(stopped):
    with pytest.raises(ConfigError):
        exporter.start(port="nine")  # type: ignore[arg-type]  # a caller's mistake


def test_attach_uses_the_hosts_app_and_registry(stopped):
    registry = CollectorRegistry()
    Gauge("host_app_requests", "the host's own metric", registry=registry).set(3)
    app = FastAPI()

    @app.get("/metrics")
    def host_metrics() -> str:
        return "host's own route"

    handle = exporter.attach(app, registry=registry, interval_s=0.05)
    client = TestClient(app)
    assert client.get("/metrics").json() == "host's own route"  # left alone
    handle.sampler.tick()
    assert client.get("/healthz").status_code == 200
    names = {m.name for m in registry.collect()}
    assert {"host_app_requests", "gpumem_exporter_source_up"} <= names
    handle.stop()
    assert "gpumem_exporter_source_up" not in {m.name for m in registry.collect()}


@pytest.mark.parametrize("auto_describe", [False, True])
def test_attach_refuses_a_registry_that_has_one_of_its_names(stopped, caplog, auto_describe):
    """The host (or another exporter) already serves torch_cuda_allocated_bytes: two
    collectors of one name would break every scrape of the host's /metrics. The clash is
    found at registration (the collector describes every family it may serve, before any
    sample has one), said on the handle and in one log line; nothing is added or started."""
    registry = CollectorRegistry(auto_describe=auto_describe)
    Gauge("torch_cuda_allocated_bytes", "another exporter's", registry=registry).set(1)
    app = FastAPI()
    routes = len(app.routes)
    threads = set(threading.enumerate())
    with caplog.at_level(logging.ERROR, logger="exporter"):
        handle = exporter.attach(app, registry=registry, interval_s=0.05)
    assert handle.error is not None and "torch_cuda_allocated_bytes" in handle.error
    assert handle.error in caplog.text
    assert len(app.routes) == routes
    assert {m.name for m in registry.collect()} == {"torch_cuda_allocated_bytes"}
    assert not [t for t in set(threading.enumerate()) - threads if t.name.startswith("gpumem")]
    handle.stop()
    # Refused, not remembered: an attach with a registry of its own works.
    other = CollectorRegistry()
    fresh = exporter.attach(app, registry=other, interval_s=0.05)
    assert fresh is not handle and fresh.error is None
    fresh.sampler.tick()
    assert "gpumem_exporter_source_up" in {m.name for m in other.collect()}


def test_attach_adds_metrics_when_the_app_has_none(stopped):
    registry = CollectorRegistry()
    app = FastAPI()
    exporter.attach(app, registry=registry, interval_s=0.05).sampler.tick()
    assert "gpumem_exporter_source_up" in TestClient(app).get("/metrics").text


def test_on_alert_reaches_the_callers_callback(stopped):
    from exporter.detectors import AlertEvent
    from exporter.sample import AllocatorReading, Sample

    events: list[AlertEvent] = []
    handle = exporter.start(serve_http=False, on_alert=events.append)
    sample = Sample(
        timestamp=1.0,
        allocators=[
            AllocatorReading(
                device=0,
                gpu_uuid="GPU-x",
                backend="native",
                expandable_segments=False,
                gauges={"reserved_bytes": 1, "allocated_bytes": 1},
                counters={"ooms": 1},
            )
        ],
    )
    assert handle.runtime is not None
    handle.runtime.detectors(sample)
    assert [(e.alert, e.state) for e in events] == [("GpuMemOutOfMemory", "firing")]


@pytest.mark.slow
def test_the_exporter_stays_out_of_a_uvicorn_host_apps_logs(tmp_path):
    """A real uvicorn host app with uvicorn's default logging (its access log on) starts the
    exporter: the host's own requests are in its log, the exporter's scrapes and probes are
    not (uvicorn logs access by its logger's handlers, whatever access_log says), and uvicorn
    says "Started server process" once, for the host."""
    import http.client
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT
    from tests.helpers import free_port

    host_port, exporter_port = free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO_ROOT / "tests" / "support" / "uvicorn_host_app.py"),
            str(host_port),
            str(exporter_port),
        ],
        stdout=subprocess.PIPE,
        # Apart from stdout: communicate() honours its timeout only with two pipes (with one it
        # reads to the end, which the helper's copy of stderr holds open while it lives).
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == "ready" or line.startswith("error"):
                break
        assert lines and lines[-1].strip() == "ready", "".join(lines)
        time.sleep(0.5)
        kept = http.client.HTTPConnection("127.0.0.1", exporter_port, timeout=10)
        for path in ("/metrics", "/metrics", "/healthz", "/readyz", "/nope"):  # kept alive
            kept.request("GET", path)
            kept.getresponse().read()
        kept.close()
        models = urllib.request.urlopen(f"http://127.0.0.1:{host_port}/v1/models", timeout=10)
        assert models.status == 200
        time.sleep(0.5)
    finally:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"the host did not stop within 30 s of SIGTERM: {err[-3000:]}")
    log = "".join(lines) + out + err
    assert '"GET /v1/models HTTP/1.1" 200' in log, log  # the host's access log works
    for path in ("/metrics", "/healthz", "/readyz", "/nope"):
        assert f"GET {path} " not in log, log
    assert log.count("Started server process") == 1, log


def test_a_metrics_answer_that_fails_to_render_is_a_visible_state(tmp_path, monkeypatch, caplog):
    """Round 5, LOW: a value that broke the render gave every scrape a 500 while /healthz
    said ok, and nothing counted it. Through the real server: the 500 says why, /healthz is
    "failing" with the reason, the log says it once however many scrapes fail, and once a
    render succeeds again /metrics counts the failures and /healthz is ok."""
    from exporter.exposition_templates import TemplateRenderer
    from tests.helpers import served

    def get(url: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    real_render = TemplateRenderer.render
    with served(tmp_path) as (server, _):
        deadline = time.monotonic() + 10
        while get(server.url + "/healthz")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.05)

        def broken(self, families):
            raise ValueError("a value no format can write")

        monkeypatch.setattr(TemplateRenderer, "render", broken)
        with caplog.at_level(logging.ERROR, logger="exporter.exposition"):
            answers = [get(server.url + "/metrics") for _ in range(3)]
        assert {status for status, _ in answers} == {500}
        said = b"could not render /metrics: ValueError: a value no format can write"
        assert said in answers[0][1]
        status, body = get(server.url + "/healthz")
        health = json.loads(body)
        assert status == 503 and health["status"] == "failing"
        assert health["render_failure"] == "ValueError: a value no format can write"
        logged = [r for r in caplog.records if "could not be rendered" in r.getMessage()]
        assert len(logged) == 1

        monkeypatch.setattr(TemplateRenderer, "render", real_render)
        status, body = get(server.url + "/metrics")
        assert status == 200
        assert b"gpumem_exporter_render_failures_total 3.0" in body
        assert get(server.url + "/healthz")[0] == 200
