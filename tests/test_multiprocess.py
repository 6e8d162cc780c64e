"""attach() under prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR): the series
reach the app's MultiProcessCollector, kept apart per process, and leave with their process.

The files are read back by prometheus_client's own MultiProcessCollector, never by a parser of
ours; the last test runs a real two-worker uvicorn server that mounts /metrics as vLLM does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

import exporter
from exporter.config import load_config
from exporter.multiprocess import MultiprocessBridge, multiprocess_dir, render
from exporter.runtime import build_runtime
from exporter.sources.replay import ReplaySource, demo_trace_path
from exporter.trace import read_trace
from tests.conftest import REPO_ROOT, require_tool
from tests.helpers import free_port, stop_processes

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def exposition(directory: Path) -> str:
    """What the app's /metrics serves: a fresh registry with a MultiProcessCollector."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(directory))
    return generate_latest(registry).decode()


def series(text: str) -> Series:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def types(text: str) -> dict[str, str]:
    """Type by family, of the families that have samples (a family with none has no place in
    prometheus_client's files: its HELP and TYPE lines are all that is lost)."""
    return {f.name: f.type for f in text_string_to_metric_families(text) if f.samples}


def pids_of(values: Series, name: str) -> set[str]:
    return {dict(labels).get("pid", "") for n, labels in values if n == name}


def write(directory: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (directory / name).write_bytes(data)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def demo_runtime():
    return build_runtime(
        load_config(env={}, detail="full"),  # every family the demo's sample has
        mode="embedded",
        sources=[ReplaySource(None)],
        registry=CollectorRegistry(),
    )


def test_every_family_reaches_the_multiprocess_collector_as_served_directly(tmp_path):
    """The bridge renders SampleCollector's own output: each family it serves (47 for the
    demo's sample) comes out of MultiProcessCollector with its type, labels and value, plus
    the `pid` of the process the series is about. promtool accepts the result."""
    runtime = demo_runtime()
    runtime.sampler.tick()
    MultiprocessBridge(runtime.collector.collect, tmp_path, interval_s=1).publish()
    direct = generate_latest(runtime.registry).decode()
    bridged = exposition(tmp_path)
    me = str(os.getpid())
    expected = {}
    for (name, labels), value in series(direct).items():
        own = dict(labels)
        own["pid"] = own.get("pid") or me  # its own process where it names one, else ours
        expected[(name, tuple(sorted(own.items())))] = value
    assert series(bridged) == expected
    assert types(bridged) == types(direct)
    assert len(types(direct)) >= 40
    assert types(bridged)["gpumem_exporter_source_errors"] == "counter"
    assert types(bridged)["gpumem_exporter_build_info"] == "gauge"
    # A series about the recording's process keeps naming that process, not the bridge's.
    recorded = next(s.self_pid for s in read_trace(demo_trace_path())[1] if s.self_pid)
    assert pids_of(series(bridged), "gpu_process_memory_used_bytes") == {str(recorded)}
    promtool = require_tool("promtool")
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=bridged, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout + proc.stderr == "", proc.stdout + proc.stderr


def families(used: float, errors: float, gpus: tuple[str, ...] = ("0",)) -> list:
    """One process's families: a gauge about itself, a counter, and NVML's node-wide list of
    processes on a GPU, which names process 4242 in a `pid` label of its own."""
    reserved = GaugeMetricFamily("torch_cuda_reserved_bytes", "Reserved.", labels=["device"])
    for gpu in gpus:
        reserved.add_metric([gpu], used)
    failures = CounterMetricFamily("gpumem_exporter_source_errors", "Errors.", labels=["source"])
    failures.add_metric(["nvml"], errors)
    on_gpu = GaugeMetricFamily("gpu_process_memory_used_bytes", "NVML.", labels=["gpu", "pid"])
    on_gpu.add_metric(["0", "4242"], 1000.0)
    return [reserved, failures, on_gpu]


def test_processes_are_kept_apart_never_summed(tmp_path):
    write(tmp_path, render(families(used=5.0, errors=2.0), pid=111)[0])
    write(tmp_path, render(families(used=7.0, errors=3.0), pid=222)[0])
    values = series(exposition(tmp_path))
    reserved = [
        ("torch_cuda_reserved_bytes", (("device", "0"), ("pid", p))) for p in ("111", "222")
    ]
    assert [values[k] for k in reserved] == [5.0, 7.0]  # not 12 (livesum), not one (max)
    errors = [
        ("gpumem_exporter_source_errors_total", (("pid", p), ("source", "nvml")))
        for p in ("111", "222")
    ]
    assert [values[k] for k in errors] == [2.0, 3.0]  # counters summed only within a process
    # Both processes read the same NVML list: one series, naming the process it is about.
    assert pids_of(values, "gpu_process_memory_used_bytes") == {"4242"}
    assert values[("gpu_process_memory_used_bytes", (("gpu", "0"), ("pid", "4242")))] == 1000.0


def test_a_series_gone_from_the_sample_is_gone_from_the_next_scrape(tmp_path):
    current = families(used=5.0, errors=1.0, gpus=("0", "1"))
    bridge = MultiprocessBridge(lambda: current, tmp_path, interval_s=1)
    bridge.publish()
    assert ("torch_cuda_reserved_bytes", (("device", "1"), ("pid", str(os.getpid())))) in series(
        exposition(tmp_path)
    )
    current = families(used=5.0, errors=1.0, gpus=("0",))[:2]  # GPU 1 and process 4242 gone
    bridge.publish()
    values = series(exposition(tmp_path))
    assert {dict(k[1])["device"] for k in values if k[0] == "torch_cuda_reserved_bytes"} == {"0"}
    assert "gpu_process_memory_used_bytes" not in {name for name, _ in values}
    assert not list(tmp_path.glob("gauge_liveall_4242.db_*"))


def host_files(directory: Path) -> dict[str, bytes]:
    """The host app's own files, written by prometheus_client in a process that has exited."""
    code = (
        "from prometheus_client import Counter, Gauge\n"
        "Counter('app_requests', 'Requests.').inc(4)\n"
        "Gauge('app_busy', 'Busy.', multiprocess_mode='liveall').set(1)\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_the_series_of_a_dead_process_go_and_the_hosts_files_stay(tmp_path):
    host = host_files(tmp_path)
    assert {n.split("_")[0] for n in host} == {"counter", "gauge"}
    gone = dead_pid()
    write(tmp_path, render(families(used=5.0, errors=1.0), pid=gone)[0])
    assert str(gone) in pids_of(series(exposition(tmp_path)), "torch_cuda_reserved_bytes")
    MultiprocessBridge(lambda: families(used=6.0, errors=0.0), tmp_path, interval_s=1).publish()
    values = series(exposition(tmp_path))
    assert pids_of(values, "torch_cuda_reserved_bytes") == {str(os.getpid())}
    assert pids_of(values, "gpumem_exporter_source_errors_total") == {str(os.getpid())}
    assert values[("app_requests_total", ())] == 4.0  # the host's own series are untouched
    assert {name: (tmp_path / name).read_bytes() for name in host} == host
    # Its gauge file is deleted; its counter file emptied, since MultiProcessCollector fails a
    # scrape that globbed a counter file that then vanished.
    assert not list(tmp_path.glob(f"gauge_liveall_*_gpumem-exporter-{gone}.db"))
    assert (tmp_path / f"counter_gpumem-exporter-{gone}.db").stat().st_size == 8


def test_files_nobody_rewrites_are_retired_even_if_their_pid_lives(tmp_path):
    alive = os.getppid()  # a live process that is not a bridge: a reused PID
    write(tmp_path, render(families(used=5.0, errors=1.0), pid=alive)[0])
    bridge = MultiprocessBridge(lambda: [], tmp_path, interval_s=1)
    bridge.publish()
    assert str(alive) in pids_of(series(exposition(tmp_path)), "torch_cuda_reserved_bytes")
    old = time.time() - 61
    for path in tmp_path.glob(f"*gpumem-exporter-{alive}.db"):
        os.utime(path, (old, old))
    bridge.publish()
    assert str(alive) not in pids_of(series(exposition(tmp_path)), "torch_cuda_reserved_bytes")


def test_unchanged_files_are_refreshed_only_now_and_then(tmp_path):
    now = [0.0]
    bridge = MultiprocessBridge(
        lambda: families(used=5.0, errors=1.0), tmp_path, interval_s=1, clock=lambda: now[0]
    )
    counter = tmp_path / f"counter_gpumem-exporter-{os.getpid()}.db"
    bridge.publish()
    first = counter.stat().st_ino
    now[0] = 19.0
    bridge.publish()
    assert counter.stat().st_ino == first  # same content: not rewritten
    now[0] = 21.0  # a third of the 60 s after which other bridges retire it
    bridge.publish()
    assert counter.stat().st_ino != first


def test_close_takes_the_series_out_but_not_from_a_forked_child(tmp_path):
    bridge = MultiprocessBridge(lambda: families(used=5.0, errors=1.0), tmp_path, interval_s=1)
    bridge.publish()
    child = os.fork()
    if child == 0:  # a fork of the host (a DataLoader worker, say) exits: not our series
        bridge.close()
        os._exit(0)
    os.waitpid(child, 0)
    assert str(os.getpid()) in pids_of(series(exposition(tmp_path)), "torch_cuda_reserved_bytes")
    bridge.close()
    values = series(exposition(tmp_path))
    assert not {name for name, _ in values}
    bridge.publish()  # a tick racing with the stop writes nothing
    assert not series(exposition(tmp_path))


@pytest.fixture
def stopped() -> Iterator[None]:
    yield
    exporter.stop()


def test_attach_publishes_to_the_folder_and_stop_takes_it_back(tmp_path, monkeypatch, stopped):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    handle = exporter.attach(FastAPI(), registry=CollectorRegistry(), interval_s=60, torch=False)
    assert handle.bridge is not None and handle.bridge.directory == tmp_path
    handle.sampler.tick()
    values = series(exposition(tmp_path))
    assert pids_of(values, "gpumem_exporter_build_info") == {str(os.getpid())}
    assert ("host_memory_available_bytes", (("pid", str(os.getpid())),)) in values
    handle.stop()
    assert not series(exposition(tmp_path))


def test_an_unusable_folder_never_raises_into_the_host(tmp_path, monkeypatch, stopped, caplog):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing"))
    handle = exporter.attach(FastAPI(), registry=CollectorRegistry(), interval_s=60, torch=False)
    handle.sampler.tick()  # the write fails inside the sampler's listener isolation
    assert "MultiprocessBridge failed" in caplog.text
    handle.stop()


def test_the_folder_is_found_as_prometheus_client_finds_it():
    assert multiprocess_dir({}) is None
    assert multiprocess_dir({"PROMETHEUS_MULTIPROC_DIR": ""}) is None
    assert multiprocess_dir({"PROMETHEUS_MULTIPROC_DIR": "/a"}) == Path("/a")
    assert multiprocess_dir({"prometheus_multiproc_dir": "/b"}) == Path("/b")  # deprecated


# -- a real multi-process server --------------------------------------------------------------


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def wait_for(check: Callable[[], object], what: str, timeout_s: float = 60) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
        except OSError:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
def test_a_two_worker_server_shows_every_workers_series_and_drops_a_dead_ones(tmp_path):
    promtool = require_tool("promtool")
    folder = tmp_path / "prometheus"
    folder.mkdir()
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_")},
        "PROMETHEUS_MULTIPROC_DIR": str(folder),
        "GPUMEM_INTERVAL_S": "0.2",
        "GPUMEM_LABELS": "model=tiny",
    }
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "uvicorn", "tests.support.mp_attach_app:app", "--workers", "2"),
            *("--port", str(port), "--log-level", "warning"),
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}/metrics"
    try:

        def workers() -> set[str]:
            pids = pids_of(series(scrape(url)), "gpumem_exporter_build_info")
            return pids if len(pids) == 2 else set()

        pids = wait_for(workers, "both workers' series")
        assert isinstance(pids, set)
        for pid in pids:  # the label names the worker that reports
            assert psutil.Process(int(pid)).ppid() == server.pid
        scrape(f"http://127.0.0.1:{port}/ping")
        text = scrape(url)
        values = series(text)
        for pid in pids:
            assert (
                "gpumem_exporter_build_info",
                (("mode", "embedded"), ("model", "tiny"), ("pid", pid), ("version", "0.1.0")),
            ) in values
            assert ("host_memory_available_bytes", (("model", "tiny"), ("pid", pid))) in values
            for source in ("torch", "nvml", "host"):
                labels = (("model", "tiny"), ("pid", pid), ("source", source))
                assert ("gpumem_exporter_source_up", labels) in values
                assert ("gpumem_exporter_source_errors_total", labels) in values
        assert values[("app_pings_total", ())] == 1.0  # the app's own series, as before
        assert types(text)["gpumem_exporter_source_errors"] == "counter"
        proc = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0 and proc.stdout + proc.stderr == "", proc.stdout + proc.stderr

        later = series(scrape(url))
        for key, value in values.items():  # counters only rise
            if key[0].endswith("_total") and key in later:
                assert later[key] >= value, key

        killed, survivor = sorted(pids)
        os.kill(int(killed), signal.SIGKILL)  # no atexit: the survivor's sweep removes it
        replaced = wait_for(
            lambda: (p := workers()) and killed not in p and survivor in p and p,
            "the killed worker's series to go and its replacement's to come",
        )
        assert isinstance(replaced, set)
        assert killed not in pids_of(series(scrape(url)), "gpumem_exporter_source_up")
        assert not list(folder.glob(f"gauge_*_gpumem-exporter-{killed}.db"))
        # uvicorn ends a worker's graceful SIGTERM shutdown by re-raising the signal, so no
        # atexit runs there either: the other worker's sweep removes its series.
        os.kill(int(survivor), signal.SIGTERM)
        wait_for(
            lambda: (p := workers()) and survivor not in p,
            "the stopped worker's series to go",
        )
    finally:
        stop_processes([server])


@pytest.mark.slow
def test_a_process_that_exits_takes_its_series_along(tmp_path):
    code = (
        "import fastapi, exporter\n"
        "h = exporter.attach(fastapi.FastAPI(), interval_s=60, torch=False)\n"
        "h.sampler.tick()\n"
        "import os, sys; print(os.getpid(), sorted(os.listdir(sys.argv[1])))\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    pid = proc.stdout.split()[0]
    assert f"gauge_liveall_{pid}.db_gpumem-exporter-{pid}.db" in proc.stdout  # it published
    assert not series(exposition(tmp_path))  # and took it back at exit
    assert [p.name for p in tmp_path.iterdir()] == [f"counter_gpumem-exporter-{pid}.db"]
