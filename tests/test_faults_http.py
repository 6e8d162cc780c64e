"""Faults and abuse around the HTTP layer: long captures, token files, clients that vanish or
dawdle. Each test reproduces a reported failure and shows it fixed (docs/reliability.md)."""

from __future__ import annotations

import json
import pickle
import time
import urllib.request

from fastapi.testclient import TestClient

from tests.test_admin import AUTH, make_app, only
from tests.test_cli import run_cli, running


def test_a_windowed_capture_can_be_stopped_and_keeps_what_it_recorded(tmp_path):
    app, _ = make_app(tmp_path)
    client = TestClient(app)
    assert client.post("/snapshot/stop", headers=AUTH).status_code == 409
    assert client.post("/snapshot", json={"record_s": 301}, headers=AUTH).status_code == 422
    started = client.post("/snapshot", json={"record_s": 300}, headers=AUTH)
    assert started.status_code == 202
    info = only(started)
    busy = client.post("/snapshot", headers=AUTH)
    assert busy.status_code == 409 and "/snapshot/stop" in busy.json()["detail"]
    began = time.monotonic()
    stopped = client.post("/snapshot/stop", headers=AUTH)
    assert stopped.status_code == 200, stopped.text
    assert time.monotonic() - began < 10
    entry = only(stopped)["stopped"]
    assert entry["id"] == info["id"] and entry["status"] == "ready"
    assert 0 <= entry["meta"]["recorded_s"] < 10
    assert client.get(f"/snapshots/{info['id']}", headers=AUTH).status_code == 200
    assert client.post("/snapshot", headers=AUTH).status_code == 201
    again = client.post("/snapshot/stop", headers=AUTH)
    assert again.status_code == 409 and "no capture is recording" in again.json()["detail"]


def test_the_cli_stops_a_window_and_downloads_what_it_recorded(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("cli-token\n")
    env = {"GPUMEM_ADMIN_TOKEN_FILE": str(token_file), "GPUMEM_SNAPSHOT_DIR": str(tmp_path / "s")}
    with running("demo", env=env) as url:
        request = urllib.request.Request(
            url + "/snapshot",
            data=json.dumps({"record_s": 300}).encode(),
            headers={"Authorization": "Bearer cli-token", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 202
        out = tmp_path / "window.pickle"
        flags = ("--url", url, "--token-file", str(token_file))
        stopped = run_cli("snapshot", *flags, "--stop", "-o", str(out), timeout=30)
        assert stopped.returncode == 0, stopped.stderr
        assert pickle.loads(out.read_bytes())["segments"]
        nothing = run_cli("snapshot", *flags, "--stop", "-o", str(out), timeout=30)
        assert nothing.returncode == 2 and "no capture is recording" in nothing.stderr
