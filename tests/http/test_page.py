"""The live page at `/`: its JSON route, runbooks, static files and CSP, and the page itself in
headless Chromium against a running server (demo, token, node and run modes), with
screenshots."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from exporter.config import ConfigError, load_config
from exporter.detectors import Detectors
from exporter.http.page import STATIC_FILES
from exporter.http.server import HttpServer, add_routes, create_app
from exporter.page_data import process_rows
from exporter.runbooks import render, slug
from exporter.runtime import Runtime
from exporter.sample import (
    AllocatorReading,
    GpuReading,
    HostProcessReading,
    HostReading,
    ProcessGpuReading,
    Sample,
    SourceReading,
)
from exporter.sources.replay import ReplaySource, demo_trace_path
from exporter.trace import read_trace
from tests.conftest import REPO_ROOT, require_tool
from tests.helpers import captured_oom_samples, decode_png, runtime_of, trace_of_sample

GiB = 1 << 30
TOKEN = "page-test-token"
DRIVER = REPO_ROOT / "tests" / "support" / "live_page_driver.mjs"
STATIC = REPO_ROOT / "exporter" / "static"


class StubSource:
    """Readings given by the test, as a source would return them (node and run layouts)."""

    def __init__(self, name: str, reading: Any) -> None:
        self.name = name
        self._reading = reading
        self.reads = 0

    def read(self) -> SourceReading:
        self.reads += 1
        return self._reading(self.reads) if callable(self._reading) else self._reading

    def close(self) -> None:
        pass


def runtime_for(tmp_path: Path, mode: str, sources: list[Any], **settings: Any) -> Runtime:
    return runtime_of(tmp_path, mode, sources, **settings)


def demo_runtime(tmp_path: Path, **settings: Any) -> Runtime:
    return runtime_for(tmp_path, "demo", [ReplaySource(speed=20)], **settings)


def gpus(n: int, used: int) -> list[GpuReading]:
    return [
        GpuReading(
            index=i,
            uuid=f"GPU-{i}aaaaaaa-0000-0000-0000-000000000000",
            name="NVIDIA H100 80GB HBM3",
            total_bytes=80 * GiB,
            used_bytes=used + i * GiB,
            free_bytes=80 * GiB - used - i * GiB - GiB // 2,
            driver_reserved_bytes=GiB // 2,
        )
        for i in range(n)
    ]


def run_reading(tick: int) -> SourceReading:
    """Two ranks on each of two GPUs, as the launcher of `run` merges them."""
    allocators, processes, host_processes = [], [], []
    for rank in range(4):
        index, pid = rank % 2, 5000 + rank
        uuid = f"GPU-{index}aaaaaaa-0000-0000-0000-000000000000"
        allocated = (10 + 2 * rank) * GiB + (tick % 7) * GiB // 4
        gauges = {"allocated_bytes": allocated, "reserved_bytes": allocated + 3 * GiB}
        if index == 0:  # GPU 1's processes use expandable segments: no inactive_split
            gauges["inactive_split_bytes"] = GiB + rank * GiB // 2
        allocators.append(
            AllocatorReading(
                device=0,
                gpu_uuid=uuid,
                backend="native",
                expandable_segments=index == 1,
                gauges=gauges,
                counters={"alloc_retries": tick // 5 if rank == 3 else 0, "ooms": 0},
                process={
                    "pid": str(pid),
                    "rank": str(rank),
                    "local_rank": str(rank),
                    "role": "worker",
                },
            )
        )
        processes.append(ProcessGpuReading(index, uuid, pid, allocated + 3 * GiB + GiB // 2))
        host_processes.append(HostProcessReading(pid, "worker", str(rank), (3 + rank) * GiB))
    host_processes.append(HostProcessReading(4999, "api-server", "", 2 * GiB))
    used = sum(p.used_bytes for p in processes if p.gpu_index == 0)
    return SourceReading(
        allocators=allocators,
        gpus=gpus(2, used),
        processes=processes,
        host=HostReading(512 * GiB, 400 * GiB, 0, 0),
        host_processes=host_processes,
    )


# -- the JSON route ----------------------------------------------------------------------------


def test_window_route_serves_recent_samples_incrementally(tmp_path):
    runtime = demo_runtime(tmp_path, admin_token=TOKEN)
    for _ in range(3):
        runtime.sampler.tick()
    client = TestClient(create_app(runtime))
    response = client.get("/api/window")
    assert response.status_code == 200
    assert response.headers["cache-control"] == "no-store"
    data = response.json()
    assert data["mode"] == "demo" and data["replay"] is True
    assert data["capacity"] == 600 and data["interval_s"] == 1.0
    assert len(data["timestamps"]) == 3
    gpu0 = data["gpus"][0]
    recorded_gpu = read_trace(demo_trace_path())[1][0].gpus[0]
    assert (gpu0["index"], gpu0["name"]) == (0, recorded_gpu.name) == (0, "NVIDIA H200")
    assert len(gpu0["series"]["allocated_bytes"]) == 3
    recorded = next(s.self_pid for s in read_trace(demo_trace_path())[1] if s.self_pid)
    assert data["processes"][0]["pid"] == recorded  # the recorded process, not ours
    assert data["host"]["total_bytes"] > 0
    last = data["timestamps"][-1]
    assert client.get("/api/window", params={"since": last}).json()["timestamps"] == []
    runtime.sampler.tick()
    newer = client.get("/api/window", params={"since": last}).json()
    assert len(newer["timestamps"]) == 1 and newer["timestamps"][0] > last
    # Only what /metrics exposes: no token, no snapshot folder.
    for text in (response.text, newer and json.dumps(newer)):
        assert TOKEN not in text
        assert str(tmp_path) not in text


@pytest.mark.parametrize("since", ["abc", "nan", "inf", "-1", ""])
def test_window_route_rejects_a_bad_since_with_422(tmp_path, since):
    client = TestClient(create_app(demo_runtime(tmp_path)))
    response = client.get("/api/window", params={"since": since})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["query", "since"]


def oom_runtime(tmp_path: Path, **settings: Any) -> Runtime:
    reading = SourceReading(
        allocators=[
            AllocatorReading(
                device=0,
                gpu_uuid="GPU-x",
                backend="native",
                expandable_segments=False,
                gauges={"allocated_bytes": GiB, "reserved_bytes": 2 * GiB},
                counters={"alloc_retries": 0, "ooms": 1},
            )
        ]
    )
    runtime = runtime_for(tmp_path, "embedded", [StubSource("torch", reading)], **settings)
    runtime.sampler.tick()
    return runtime


def test_firing_alerts_link_to_the_served_runbooks_or_the_configured_base(tmp_path):
    client = TestClient(create_app(oom_runtime(tmp_path)))
    alerts = client.get("/api/window").json()["alerts"]
    (since,) = [a.pop("since") for a in alerts]
    assert alerts == [
        {
            "alert": "GpuMemOutOfMemory",
            "labels": {"device": "0", "gpu_uuid": "GPU-x"},
            "severity": "critical",
            "value": 1,
            "value_label": "OOMs in the last 10 min",
            "value_unit": "count",
            "runbook_url": "runbooks#gpumemoutofmemory",
            "note": "",
        }
    ]
    assert abs(since - time.time()) < 60  # the sample it started firing on
    base = "https://git.example.com/ops/gpumem/blob/main/docs/runbooks.md"
    client = TestClient(create_app(oom_runtime(tmp_path, runbook_url_base=base)))
    (alert,) = client.get("/api/window").json()["alerts"]
    assert alert["runbook_url"] == base + "#gpumemoutofmemory"
    assert client.get("/runbooks").status_code == 200  # still served, only not linked


def test_runbook_url_base_is_read_from_the_environment_and_checked():
    env = {"GPUMEM_RUNBOOK_URL_BASE": "https://wiki.example.com/gpumem"}
    assert load_config(env=env).runbook_url_base == "https://wiki.example.com/gpumem"
    assert load_config(env={}).runbook_url_base is None
    for bad in ("javascript:alert(1)", "/runbooks", "ftp://x/y", "https://x/r.md#top", "https://"):
        with pytest.raises(ConfigError, match="GPUMEM_RUNBOOK_URL_BASE: expected an http"):
            load_config(env={"GPUMEM_RUNBOOK_URL_BASE": bad})


# -- runbooks ------------------------------------------------------------------------------------


def test_the_packaged_runbooks_are_docs_runbooks_md():
    packaged = REPO_ROOT / "exporter" / "data" / "runbooks.md"
    docs = REPO_ROOT / "docs" / "runbooks.md"
    assert packaged.read_bytes() == docs.read_bytes(), (
        "exporter/data/runbooks.md is the copy the exporter serves at /runbooks: "
        "cp docs/runbooks.md exporter/data/runbooks.md"
    )


def test_runbooks_page_has_a_section_per_alert_at_its_github_anchor(tmp_path):
    client = TestClient(create_app(demo_runtime(tmp_path)))
    response = client.get("/runbooks")
    assert response.status_code == 200
    assert "script-src 'self'" in response.headers["content-security-policy"]
    page = response.text
    for alert in Detectors.ALERTS:
        assert f'<section id="{alert.lower()}">' in page, alert
    # The doc's own links use the same anchors.
    markdown = (REPO_ROOT / "docs" / "runbooks.md").read_text()
    for anchor in set(re.findall(r"\]\(#([a-z0-9-]+)\)", markdown)):
        assert f'id="{anchor}"' in page, anchor
    assert "<script" not in page


def test_runbooks_are_rendered_html_with_raw_html_escaped_and_code_blocks_left_whole():
    page = render(
        "# Runbooks\nintro <b>\n## Alert<img src=x onerror=alert(1)>\n"
        "text & <script>alert(1)</script>\n```sh\n## a shell comment\n```\n## Next one\n"
        "| metric | meaning |\n| --- | --- |\n| `a_b` | [see](#next-one) |\n"
        "### A step\nsee [the alerts](../deploy/alerts.yaml) and [docs](https://x.test/d)\n"
    )
    assert "<script>" not in page and "<img" not in page and "<b>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert '<section id="alertimg-srcx-onerroralert1">' in page
    assert "## a shell comment" in page  # not a section: it is inside a code block
    assert page.count("<section") == 3
    # Tables, code and links are HTML; a heading below ## is an anchor of its own.
    assert "<table>" in page and "<td><code>a_b</code></td>" in page
    assert '<a href="#next-one">see</a>' in page and '<h3 id="a-step">' in page
    assert '<a href="https://x.test/d">docs</a>' in page
    # A file of the repository, which the exporter does not serve, is named, not linked.
    assert (
        'href="../deploy' not in page and 'title="../deploy/alerts.yaml in the repository"' in page
    )
    assert slug("Before you start") == "before-you-start"


# -- the page and its files ---------------------------------------------------------------------


def test_the_page_loads_only_its_own_files_under_a_strict_csp(tmp_path):
    client = TestClient(create_app(demo_runtime(tmp_path)))
    response = client.get("/")
    assert response.status_code == 200
    csp = response.headers["content-security-policy"]
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["script-src"] == "'self'"
    assert directives["default-src"] == "'none'" and directives["connect-src"] == "'self'"
    assert response.headers["x-content-type-options"] == "nosniff"
    html = response.text
    # Every script is a file of ours: no inline script, nothing from another origin.
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", html, re.S)
    assert scripts and all('src="static/' in attrs and not body.strip() for attrs, body in scripts)
    assert " on" not in re.sub(r"<!--.*?-->", "", html).replace("\n", " ").split("<body")[0]
    for name in ("index.html", "page.js", "page.css"):
        text = (STATIC / name).read_text()
        assert not re.search(r"https?://", text), name
    for ref in re.findall(r'(?:src|href)="(static/[^"]+)"', html):
        assert client.get("/" + ref).status_code == 200, ref
    js = client.get("/static/page.js")
    assert js.headers["content-type"].startswith("text/javascript")
    assert client.get("/static/uplot/uPlot.iife.min.js").content.startswith(
        b"/*! https://github.com/leeoniya/uPlot (v1.6.32) */"
    )


@pytest.mark.parametrize(
    "path",
    ["/static/index.html", "/static/../http/page.py", "/static/%2e%2e/window.py", "/static/x"],
)
def test_static_files_are_an_allow_list(tmp_path, path):
    client = TestClient(create_app(demo_runtime(tmp_path)))
    assert client.get(path).status_code == 404


def test_the_wheel_ships_every_static_file():
    """pyproject's package-data globs cover exporter/static (checked by hand once with a
    non-editable `pip install .` into a fresh venv)."""
    if sys.version_info < (3, 11):
        pytest.skip("tomllib")
    import tomllib

    globs = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["exporter"]
    package = REPO_ROOT / "exporter"
    for path in [*STATIC.rglob("*"), package / "data" / "runbooks.md"]:
        if path.is_file():
            relative = path.relative_to(package).as_posix()
            assert any(
                fnmatch(relative, g) and "/" not in relative[len(g.rsplit("/", 1)[0]) + 1 :]
                for g in globs
            ), relative
    for name in STATIC_FILES:
        assert (STATIC / name).is_file(), name


def test_attach_leaves_the_host_apps_root_alone(tmp_path):
    """add_routes (what exporter.attach() calls on the host's own app) adds no page routes."""
    app = FastAPI()

    @app.get("/")
    def host_root() -> dict[str, str]:
        return {"app": "host"}

    add_routes(app, demo_runtime(tmp_path))
    client = TestClient(app)
    assert client.get("/").json() == {"app": "host"}
    assert client.get("/api/window").status_code == 404
    assert client.get("/healthz").status_code in (200, 503)


# -- the process table ---------------------------------------------------------------------------


def test_process_rows_under_run_merge_allocators_nvml_and_host_memory():
    reading = run_reading(1)
    sample = Sample(
        timestamp=1.0,
        allocators=reading.allocators,
        gpus=reading.gpus,
        processes=reading.processes,
        host=reading.host,
        host_processes=reading.host_processes,
        self_pid=4999,  # the launcher
    )
    rows = {row["pid"]: row for row in process_rows(sample)}
    assert set(rows) == {4999, 5000, 5001, 5002, 5003}
    rank3 = rows[5003]
    assert (rank3["role"], rank3["rank"]) == ("worker", "3")
    assert rank3["gpus"] == ["GPU-1aaaaaaa-0000-0000-0000-000000000000"]
    assert rank3["allocated_bytes"] == 16 * GiB + GiB // 4
    assert rank3["reserved_bytes"] == rank3["allocated_bytes"] + 3 * GiB
    assert rank3["gpu_used_bytes"] == rank3["reserved_bytes"] + GiB // 2
    assert rank3["host_resident_bytes"] == 6 * GiB
    launcher = rows[4999]
    assert (launcher["role"], launcher["gpus"], launcher["gpu_used_bytes"]) == (
        "api-server",
        [],
        None,
    )
    # Biggest GPU user first.
    assert [r["pid"] for r in process_rows(sample)][:2] == [5003, 5002]


def test_process_rows_outside_run_name_the_allocator_process_by_its_pid():
    sample = Sample(
        timestamp=1.0,
        self_pid=42,
        allocators=[
            AllocatorReading(
                0, "GPU-a", "native", False, gauges={"allocated_bytes": 5, "reserved_bytes": 9}
            )
        ],
        processes=[ProcessGpuReading(0, "GPU-a", 42, 20), ProcessGpuReading(0, "GPU-a", 43, 7)],
        host=HostReading(100, 50, 0, 0, process_resident_bytes=11, process_resident_peak_bytes=12),
    )
    rows = {row["pid"]: row for row in process_rows(sample)}
    assert rows[42]["allocated_bytes"] == 5 and rows[42]["gpu_used_bytes"] == 20
    assert rows[42]["host_resident_bytes"] == 11  # the exporter's own process is the allocator's
    assert rows[43]["allocated_bytes"] is None and rows[43]["host_resident_bytes"] is None


# -- in a browser ------------------------------------------------------------------------------


@contextmanager
def serving(runtime: Runtime) -> Iterator[str]:
    """A real uvicorn on port 0 and the sampler thread, as the CLI runs them."""
    http = HttpServer(create_app(runtime), "127.0.0.1", 0)
    runtime.sampler.start()
    http.start()
    try:
        yield http.url + "/"
    finally:
        http.stop()
        runtime.sampler.stop()


def wait_for_points(runtime: Runtime, count: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while len(runtime.window) < count:
        assert time.monotonic() < deadline, f"only {len(runtime.window)} samples"
        time.sleep(0.1)


def drive(url: str, tmp_path: Path, name: str, **options: Any) -> dict[str, Any]:
    """Run tests/support/live_page_driver.mjs; keep its screenshots (printed, and copied to
    $GPUMEM_ARTIFACTS when set)."""
    chromium = require_tool("chromium")
    node = require_tool("node")
    out = tmp_path / f"{name}-shots"
    out.mkdir()
    config = {
        "chromium": chromium,
        "url": url,
        "out_dir": str(out),
        "profile": str(tmp_path / f"{name}-profile"),
    }
    proc = subprocess.run(
        [node, str(DRIVER), json.dumps({**config, **options})],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    artifacts = os.environ.get("GPUMEM_ARTIFACTS")
    for shot in result["screenshots"]:
        print(f"screenshot: {shot}")
        if artifacts:
            Path(artifacts).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(artifacts) / f"{name}-{Path(shot).name}")
    assert "failure" not in result, result["failure"]
    return result


def colours_of(png: Path, width: int) -> tuple[Counter[bytes], int]:
    w, _, bpp, rows = decode_png(png.read_bytes())
    assert w == width
    colours: Counter[bytes] = Counter()
    for row in rows[::2]:
        for i in range(0, len(row), 2 * bpp):
            colours[row[i : i + 3]] += 1
    return colours, sum(colours.values())


def unexpected(errors: list[str], *allowed: str) -> list[str]:
    """Console errors other than the admin answers the page expects and shows in its text
    (Chromium logs every 4xx fetch)."""
    return [e for e in errors if not any(a in e for a in allowed)]


ALLOCATED = bytes.fromhex("3465d0")  # page.js: the allocated layer of the stack
CACHED_FREE = bytes.fromhex("f2a33a")


@pytest.mark.slow
def test_live_page_on_the_demo_draws_alerts_and_actions_without_a_token(tmp_path):
    runtime = demo_runtime(tmp_path, interval_s=0.2)  # no admin token: the demo needs none
    with serving(runtime) as url:
        wait_for_points(runtime, 70)  # 14 s at 20x: the trace's retries and its OOM, at 42 s
        result = drive(
            url,
            tmp_path,
            "demo",
            widths=[1400, 420],
            min_gpus=1,
            min_points=len(runtime.window) + 3,
            actions=True,
        )
        # Polled with ?since=: the page holds each sample once (never more than the server).
        assert max(c["points"] for c in result["widths"]["1400"]["cards"]) <= len(runtime.window)
    assert result["errors"] == []
    for width in (1400, 420):
        state = result["widths"][str(width)]
        assert state["pageErrors"] == 0, state["pageErrorText"]
        # Nothing reaches past the window, the OOM banner's long action included (a phone),
        # nor a cell of the processes' or the snapshots' tables (rows are cards there).
        assert state["sideways"] == [], (width, state["sideways"])
        assert state["tableRows"] >= 1 and state["cutCells"] == [], (width, state["cutCells"])
        (gpu0,) = state["cards"]
        assert gpu0["title"] == "GPU 0 · NVIDIA H200"
        # Four layers of the stack (free is left out: the demo's process uses a sixth of the
        # GPU, so the chart starts zoomed in on memory in use); both ratios.
        assert gpu0["drawn"] == [4, 2]
        assert "GiB" in gpu0["facts"] and "fragmentation" in gpu0["facts"]
        # The OOMs in view and in all; the process's 22 GiB cap, which they come from.
        assert re.search(r"OOMs\s*[1-9]\d* in view · [1-9]\d* in all", gpu0["legend"])
        assert re.search(r"cap\s*22\.00 GiB", gpu0["legend"]), gpu0["legend"]
        assert gpu0["legendOverflow"] == []
        # The memory ledger's bar: the components the recorded server named first (its
        # weights; its KV cache while a batch runs), then the ledger's own parts, each as wide
        # as its share of the latest sample's (the page's last poll) total.
        ledger = gpu0["ledger"]
        names = [part for part, _ in ledger["parts"]]
        assert names[0] == "weights", ledger
        own = {"private_pools", "other_live", "cached_free", "outside_allocator"}
        assert set(names) <= {"weights", "kv_cache"} | own
        assert {"other_live", "cached_free"} <= set(names), ledger
        assert abs(sum(share for _, share in ledger["parts"]) - 1) < 0.02, ledger
        assert re.match(r"ledger [\d.]+ GiB =", ledger["text"]), ledger["text"]
        assert state["processes"] == 1
        alerts = {a["name"]: a for a in state["alerts"]}
        oom = alerts["GpuMemOutOfMemory"]
        assert oom["href"] == "runbooks#gpumemoutofmemory", state["alerts"]
        assert oom["severity"] == "critical" and state["alerts"][0] == oom  # critical first
        # Its value is the rise within the alert's window (the banner counts them all).
        assert re.fullmatch(r"OOMs in the last 10 min \d+", oom["value"]), oom["value"]
        assert oom["since"].startswith("since ")
        assert alerts["GpuMemAllocRetries"]["severity"] == "warning"
        assert state["adminState"].startswith("Demo:")
        colours, total = colours_of(tmp_path / "demo-shots" / f"live-page-{width}.png", width)
        background, _ = colours.most_common(1)[0]
        assert sum(n for c, n in colours.items() if c != background) > 0.2 * total
        assert colours[ALLOCATED] > 0.002 * total and colours[CACHED_FREE] > 0.002 * total
    actions = result["actions"]
    assert (
        "Snapshot" in actions["snapshot"]["result"]
        and "nothing changed" in actions["snapshot"]["result"]
    )
    # The one taken, and the OOMs' (listed once the replay passed each recorded OOM).
    ooms = [s for s in runtime.actions.store.list() if s.trigger == "oom"]
    assert ooms and actions["snapshot"]["snapshotRows"] == 1 + len(ooms)
    assert re.search(
        r"would release [\d.]+ [MG]iB \(second [\d.]+ of the replayed trace\)",
        actions["emptyCache"]["result"],
    )
    assert result["dialogs"] and result["dialogs"][0].startswith("Empty the PyTorch cache")
    assert actions["viewed"]["url"].endswith("/view")
    assert actions["viewed"]["title"].startswith("GPU memory snapshot")
    assert actions["sessionToken"] is None


@pytest.mark.slow
def test_live_page_shows_each_oom_verdict_in_a_banner_at_the_top(tmp_path):
    """The readings of a fragmentation OOM made on an H100, replayed: the banner names the
    verdict, the deciding numbers, the action and links the snapshot and the runbook."""
    (sample,) = [
        s for s in captured_oom_samples() if s.allocators[0].ooms_by_verdict.get("fragmentation")
    ]
    verdict = sample.allocators[0].last_oom
    assert verdict is not None
    trace = trace_of_sample(tmp_path / "oom.jsonl.gz", sample, count=40)
    runtime = runtime_for(tmp_path, "demo", [ReplaySource(trace, speed=20)], interval_s=0.2)
    with serving(runtime) as url:
        wait_for_points(runtime, 3)
        result = drive(url, tmp_path, "oom", widths=[1280, 420], min_points=3)
    assert result["errors"] == []
    for width in ("1280", "420"):
        state = result["widths"][width]
        assert state["pageErrors"] == 0, state["pageErrorText"]
        oom = state["oom"]
        assert not oom["hidden"] and oom["above"], oom
        # Its action's long setting wraps inside the window at a phone's width.
        assert state["sideways"] == [], (width, state["sideways"])
        (entry,) = oom["entries"]
        assert entry["verdict"] == "fragmentation"
        assert "fragmentation: the cache had the bytes, in pieces" in entry["text"]
        assert entry["numbers"]["requested_bytes"] == "512 MiB"
        assert entry["numbers"]["largest_free_block_bytes"] == "160 MiB"
        assert set(entry["numbers"]) >= {
            "requested_bytes",
            "free_in_holes_bytes",
            "largest_free_block_bytes",
            "cap_room_bytes",
            "device_free_bytes",
        }
        assert "Do: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in entry["text"]
        assert "1 OOM (fragmentation 1)" in entry["text"]
        assert ["runbook", "runbooks#out-of-memory-verdicts"] in entry["links"]
        assert ["snapshot at the OOM", f"snapshots/{verdict.snapshot}/view"] in entry["links"]


@pytest.mark.slow
def test_live_page_says_verdict_pending_from_the_moment_the_count_moves(tmp_path):
    """An OOM counted whose verdict the observer has not recorded yet (it takes its readings
    on the OOM-ing thread): the banner says so at the top instead of explaining the earlier
    OOM, which stays below it."""
    (sample,) = [
        s for s in captured_oom_samples() if s.allocators[0].ooms_by_verdict.get("fragmentation")
    ]
    judged = sample.allocators[0]
    assert judged.last_oom is not None
    judged = dataclasses.replace(judged, last_oom=dataclasses.replace(judged.last_oom, followed=2))

    def reading(reads: int) -> SourceReading:
        ooms = 1 if reads == 1 else 2  # the second OOM from the second read on
        counters = {**judged.counters, "ooms": ooms}
        return SourceReading(allocators=[dataclasses.replace(judged, counters=counters)])

    runtime = runtime_for(tmp_path, "embedded", [StubSource("torch", reading)], interval_s=0.2)
    with serving(runtime) as url:
        wait_for_points(runtime, 3)
        result = drive(url, tmp_path, "pending", widths=[1280], min_points=2)
    assert unexpected(result["errors"], "/snapshots") == []  # admin is off here: 403
    oom = result["widths"]["1280"]["oom"]
    assert not oom["hidden"] and oom["above"], oom
    first, earlier = oom["entries"]
    assert first["verdict"] == "pending" and "verdict pending" in first["text"], first
    assert "the verdict, its numbers and the snapshot follow here" in first["text"]
    assert earlier["verdict"] == "fragmentation"
    assert "The burst's most complete record: 2 more OOMs followed it." in earlier["text"]


@pytest.mark.slow
def test_ooms_a_burst_apart_stay_apart_on_the_chart(tmp_path):
    """Two OOMs 40 s apart in a 10-minute view on a phone are a few pixels apart: they are
    two markers, not one band, as the banner counts bursts (30 s)."""
    (sample,) = [
        s for s in captured_oom_samples() if s.allocators[0].ooms_by_verdict.get("fragmentation")
    ]
    judged = sample.allocators[0]
    runtime = runtime_for(tmp_path, "embedded", [StubSource("torch", SourceReading())])
    now = time.time()
    for i in range(600):  # the last ten minutes, a sample a second
        ooms = (i >= 300) + (i >= 340)
        counters = {**judged.counters, "ooms": ooms}
        reading = dataclasses.replace(judged, counters=counters)
        runtime.window(Sample(timestamp=now - 600 + i, allocators=[reading]))
    with serving(runtime) as url:
        result = drive(url, tmp_path, "apart", widths=[420], min_points=100)
    markers = result["widths"]["420"]["cards"][0]["markers"]["markers"]
    oom_marks = [m for m in markers if m["kind"] == "OOM"]
    assert [m["count"] for m in oom_marks] == [1, 1], oom_marks
    assert oom_marks[1]["x0"] - oom_marks[0]["x1"] < 60  # so close that pixels would merge


STORM_TRACE = REPO_ROOT / "tests" / "data" / "h200_oom_storm_trace.jsonl.gz"


def _storm_in_window(runtime: Runtime) -> bool:
    sample = runtime.sampler.state().sample
    ooms = [r.counters.get("ooms", 0) for r in sample.allocators] if sample else [0]
    return max(ooms) >= 200 and len(runtime.window) > 60


@pytest.mark.slow
def test_live_page_stays_readable_in_an_oom_storm(tmp_path):
    """A real H200 trace with 307 OOMs and as many retries in 30 s (a scripted fragmenter
    under a cap): markers merge and carry their counts, labels neither overlap nor leave the
    plot, legend rows fit, and the critical alert comes first with its value and start."""
    runtime = runtime_for(tmp_path, "demo", [ReplaySource(STORM_TRACE, speed=10)], interval_s=0.2)
    with serving(runtime) as url:
        deadline = time.monotonic() + 60
        while not _storm_in_window(runtime):
            assert time.monotonic() < deadline, "the storm never reached the window"
            time.sleep(0.2)
        result = drive(url, tmp_path, "storm", widths=[1400, 420], min_points=60)
    assert result["errors"] == []
    for width in (1400, 420):
        state = result["widths"][str(width)]
        assert state["sideways"] == [], (width, state["sideways"])
        card = state["cards"][0]
        markers, labels = card["markers"]["markers"], card["markers"]["labels"]
        ooms = [m for m in markers if m["kind"] == "OOM"]
        legend = re.search(r"OOMs\s*(\d+) in view", card["legend"])
        assert legend is not None, card["legend"]
        in_view = int(legend[1])
        assert in_view >= 100 and sum(m["count"] for m in ooms) == in_view
        # Merged: far fewer markers than rises, at least one carrying many OOMs.
        assert len(ooms) < 10 and max(m["count"] for m in ooms) >= 20, ooms
        # A merged span is shaded in a strip along the plot's top, not over the series
        # (whose colours it would change).
        plot_top, plot_bottom = labels[0]["plot"][1], labels[0]["plot"][3]
        bands = [m["band"] for m in ooms if m["band"]]
        assert bands, ooms
        for y0, y1 in bands:
            assert plot_top - 1 <= y0 and y1 - y0 <= 0.1 * (plot_bottom - plot_top), (y0, y1)
        for label in labels:
            left, top, right, bottom = label["plot"]
            assert left <= label["x0"] and label["x1"] <= right, label
            assert top <= label["y0"] and label["y1"] <= bottom, label
        for kind in ("OOM", "retry"):
            row = sorted((lb for lb in labels if lb["kind"] == kind), key=lambda lb: lb["x0"])
            assert row, kind
            assert all(a["x1"] <= b["x0"] for a, b in itertools.pairwise(row)), row
        assert any("×" in lb["text"] for lb in labels)
        assert card["legendOverflow"] == []
        names = [a["name"] for a in state["alerts"]]
        assert names[0] == "GpuMemOutOfMemory" and state["alerts"][0]["severity"] == "critical"
        assert all(a["severity"] == "warning" for a in state["alerts"][1:]), state["alerts"]


@pytest.mark.slow
def test_live_page_works_behind_basic_auth(tmp_path):
    """The web config asks for a password: the browser's prompt is answered once, the page's
    own requests carry it, and its admin actions still go with the admin token."""
    import bcrypt

    from tests.support.pki import web_config

    hashed = bcrypt.hashpw(b"page-pw", bcrypt.gensalt(4)).decode()
    config = web_config(tmp_path, f"basic_auth_users:\n  oncall: {hashed}\n")
    runtime = demo_runtime(tmp_path, interval_s=0.5, admin_token=TOKEN, web_config_file=str(config))
    with serving(runtime) as url:
        wait_for_points(runtime, 2)
        credentials = {"username": "oncall", "password": "page-pw"}
        result = drive(
            url, tmp_path, "basic", widths=[1000], actions=True, token=TOKEN, basic_auth=credentials
        )
    assert result["authPrompts"] >= 1
    assert unexpected(result["errors"], "status of 401 (Unauthorized) http://127.0.0.1") == []
    state = result["widths"]["1000"]
    assert state["pageErrors"] == 0 and state["cards"][0]["points"] >= 2
    assert "Snapshot" in result["actions"]["snapshot"]["result"]


@pytest.mark.slow
def test_live_page_asks_for_the_token_and_keeps_it_out_of_urls(tmp_path):
    runtime = demo_runtime(tmp_path, interval_s=0.5, admin_token=TOKEN)
    with serving(runtime) as url:
        wait_for_points(runtime, 2)
        result = drive(url, tmp_path, "token", widths=[1000], actions=True, token=TOKEN)
    # The page's first look at /snapshots is answered 401 (it then asks for the token).
    assert unexpected(result["errors"], "status of 401 (Unauthorized) http://127.0.0.1") == []
    actions = result["actions"]
    assert actions["beforeToken"]["tokenFormShown"] is True
    assert "admin token" in actions["beforeToken"]["adminState"]
    assert "Snapshot" in actions["snapshot"]["result"] and not actions["snapshot"]["tokenFormShown"]
    assert "would release" in actions["emptyCache"]["result"]
    assert actions["sessionToken"] == TOKEN  # this tab's sessionStorage, nowhere else
    # With a token, the view is fetched with it and opened from memory; its inline styles
    # still apply under the page's CSP.
    viewed = actions["viewed"]
    assert viewed["url"].startswith("blob:http://127.0.0.1") and viewed["styled"] is True
    for state in (actions["snapshot"], actions["emptyCache"], *result["widths"].values()):
        assert TOKEN not in state["location"]


@pytest.mark.slow
def test_live_page_in_node_mode_shows_nvml_memory_and_admin_off(tmp_path):
    def node_reading(tick: int) -> SourceReading:
        return SourceReading(
            gpus=gpus(4, (20 + tick % 5) * GiB),
            processes=[
                ProcessGpuReading(
                    i, f"GPU-{i}aaaaaaa-0000-0000-0000-000000000000", 700 + i, 20 * GiB
                )
                for i in range(4)
            ],
            host=HostReading(512 * GiB, 300 * GiB, 8 * GiB, GiB),
        )

    runtime = runtime_for(tmp_path, "node", [StubSource("nvml", node_reading)], interval_s=0.5)
    with serving(runtime) as url:
        wait_for_points(runtime, 3)
        result = drive(url, tmp_path, "node", widths=[1400], min_gpus=4)
    assert unexpected(result["errors"], "status of 403 (Forbidden) http://127.0.0.1") == []
    state = result["widths"]["1400"]
    assert [c["drawn"] for c in state["cards"]] == [[2]] * 4
    assert "GPUMEM_ADMIN_TOKEN" in state["adminState"] and not state["tokenFormShown"]
    assert state["processes"] == 4


@pytest.mark.slow
def test_live_page_under_run_stacks_the_processes_of_each_gpu(tmp_path):
    runtime = runtime_for(tmp_path, "run", [StubSource("agents", run_reading)], interval_s=0.2)
    with serving(runtime) as url:
        wait_for_points(runtime, 25)
        result = drive(url, tmp_path, "run", widths=[1400], min_gpus=2)
    assert unexpected(result["errors"], "status of 403 (Forbidden) http://127.0.0.1") == []
    state = result["widths"]["1400"]
    # Zoomed in (no free layer); GPU 1 has no fragmentation ratio to draw, and says "n/a".
    assert [c["drawn"] for c in state["cards"]] == [[4, 2], [4, 1]]
    assert re.search(r"fragmentation \d+\.\d %", state["cards"][0]["facts"])
    assert "fragmentation n/a" in state["cards"][1]["facts"]
    assert re.search(r"retries \d+", state["cards"][1]["facts"])
    assert re.search(r"alloc retries\s*[1-9]\d* in view", state["cards"][1]["legend"])
    assert state["processes"] == 5


@pytest.mark.slow
def test_the_page_scripts_are_modules_that_pass_eslint():
    """exporter/static/*.js are ES modules checked by ESLint (tests/js/eslint.config.mjs): a
    name declared twice, an undefined or unused one, loose equality."""
    from tests.helpers import JS_DIR, require_js_deps

    require_js_deps()
    eslint = JS_DIR / "node_modules" / ".bin" / "eslint"
    scripts = sorted((REPO_ROOT / "exporter" / "static").glob("*.js"))
    assert {p.name for p in scripts} <= set(STATIC_FILES), "a script the server does not serve"
    proc = subprocess.run(
        [str(eslint), "--config", str(JS_DIR / "eslint.config.mjs"), *map(str, scripts)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_retry_alert_on_the_page_says_what_its_process_is_building():
    """The note under GpuMemAllocRetries comes from the reading the alert is about."""
    from exporter.page_data import alert_note
    from exporter.sample import AllocatorReading

    def reading(device: int, pid: str) -> AllocatorReading:
        return AllocatorReading(
            device,
            f"GPU-{device}",
            "native",
            False,
            gauges={"reserved_bytes": 6 * GiB, "memory_limit_bytes": 20 * GiB},
            layout={"free_in_used_segments_bytes": 3 * GiB, "largest_free_block_bytes": 1 << 27},
            process={"pid": pid, "rank": "", "local_rank": "", "role": "w"},
        )

    sample = Sample(timestamp=1.0, allocators=[reading(0, "1"), reading(1, "2")])
    sample.allocators[1].layout["largest_free_block_bytes"] = 2 * GiB
    labels = {"device": "0", "gpu_uuid": "GPU-0", "pid": "1", "role": "w"}
    assert alert_note(sample, "GpuMemAllocRetries", labels).startswith("fragmentation building")
    other = {**labels, "device": "1", "gpu_uuid": "GPU-1", "pid": "2"}
    assert alert_note(sample, "GpuMemAllocRetries", other) == ""  # its cache is in one piece
    assert alert_note(sample, "GpuMemOutOfMemory", labels) == ""


def test_a_retry_alert_beside_an_oom_verdict_gives_one_diagnosis():
    """Retries and an OOM on one process: the note leads with the verdict taken at the OOM and
    keeps only what agrees with it (never "close to the cap" under a fragmentation verdict)."""
    from exporter.oom_verdict import OomVerdict
    from exporter.page_data import alert_note
    from exporter.sample import AllocatorReading

    both = AllocatorReading(
        0,
        "GPU-0",
        "native",
        False,
        gauges={"reserved_bytes": 39 * GiB // 2, "memory_limit_bytes": 20 * GiB},
        layout={"free_in_used_segments_bytes": 3 * GiB, "largest_free_block_bytes": 1 << 27},
        process={"pid": "1", "rank": "", "local_rank": "", "role": "w"},
    )
    labels = {"device": "0", "gpu_uuid": "GPU-0", "pid": "1", "role": "w"}
    before = alert_note(Sample(timestamp=1.0, allocators=[both]), "GpuMemAllocRetries", labels)
    assert "fragmentation building" in before and "close to the cap" in before  # no OOM yet
    for verdict, kept, dropped in (
        ("fragmentation", "fragmentation building", "close to the cap"),
        ("cap", "close to the cap", "fragmentation building"),
        ("exhaustion", None, "close to the cap"),
    ):
        last = OomVerdict(0, 2.0, 1 << 30, verdict=verdict)
        sample = Sample(timestamp=3.0, allocators=[dataclasses.replace(both, last_oom=last)])
        note = alert_note(sample, "GpuMemAllocRetries", labels)
        assert note.startswith(f"its latest OOM: {verdict}"), note
        assert dropped not in note and (kept is None or kept in note), note


@pytest.mark.slow
def test_runbook_tables_fit_the_window_without_scrolling_sideways(tmp_path):
    """Every table of /runbooks, its "what to do" column included, is whole at 1400 px and
    on a phone: long code and words wrap inside their cells."""
    runtime = runtime_for(tmp_path, "node", [StubSource("nvml", SourceReading(unavailable="x"))])
    with serving(runtime) as url:
        result = drive(
            url, tmp_path, "runbooks", widths=[], min_gpus=0, runbooks_widths=[1400, 1920, 420]
        )
    for width in ("1400", "1920", "420"):
        shown = result["runbooks"][width]
        assert shown["tables"] >= 4 and shown["clipped"] == [], (width, shown)
        # No word of prose broken mid-word (at 1400 px "fragmen/tation", beside empty room).
        assert shown["broken"] == [], (width, shown["broken"])


@pytest.mark.slow
def test_the_page_is_told_why_no_gpu_reading_comes(tmp_path):
    """Under `run` before any agent reports, or a daemon without NVML: the page says why, as
    the log does, instead of only "No GPU reading yet" (issue 38)."""
    why = "NVML library not found"
    runtime = runtime_for(tmp_path, "node", [StubSource("nvml", SourceReading(unavailable=why))])
    runtime.sampler.tick()
    body = TestClient(create_app(runtime)).get("/api/window").json()
    assert body["sources_why"] == {"nvml": why}
    assert body["gpus"] == []
    with serving(runtime) as url:
        result = drive(url, tmp_path, "why", widths=[800], min_gpus=0, min_points=0)
    assert result["widths"]["800"]["noGpus"] == f"No GPU reading yet (nvml: {why})."
