"""Helpers the test modules share (no test module imports another): apps, CLI runs, ports,
captured samples, fake torch; the deployment checks' tools; a real Prometheus server.

Tools that a deployment check needs (PyPI packages such as helm-python-sdk, or tests/js,
installed with `npm ci --prefix tests/js`) skip on a developer's machine when missing and
fail in CI (GPUMEM_REQUIRE_TOOLS=1), like require_tool()."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import json
import os
import re
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, NoReturn

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from exporter.actions.local import LocalActions
from exporter.actions.snapshots import SnapshotStore
from exporter.config import load_config
from exporter.exposition import RenderFailures
from exporter.fill.render import ActionStats, EndpointState
from exporter.http.server import HttpServer, create_app
from exporter.kubernetes.claims import ClaimedDevice
from exporter.metrics import SampleCollector
from exporter.modes import MODES
from exporter.request_counts import RequestCounts
from exporter.runtime import build_runtime
from exporter.sample import (
    ActionCounts,
    AllocatorReading,
    ExporterState,
    GpuReading,
    HostProcessReading,
    KubeletReading,
    PodDevice,
    ProcessContainerReading,
    ProcessCounts,
    ProcessGpuReading,
    Sample,
    SourceStatus,
)
from exporter.sources.replay import (
    ReplaySource,
    demo_trace_path,
    derive_recorded_non_allocator,
    derive_recorded_pool_kinds,
)
from exporter.trace import read_trace
from tests.conftest import DATA_DIR, REPO_ROOT, require_tool


def decode_png(data: bytes) -> tuple[int, int, int, list[bytes]]:
    """(width, height, bytes per pixel, rows) of an 8-bit non-interlaced PNG, using zlib only."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    assert header is not None
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and interlace == 0, header
    bpp = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    stride = width * bpp
    raw = zlib.decompress(b"".join(idat))
    low7 = int.from_bytes(b"\x7f" * stride, "big")
    high1 = int.from_bytes(b"\x80" * stride, "big")
    rows: list[bytes] = []
    prev = bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind_, line = raw[start], raw[start + 1 : start + 1 + stride]
        if kind_ == 0:
            cur = line
        elif kind_ == 2:
            # "Up", the commonest filter: byte-wise addition mod 256 of whole rows at once.
            a, b = int.from_bytes(line, "big"), int.from_bytes(prev, "big")
            cur = (((a & low7) + (b & low7)) ^ ((a ^ b) & high1)).to_bytes(stride, "big")
        else:
            out = bytearray(line)
            for i in range(stride):
                left = out[i - bpp] if i >= bpp else 0
                up = prev[i]
                if kind_ == 1:
                    pred = left
                elif kind_ == 3:
                    pred = (left + up) >> 1
                else:  # Paeth
                    up_left = prev[i - bpp] if i >= bpp else 0
                    p = left + up - up_left
                    pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
                    pred = left if pa <= pb and pa <= pc else up if pb <= pc else up_left
                out[i] = (out[i] + pred) & 0xFF
            cur = bytes(out)
        rows.append(cur)
        prev = cur
    return width, height, bpp, rows


class FakeCuda:
    """Records every call so tests can prove which devices were touched."""

    def __init__(self, stats: dict, initialized: bool, contexts: set[int], count: int = 2):
        self.stats = stats
        self.initialized = initialized
        self.contexts = contexts
        self.count = count
        self.calls: list[tuple] = []

    def is_initialized(self):
        return self.initialized

    def device_count(self):
        return self.count

    def memory_stats_as_nested_dict(self, device=None):
        self.calls.append(("memory_stats_as_nested_dict", device))
        assert isinstance(device, int), "device index must always be explicit"
        return self.stats

    def get_allocator_backend(self):
        return "native"

    def get_device_properties(self, index):
        self.calls.append(("get_device_properties", index))
        return SimpleNamespace(uuid=f"0000-{index}")


def fake_torch(cuda: FakeCuda, with_context_api: bool = True, accelerator: bool = True):
    """A torch whose CUDA is `cuda`, with torch.accelerator over the same allocator (its
    `_accelerator_getDeviceStats` is what torch.accelerator.memory_stats reads)."""
    c = SimpleNamespace()
    if with_context_api:
        c._cuda_hasPrimaryContext = lambda i: i in cuda.contexts
    module = SimpleNamespace(cuda=cuda, _C=c)
    if accelerator:
        c._accelerator_isAllocatorInitialized = cuda.is_initialized
        c._accelerator_getDeviceStats = cuda.memory_stats_as_nested_dict
        module.accelerator = SimpleNamespace(
            current_accelerator=lambda: SimpleNamespace(type="cuda"),
            device_count=cuda.device_count,
        )
    return module


class ProbedServer:
    """A torch double whose allocator stats (captured on an H200) a test moves, CUDA
    initialized on device 0, and `run`'s agent over it, counting its full samples: what the
    probe's tests (tests/probe) tick by hand."""

    def __init__(self) -> None:
        capture = json.loads((DATA_DIR / "allocator_native.json").read_text())
        self.stats = capture["memory_stats_as_nested_dict"]
        self.host_stats = capture["host_memory_stats"]
        self.cuda = FakeCuda(self.stats, True, {0}, count=1)
        self.torch = fake_torch(self.cuda)
        self.torch._C._cuda_memoryStats = lambda i: self.stats
        self.torch._C._cuda_hostMemoryStats = lambda: self.host_stats
        self.full_ticks = 0

    def agent(self, run_dir: Path, **settings: float) -> Any:
        from exporter.probe.allocator import AllocatorProbe
        from exporter.sources.torch_allocator import TorchAllocatorSource
        from exporter.transport.agent import Agent

        (run_dir / "agent.json").write_text(json.dumps({"layout_interval_s": 0, **settings}))
        agent = Agent(str(run_dir), interval_s=3600)  # the test ticks it
        agent.source = TorchAllocatorSource(self.torch, layout_interval_s=0)
        agent.probe = AllocatorProbe(self.torch)
        full = agent._full_tick

        def counted() -> None:
            self.full_ticks += 1
            full()

        agent._full_tick = counted  # type: ignore[method-assign]
        return agent

    def allocate(self, nbytes: int) -> None:
        # As the caching allocator counts it: in all, and in the pool of its size (PyTorch's
        # small pool takes blocks of up to 1 MiB).
        pool = "small_pool" if nbytes <= 1 << 20 else "large_pool"
        for where in ("all", pool):
            self.stats["allocated_bytes"][where]["current"] += nbytes


def captured_sample(name: str) -> Sample:
    """A sample as the exporter's own sources read it on the GPU machine."""
    data = json.loads((DATA_DIR / f"allocator_{name}.json").read_text())
    sample = Sample(
        timestamp=1.0,
        allocators=[AllocatorReading(**a) for a in data["exporter_allocators"]],
        gpus=[GpuReading(**g) for g in data["exporter_gpus"]],
        processes=[ProcessGpuReading(**p) for p in data["exporter_processes"]],
        self_pid=data["pid"],
    )
    # Captured before processes took their non-allocator bytes themselves: derived from the
    # capture's process list, read in the same tick, as a replay does.
    derive_recorded_non_allocator([sample])
    return sample


def captured_oom_samples() -> list[Sample]:
    """One sample per OOM made on purpose on an H100 (tests/data/oom_verdicts.json): the
    allocator reading, verdict included, as the exporter's source read it after the OOM."""
    data = json.loads((DATA_DIR / "oom_verdicts.json").read_text())
    return [
        Sample(timestamp=2.0, allocators=[AllocatorReading.from_dict(run["reading"])])
        for run in data["runs"]
    ]


def trace_of_sample(path: Path, sample: Sample, count: int = 5) -> Path:
    """A trace that replays one sample `count` times, a second apart."""
    from exporter.trace import TraceWriter

    writer = TraceWriter(path)
    for i in range(count):
        writer(dataclasses.replace(sample, timestamp=100.0 + i))
    return writer.close()


def render(
    sample: Sample | None, labels: dict | None = None, replay: bool = False, detail: str = "full"
) -> str:
    """The sample's exposition, at the full detail level unless told (every family it has)."""
    registry = CollectorRegistry()
    state = ExporterState(
        sample=sample,
        sources={"torch": SourceStatus(True, 1e-5, 0), "nvml": SourceStatus(False, 2e-5, 3)},
    )
    registry.register(
        SampleCollector(
            lambda: state,
            const_labels=labels or {},
            version="0.1.0",
            traits=MODES["demo" if replay else "embedded"].traits,
            torch_version="2.11.0",
            detail=detail,
        )
    )
    return generate_latest(registry).decode()


@contextlib.contextmanager
def served(tmp_path, host="127.0.0.1", wrap=None, **settings):
    """The demo's app on a real uvicorn server in this process (sockets, not a test client),
    with its sampler running as in production: a sample ticked once by hand goes stale after
    5 s, and /healthz then answers 503 (which, on a busy machine, a test setting up 70
    clients took for the guard's). `wrap(app)`: what the server serves instead of the app
    (it must keep the app's `state`)."""
    app, runtime = make_app(tmp_path, **settings)
    server = HttpServer(wrap(app) if wrap else app, host, 0)
    runtime.sampler.start()
    server.start()
    try:
        deadline = time.monotonic() + 10
        while not server._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        yield server, runtime
    finally:
        server.stop()
        runtime.sampler.stop()


TOKEN = "s3cret-token"


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def runtime_of(tmp_path, mode, sources, **settings):
    """A runtime of `mode` with its snapshots under tmp_path. Under `run` the launcher passes
    its fan-out; tests that read the samples or the token check give it LocalActions."""
    config = load_config(env={}, snapshot_dir=str(tmp_path / "snaps"), **settings)
    actions = None
    if mode == "run":
        actions = LocalActions(SnapshotStore.for_config(config), config=config)
    return build_runtime(config, mode=mode, sources=sources, actions=actions)


def make_app(tmp_path, mode="demo", **settings):
    settings.setdefault("admin_token", TOKEN)
    sources = [ReplaySource()] if mode == "demo" else []
    runtime = runtime_of(tmp_path, mode, sources, **settings)
    runtime.sampler.tick()
    return create_app(runtime), runtime


@functools.cache
def demo_pid() -> str:
    """The pid of the process recorded in the packaged demo trace."""
    return ReplaySource().recorded_process()["pid"]


def only(response) -> dict:
    """The one process's result: every action answers a list, one entry outside `run`."""
    body = response.json()
    assert len(body["processes"]) == 1, body
    entry = body["processes"][0]
    # This process, or in the demo the recorded one it answers as (one pid everywhere).
    assert entry["process"]["pid"] in (str(os.getpid()), demo_pid())
    return entry["result"] if entry["ok"] else entry


CLI = [sys.executable, "-m", "exporter.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_cli(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None, umask: int = -1
) -> subprocess.CompletedProcess:
    """Run the CLI; `env` replaces the environment, `umask` is the user's (-1: inherited)."""
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, umask=umask
    )


@contextmanager
def running(
    *args: str, env: dict[str, str] | None = None, wait_for: str = "/readyz"
) -> Iterator[str]:
    """Start `gpumem-exporter ARGS --port P`, wait for `wait_for` to answer 200, yield the
    base URL."""
    port = free_port()
    proc = subprocess.Popen(
        [*CLI, *args, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url + wait_for, timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    said = proc.stdout.read() if proc.stdout else ""
                    raise AssertionError(f"exporter did not start: {said}") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            # uvicorn re-raises the SIGTERM it handled once it has shut down cleanly.
            assert proc.wait(timeout=15) in (0, -signal.SIGTERM)
        finally:
            proc.kill()
            close_pipes(proc)


def close_pipes(proc: subprocess.Popen[Any]) -> None:
    """Close the pipes a test read a process through, once it has ended: one left to the
    garbage collector is a ResourceWarning (an error under `-W error`)."""
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def thread_wakeups(thread: threading.Thread) -> int:
    """How many times a thread of this process has slept and woken (Linux's count)."""
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("voluntary_ctxt")).split()[1])


def kill_process(proc: subprocess.Popen[Any]) -> None:
    """Kill a process a test started, reap it and close its pipes (nothing left to the
    garbage collector: no zombie, no ResourceWarning)."""
    proc.kill()
    proc.wait()
    close_pipes(proc)


# -- deployment checks' tools -------------------------------------------------------------

JS_DIR = REPO_ROOT / "tests" / "js"
TSC = JS_DIR / "node_modules" / ".bin" / "tsc"


def _missing(message: str) -> NoReturn:
    if os.environ.get("GPUMEM_REQUIRE_TOOLS") == "1":
        pytest.fail(message + " (GPUMEM_REQUIRE_TOOLS=1)")
    pytest.skip(message, allow_module_level=True)


def require_module(name: str, pip_name: str) -> ModuleType:
    """Import a module, skipping (or failing in CI) when its PyPI package is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        _missing(f"{name} not importable: pip install {pip_name}")


def require_js_deps() -> str:
    """Return the path of node, skipping (or failing in CI) when tests/js is not installed."""
    node = require_tool("node")
    if not TSC.exists():
        _missing("tests/js dependencies missing: run `npm ci --prefix tests/js`")
    return node


def run_tsc(workdir: Path, sources: dict[str, str]) -> str:
    """Type-check generated TypeScript SOURCES (file name -> text) against tests/js's types.

    The files are written to WORKDIR next to links to tests/js/node_modules and tests/js/types,
    so they import "@grafana/schema" or "./types/dashboard.js" as if they lived in tests/js.
    Returns tsc's complaints, or "" when everything type-checks.
    """
    require_js_deps()
    (workdir / "node_modules").symlink_to(JS_DIR / "node_modules", target_is_directory=True)
    (workdir / "types").symlink_to(JS_DIR / "types", target_is_directory=True)
    for name, text in sources.items():
        (workdir / name).write_text(text)
    (workdir / "tsconfig.json").write_text(
        json.dumps(
            {
                "compilerOptions": {
                    "strict": True,
                    "noEmit": True,
                    "target": "es2022",
                    "module": "nodenext",
                    "moduleResolution": "nodenext",
                    "skipLibCheck": True,
                    "types": [],
                },
                "files": sorted(sources),
            }
        )
    )
    result = subprocess.run(
        [str(TSC), "--pretty", "false", "-p", str(workdir / "tsconfig.json")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode == 0:
        return ""
    return (result.stdout + result.stderr).strip() or f"tsc exited {result.returncode}"


def github_anchor(heading: str) -> str:
    """The id GitHub gives a Markdown heading (before de-duplication)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # drops punctuation, backticks included
    return text.replace(" ", "-")


def markdown_anchors(markdown: str) -> set[str]:
    """Anchors of all headings, skipping fenced code blocks; repeats get -1, -2, ..."""
    anchors: set[str] = set()
    seen: Counter[str] = Counter()
    in_fence = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if in_fence or not match:
            continue
        anchor = github_anchor(match.group(1))
        anchors.add(anchor if seen[anchor] == 0 else f"{anchor}-{seen[anchor]}")
        seen[anchor] += 1
    return anchors


def load_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included, rows themselves left out."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


# Series only the node daemon serves in a cluster (Kubernetes attribution through the kubelet).
# The demo replay has no kubelet, so queries on them have no data there: the end-to-end test
# with a stand-in kubelet (tests/e2e/test_e2e_kubernetes.py) checks that each of them has data.
ATTRIBUTION_SERIES = re.compile(
    r"\b(gpu_pod_info|gpu_process_pod_info|gpu_process_container_info"
    r"|gpu_memory_unattributed_bytes|gpu_process_memory_unattributed_bytes"
    r"|gpu_container_memory_used_bytes|namespace(_pod)?:gpu_memory_used_bytes:sum"
    r"|gpu_dra_claim_\w+)\b"
)


def needs_kubelet(expr: str) -> bool:
    return bool(ATTRIBUTION_SERIES.search(expr))


def names_detail_family(expr: str, mode: str, only: bool = False) -> bool:
    """Whether the query reads a family that `mode` serves only at GPUMEM_DETAIL=full
    (only: and that no other mode serves at the default level)."""
    from exporter import catalog

    def full_only(family: catalog.Family, has: frozenset[str]) -> bool:
        return family.served(has) and family.full_only_in(has)

    every = [m.traits.has for m in MODES.values()]
    names = {
        f.exposed
        for f in catalog.FAMILIES
        if full_only(f, MODES[mode].traits.has)
        and (not only or all(full_only(f, has) for has in every if f.served(has)))
    }
    return any(re.search(rf"\b{name}\b", expr) for name in names)


def iter_panel_queries(path: Path) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel of the dashboard at PATH.

    Template variables ($cluster, $__rate_interval, ...) are left as they are; substitute
    them before sending a query to Prometheus.
    """
    for panel in iter_panels(load_json(path)):
        for target in panel.get("targets", []):
            yield panel.get("title", ""), target.get("expr", "")


def iter_annotation_queries(path: Path) -> Iterator[tuple[str, str]]:
    """(annotation name, PromQL) for every Prometheus annotation of the dashboard."""
    for annotation in load_json(path)["annotations"]["list"]:
        if annotation.get("builtIn"):
            continue
        yield annotation["name"], annotation.get("target", {}).get("expr", "")


# -- a real Prometheus server -------------------------------------------------------------


def wait_http(
    url: str,
    proc: subprocess.Popen[str],
    timeout_s: float = 60,
    context: ssl.SSLContext | None = None,
) -> None:
    """Until `url` answers (https with `context`); fail with the process's output if it exits
    or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1, context=context):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read() if proc.stdout else ""
                raise AssertionError(f"{url} never answered: {out[-3000:]}") from None
            time.sleep(0.2)


# Prometheus 2 (Debian's `promtool` and `prometheus`, on PATH) and 3 (the paths in
# GPUMEM_PROMTOOL3 and GPUMEM_PROMETHEUS3: .ci/run unpacks Debian sid's packages there): 3.0
# changed what a range selects (the sample at its start is left out), which once made two rule
# tests and the alerts' last minute differ.
PROMTOOL3_ENV = "GPUMEM_PROMTOOL3"
PROMETHEUS3_ENV = "GPUMEM_PROMETHEUS3"


def _prometheus_tool(name: str, major: int, env_3: str) -> str:
    """Prometheus `major`'s `name` binary, checked to be that major version."""
    if major == 2:
        path = require_tool(name)
    else:
        found = os.environ.get(env_3)
        if not (found and os.access(found, os.X_OK)):
            _missing(f"{env_3} names no Prometheus 3 {name} (.ci/run unpacks one)")
        path = str(found)
    version = subprocess.run(
        [path, "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    said = re.search(r"version (\d+)\.", version.stdout + version.stderr)
    assert said and int(said.group(1)) == major, (path, version.stdout, version.stderr)
    return path


def promtool(major: int) -> str:
    return _prometheus_tool("promtool", major, PROMTOOL3_ENV)


def prometheus_server(major: int) -> str:
    return _prometheus_tool("prometheus", major, PROMETHEUS3_ENV)


def start_prometheus(binary: str, folder: Path, port: int) -> subprocess.Popen[str]:
    """Prometheus on 127.0.0.1:`port` with `folder`/prometheus.yml, its data in `folder`."""
    return subprocess.Popen(
        [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=folder,
    )


def prometheus_api(prometheus_url: str, path: str, **params: str) -> Any:
    """GET /api/v1/`path`: its `data`, after checking the answer says success."""
    url = f"{prometheus_url}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def stop_processes(procs: Sequence[subprocess.Popen[str]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        close_pipes(proc)


def short_rules(tmp: Path) -> list[str]:
    files = []
    for source in sorted((REPO_ROOT / "deploy" / "prometheus").glob("*.yaml")):
        rules = yaml.safe_load(source.read_text())
        for group in rules["groups"]:
            group["interval"] = "1s"
            for rule in group["rules"]:
                if "for" in rule:
                    rule["for"] = "3s"
        target = tmp / source.name
        target.write_text(yaml.safe_dump(rules, sort_keys=False))
        files.append(str(target))
    return files


# -- every family the catalog declares, over real readings ----------------------------------

WORKER = {"pid": "100", "rank": "0", "local_rank": "0", "role": "worker"}


# client_python's own collectors, registered beside ours: not the exporter's families.
CLIENT_PYTHON = re.compile(r"^(process_(?!resident_memory_peak)|python_)")


def catalog_collector(
    sample: Sample, mode: str, const: dict[str, str], per_process: bool, detail: str = "full"
) -> SampleCollector:
    """The collector of `mode` over `sample`, with sources, action counts, a firing alert and
    an allocator settings change (the families that need them)."""
    state = ExporterState(
        sample,
        {
            "torch": SourceStatus(True, 0.01, 1),
            "nvml": SourceStatus(False, 0.2, 3, unavailable="NVML library not found"),
        },
    )
    process = WORKER if per_process else {}
    # Under `run` or a helper: records the process's probe dropped and helpers it started
    # again (each served once there are some).
    dropped = 3 if per_process else 0
    counts = ActionCounts(
        {"manual": 2},
        4096,
        {"empty_cache/ok": 1},
        records_dropped=dropped,
        helper_restarts=1 if per_process else 0,
        # A component entered while open (not measured twice): served once one happened.
        component_problems={"reentered": 1},
    )
    # An endpoint with a web config and a certificate: every gpumem_exporter_web* family.
    endpoint = EndpointState(
        tls=True,
        client_auth="RequireAndVerifyClientCert",
        basic_auth=True,
        configured=True,
        reload_ok_at=1.7e9,
        certificate_not_after=1.8e9,
    )
    # Under `run` each process's last report to the launcher.
    last_report = 1.7e9 if per_process else None
    stats = ActionStats([ProcessCounts(process, counts, last_report)], endpoint)
    requests = RequestCounts()
    requests.add("snapshot", "ok")
    changed = SimpleNamespace(changes=1, last={"expandable_segments": ("true", "false")})
    failures = RenderFailures()  # one answer that failed to render: served once one has
    failures.count = 1
    alerts = SimpleNamespace(
        evaluations=1,
        firing_subjects=lambda: [
            ("GpuMemOutOfMemory", {"device": "0", "gpu_uuid": "GPU-x", **process})
        ],
        settings_changes=lambda: [({"device": "0", "gpu_uuid": "GPU-x", **process}, changed)],
    )
    return SampleCollector(
        lambda: state,
        const_labels=const,
        version="0",
        traits=MODES[mode].traits,
        alerts=alerts,
        actions=lambda: stats,
        admin_requests=requests,
        render_failures=failures,
        detail=detail,
    )


def run_shaped(sample: Sample) -> Sample:
    """One endpoint for a server's processes: every reading names its process."""
    sample = copy.deepcopy(sample)
    readings: list[Any] = [*sample.allocators, *sample.pinned_host]
    for reading in readings:
        reading.process = dict(WORKER)
    sample.rejected_messages = {"bad_json": 1}
    sample.over_budget = {"per_process": 0, "per_endpoint": 0, "host_processes": 0}
    sample.host_processes.append(HostProcessReading(100, "worker", "0", 1 << 30, 1 << 31, 0))
    return sample


def node_shaped(sample: Sample) -> Sample:
    """The node daemon: NVML, the kubelet's devices (one by the device plugin, a share of
    the same GPU by a ResourceClaim), the processes' cgroups, and the claims' allocations."""
    sample = copy.deepcopy(sample)
    sample.allocators, sample.pinned_host = [], []
    gpu = sample.gpus[0]
    gpu.minor_number = 0
    sample.processes = [
        ProcessGpuReading(gpu.index, gpu.uuid, 4242, 1 << 30),
        ProcessGpuReading(gpu.index, gpu.uuid, 4343, 1 << 20),
    ]
    sample.kubelet = KubeletReading(
        "/var/lib/kubelet/pod-resources/kubelet.sock",
        up=False,
        error="deadline exceeded",
        last_success_s=1.0,
        asked_s=1.0,
        refresh_errors=1,
        devices=[
            PodDevice("ml", "llama-0", "server", "nvidia.com/gpu", gpu.uuid),
            # A share of the GPU a ResourceClaim gave (DRA): NVIDIA's driver names it by
            # its minor.
            PodDevice(
                "ml",
                "notebook-1",
                "jupyter",
                "gpu.nvidia.com",
                "gpu-0",
                claim="notebook-gpu",
                claim_namespace="ml",
                pool="gpu-node-1",
                share_id="s1",
            ),
        ],
        pods={"uid-1": ("ml", "llama-0")},
        containers={"cid-1": "server"},
        pods_api=True,
        pods_error="403 Forbidden",
        claims={
            ("ml", "notebook-gpu"): [
                ClaimedDevice("gpu.nvidia.com", "gpu-node-1", "gpu-0", "s1", 8 << 30)
            ]
        },
        claims_api=True,
        logs_folder="/var/log/containers",
        logs_error="/var/log/containers: Permission denied",
    )
    sample.process_containers = [
        ProcessContainerReading(4242, "container", "uid-1", "cid-1"),
        ProcessContainerReading(4343, "no_container"),
    ]
    return sample


def mig_node_sample(
    machine: str = "h200-mig", state: str = "load", in_slice: int | None = None
) -> Sample:
    """What the node daemon's NVML source reads on a MIG machine, from the real captures
    (tests/support/mig_nvml.py); `in_slice`: inside a container given that MIG device."""
    from exporter.sources.nvml import NvmlSource
    from tests.support.mig_nvml import CapturedNvml

    reading = NvmlSource(CapturedNvml(machine, state, in_slice=in_slice)).read()
    return Sample(timestamp=1.0, **reading.parts())


def mig_node_shaped(machine: str = "h100-mig") -> Sample:
    """The node daemon on a MIG machine under load (the real capture): the kubelet assigned
    MIG devices 0 and 1 to two pods by the device plugin's IDs (MIG-<uuid>; device 1 in the
    form before driver R470), and the processes of the first run in its pod."""
    sample = mig_node_sample(machine, "load")
    gpu = sample.gpus[0]
    first, second = (i for i in sample.mig_instances[:2])
    old_form = f"MIG-{gpu.uuid}/{second.gpu_instance_id}/0"
    sample.kubelet = KubeletReading(
        "/var/lib/kubelet/pod-resources/kubelet.sock",
        up=True,
        asked_s=1.0,
        devices=[
            PodDevice("ml", "llama-0", "server", "nvidia.com/mig-3g.40gb", first.mig_uuids[0]),
            PodDevice("ml", "embed-0", "server", "nvidia.com/mig-2g.20gb", old_form),
        ],
        pods={"uid-1": ("ml", "llama-0")},
        containers={"cid-1": "server"},
        pods_api=True,
        logs_folder="/var/log/containers",
    )
    sample.process_containers = [
        ProcessContainerReading(p.pid, "container", "uid-1", "cid-1") for p in sample.processes
    ]
    return sample


def every_family_cases() -> list[tuple[str, bool, dict[str, str], Sample]]:
    """(mode, per_process, constant labels, sample) that together serve every family the
    catalog declares: three allocator backends captured on a GPU (and named components on
    the native one), the demo trace (layout,
    private pools, pinned host) and the storm trace (layout skipped), each as its modes
    would serve it, and the node daemon's attribution."""
    _, demo = read_trace(demo_trace_path())
    _, storm = read_trace(DATA_DIR / "h200_oom_storm_trace.jsonl.gz")
    samples = [captured_sample(n) for n in ("native", "expandable", "async", "components")]
    samples += demo[::40] + storm[::10] + captured_oom_samples()
    derive_recorded_pool_kinds(samples)  # as the replay does
    found: list[tuple[str, bool, dict[str, str], Sample]] = []
    for sample in samples:
        found.append(("embedded", False, {"rank": "0"}, sample))
        found.append(("demo", False, {}, sample))
        found.append(("run", True, {}, run_shaped(sample)))
    found.append(("node", False, {}, node_shaped(demo[0])))
    found.append(("node", False, {}, mig_node_sample()))
    found.append(("node", False, {}, mig_node_sample("h100-mig", in_slice=1)))
    found.append(("node", False, {}, mig_node_shaped()))
    refused = node_shaped(demo[0])  # the claim reader without RBAC
    assert refused.kubelet is not None
    refused.kubelet.claims, refused.kubelet.claims_error = None, "HTTP 403 Forbidden"
    found.append(("node", False, {}, refused))
    return found


# -- a node daemon under a real Prometheus (the attribution end-to-end tests) ----------------


def write_prometheus_config(
    tmp: Path, job: str, port: int, labels: dict[str, str], *, honor_labels: bool = False
) -> None:
    """tmp/prometheus.yml: one job scraping 127.0.0.1:port every second with these target
    labels, the shipped rules (every second, `for:` shortened) evaluated every second."""
    scrape: dict[str, Any] = {
        "job_name": job,
        "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": labels}],
    }
    if honor_labels:
        scrape["honor_labels"] = True
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": short_rules(tmp),
        "scrape_configs": [scrape],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))


# What Prometheus adds to every series of the daemon's target, as service discovery would.
DAEMON_TARGET = {"cluster": "e2e", "namespace": "monitoring", "pod": "gpumem-node-x"}


@dataclasses.dataclass
class Cluster:
    prometheus: str
    state: Path
    api: Any  # the stand-in Kubernetes API, where the test runs one

    def query(self, expr: str) -> list[dict]:
        result: list[dict] = prometheus_api(self.prometheus, "query", query=expr)["result"]
        return result

    def wait(self, expr: str, timeout_s: float = 60) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.5)


@contextlib.contextmanager
def daemon_under_prometheus(tmp: Path, sources: list) -> Iterator[str]:
    """A node daemon over `sources` (the real runtime and HTTP server, in this process) and a
    real Prometheus scraping it as the chart's ServiceMonitor does, evaluating the shipped
    rules every second: the Prometheus URL."""
    prometheus = require_tool("prometheus")
    runtime = build_runtime(load_config(env={}, interval_s=0.5), mode="node", sources=sources)
    exporter_port, prometheus_port = free_port(), free_port()
    http = HttpServer(create_app(runtime), "127.0.0.1", exporter_port)
    runtime.sampler.start()
    http.start()
    # honor_labels: as the chart's ServiceMonitor (honorLabels: true)
    write_prometheus_config(tmp, "gpumem-node", exporter_port, DAEMON_TARGET, honor_labels=True)
    server = start_prometheus(prometheus, tmp, prometheus_port)
    try:
        wait_http(f"http://127.0.0.1:{prometheus_port}/-/ready", server)
        yield f"http://127.0.0.1:{prometheus_port}"
    finally:
        stop_processes((server,))
        http.stop()
        runtime.sampler.stop()


def values(result: list[dict], label: str) -> dict[str, float]:
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in result}


def slow_reader(address: tuple[str, int], requests: int) -> socket.socket:
    """Pipelines `requests` requests for a 51 KB static file (the vendored uPlot, which does not
    change with the page) and never reads an answer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address)
    sock.sendall(
        b"GET /static/uplot/uPlot.iife.min.js HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * requests
    )
    return sock


def wait_until_stalled(server: HttpServer, count: int) -> None:
    """Until `count` connections have answers the client does not read (the guard's view)."""
    deadline = time.monotonic() + 30
    connections = server.connections.open

    def stalled() -> int:
        while True:
            try:  # the server's thread changes the set meanwhile
                return sum(getattr(c, "stalled", False) for c in list(connections))
            except RuntimeError:
                continue

    while stalled() < count:
        assert time.monotonic() < deadline, "the slow readers' answers never stalled"
        time.sleep(0.1)
