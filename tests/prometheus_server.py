"""A real Prometheus server for end-to-end tests (test_e2e_prometheus, test_dashboards):
start it, wait until it (or the exporter it scrapes) answers, query its HTTP API, stop."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO_ROOT


def wait_http(url: str, proc: subprocess.Popen[str], timeout_s: float = 60) -> None:
    """Until `url` answers; fail with the process's output if it exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read() if proc.stdout else ""
                raise AssertionError(f"{url} never answered: {out[-3000:]}") from None
            time.sleep(0.2)


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


def api(prometheus_url: str, path: str, **params: str) -> Any:
    """GET /api/v1/`path`: its `data`, after checking the answer says success."""
    url = f"{prometheus_url}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def stop(procs: Sequence[subprocess.Popen[str]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


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
