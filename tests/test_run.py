"""`gpumem-exporter run`: injection, one endpoint for a real multi-process program, exits
cleaned up, admin fan-out, signal and exit-status pass-through.

The workers import tests/fake_torch (a test double serving an allocator dict captured on an
H200) instead of torch, since this machine has no GPU; everything else is real: processes
spawned and forked by multiprocessing, sitecustomize injection, Unix sockets, HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO_ROOT
from tests.test_cli import free_port

FAKE_TORCH = REPO_ROOT / "tests" / "fake_torch"
TOKEN = "run-token"


def scrape(url: str) -> list:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def allocated_by_role(url: str) -> dict[str, dict]:
    return {
        s.labels["role"]: s.labels for s in scrape(url) if s.name == "torch_cuda_allocated_bytes"
    }


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@contextmanager
def launched(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    control = tmp_path / "control"
    control.mkdir()
    port = free_port()
    env = dict(
        os.environ,
        PYTHONPATH=str(FAKE_TORCH),
        GPUMEM_ADMIN_TOKEN=TOKEN,
        GPUMEM_SNAPSHOT_DIR=str(tmp_path / "snaps"),
        GPUMEM_NVML="off",
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exporter.cli",
            "run",
            "--port",
            str(port),
            "--interval-s",
            "0.2",
            "--",
            sys.executable,
            str(REPO_ROOT / "tests" / "mp_server.py"),
            str(control),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield f"http://127.0.0.1:{port}", proc, control
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_every_process_under_one_endpoint_exits_cleaned_up_and_fan_out(tmp_path):
    with launched(tmp_path) as (url, proc, control):
        roles = wait_for(
            lambda: (
                _roles(url) >= {"worker0", "worker1", "forked", "embedded"}
                and allocated_by_role(url)
            ),
            what="all four workers",
        )
        pids = {labels["pid"] for labels in roles.values()}
        assert len(pids) == 4  # one series per process, told apart by pid
        assert roles["worker1"]["rank"] == "1" and roles["worker1"]["local_rank"] == "1"
        assert roles["worker1"]["device"] == "1" and roles["worker0"]["device"] == "0"
        # exporter.start() in a worker under `run` opened no port of its own.
        embedded = control / "embedded-url"
        wait_for(embedded.exists, what="the embedded worker's exporter.start()")
        assert embedded.read_text() == "None"
        # The API process never "initialized CUDA": no series for it.
        api_pid = str(proc.pid)
        assert all(labels["pid"] != api_pid for labels in roles.values())

        # Counters stay monotonic per process.
        def retries() -> dict[str, float]:
            return {
                s.labels["pid"]: s.value
                for s in scrape(url)
                if s.name == "torch_cuda_alloc_retries_total"
            }

        first = retries()
        time.sleep(0.6)
        second = retries()
        assert all(second[pid] >= first[pid] for pid in first)

        # Fan-out: one snapshot per process, or only the chosen rank.
        result = post(url + "/snapshot", {})
        assert result["ok"] and len(result["processes"]) == 4
        ids = {r["result"]["id"] for r in result["processes"]}
        listed = json.loads(
            urllib.request.urlopen(
                urllib.request.Request(
                    url + "/snapshots", headers={"Authorization": f"Bearer {TOKEN}"}
                )
            ).read()
        )
        assert ids <= {s["id"] for s in listed["snapshots"]}
        only = post(url + "/snapshot", {"rank": 1})
        assert [r["process"]["rank"] for r in only["processes"]] == ["1"]
        cleared = post(url + "/empty-cache", {"pid": int(roles["forked"]["pid"])})
        assert [r["process"]["role"] for r in cleared["processes"]] == ["forked"]
        assert cleared["processes"][0]["ok"]

        # A worker that exits takes its series with it: no stale gauges.
        (control / "stop-worker0").touch()
        wait_for(lambda: "worker0" not in _roles(url), what="worker0's series to go")
        assert {"worker1", "forked", "embedded"} <= _roles(url)

        # SIGTERM reaches the server once; its exit status comes back.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 3
    assert "Traceback" not in (proc.stdout.read() if proc.stdout else "")


def _roles(url: str) -> set[str]:
    try:
        return set(allocated_by_role(url))
    except OSError:
        return set()


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "exporter.cli", "run", "--port", str(free_port()), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GPUMEM_NVML": "off", **(env or {})},
    )


@pytest.mark.parametrize(
    ("command", "status"),
    [
        ([sys.executable, "-c", "import sys; sys.exit(7)"], 7),
        (["sh", "-c", "exit 4"], 4),
        (["sh", "-c", "kill -TERM $$"], 128 + signal.SIGTERM),
        (["/nonexistent/server"], 127),
    ],
)
def test_exit_status_passes_through(command, status):
    assert run_cli("--", *command).returncode == status


def test_a_command_is_required():
    proc = run_cli()
    assert proc.returncode == 2 and "no command to run" in proc.stderr


def test_children_get_the_agent_and_keep_their_own_sitecustomize(tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITECUSTOMIZE'] = 'ran'\n")
    probe = (
        "import os, sys, exporter.agent as a; "
        "print(os.environ.get('OWN_SITECUSTOMIZE'), a._agent is not None, "
        "'fastapi' in sys.modules, 'torch' in sys.modules)"
    )
    proc = run_cli("--", sys.executable, "-c", probe, env={"PYTHONPATH": str(own)})
    assert proc.returncode == 0, proc.stderr
    # Our agent started, the user's sitecustomize still ran, and start-up stayed light.
    assert proc.stdout.split() == ["ran", "True", "False", "False"]


def test_the_agent_is_off_outside_run():
    probe = "import sys; print('sitecustomize' in sys.modules and 'exporter.agent' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False"


def test_port_per_local_rank_without_run(tmp_path):
    code = (
        "import exporter; h = exporter.start(port=PORT, port_per_local_rank=True); "
        "print(h.url); h.stop()"
    )
    base = free_port()
    proc = subprocess.run(
        [sys.executable, "-c", code.replace("PORT", str(base - 2))],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LOCAL_RANK": "2", "GPUMEM_NVML": "off"},
    )
    assert proc.stdout.strip() == f"http://127.0.0.1:{base}"
