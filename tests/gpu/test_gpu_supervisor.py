"""`gpumem-exporter run` stopping a real multi-process inference server on a GPU: LitServe with
2 workers on one GPU. SIGTERM to the launcher: every worker is gone, and NVML lists none of
them, within the grace period.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_supervisor.py` (needs litserve).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO_ROOT, repo_env
from tests.helpers import free_port

torch = pytest.importorskip("torch")
pytest.importorskip("litserve")
pynvml = pytest.importorskip("pynvml")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GRACE_S = 10.0


def nvml_pids() -> set[int]:
    pynvml.nvmlInit()
    try:
        pids = set()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            pids |= {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        return pids
    finally:
        pynvml.nvmlShutdown()


def test_sigterm_to_the_launcher_stops_every_litserve_worker(tmp_path):
    port, app_port = free_port(), free_port()
    env = repo_env()
    log = (tmp_path / "launcher.log").open("w")
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exporter.cli",
            "run",
            "--port",
            str(port),
            "--stop-grace-s",
            str(GRACE_S),
            "--",
            sys.executable,
            str(REPO_ROOT / "tests" / "support" / "litserve_app.py"),
            str(app_port),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 180
        workers: set[int] = set()
        roles: dict[str, str] = {}  # pid (or role/rank) -> role of each process reporting one
        while time.monotonic() < deadline:
            tree = {p.pid for p in psutil.Process(launcher.pid).children(recursive=True)}
            workers = nvml_pids() & tree
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    text = r.read().decode()
                series = re.findall(r"torch_cuda_allocated_bytes\{([^}]*)\}", text)
                labels = [dict(re.findall(r'(\w+)="([^"]*)"', s)) for s in series]
                # A process whose rank and role are its own goes without a pid label.
                roles = {x["pid"] or f"{x['role']}/{x['rank']}": x["role"] for x in labels}
            except OSError:
                pass
            if len(workers) >= 2 and len(roles) >= 2:
                break
            time.sleep(0.5)
        assert len(workers) >= 2, f"workers on the GPU: {workers}"
        tree = {p.pid for p in psutil.Process(launcher.pid).children(recursive=True)}
        started = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        status = launcher.wait(timeout=GRACE_S + 20)
        exited_s = time.monotonic() - started
        while nvml_pids() & workers and time.monotonic() - started < GRACE_S:
            time.sleep(0.1)
        gone_s = time.monotonic() - started
        left = [p for p in tree if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        on_gpu = nvml_pids() & tree
    finally:
        if launcher.poll() is None:
            launcher.kill()
        log.close()
    report = {
        "workers_on_gpu": sorted(workers),
        "roles": roles,
        "tree": len(tree),
        "status": status,
        "launcher_exited_s": round(exited_s, 2),
        "gpu_released_s": round(gone_s, 2),
        "left": left,
        "on_gpu_after": sorted(on_gpu),
        "log_tail": (tmp_path / "launcher.log").read_text()[-3000:],
    }
    out = Path(os.environ.get("OUT", tmp_path))
    (out / "gpu_supervisor.json").write_text(json.dumps(report, indent=1))
    assert left == [] and on_gpu == set(), report
    # LitServe names its workers (multiprocessing): the role says so, not "python3".
    assert roles and "python3" not in roles.values(), report
    assert gone_s < GRACE_S, report
    assert status in (0, 143, 130, 1), report
