"""The admin API: auth, validation, snapshots end to end on the demo, retention, concurrency."""

from __future__ import annotations

import logging
import pickle
import stat
import time

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from exporter.actions.snapshots import SnapshotStore
from tests.helpers import AUTH, TOKEN, demo_pid, make_app, only


@pytest.fixture
def demo(tmp_path):
    app, runtime = make_app(tmp_path)
    return TestClient(app), runtime


def admin_routes(app):
    for route in app.routes:
        if isinstance(route, APIRoute) and "admin" in route.tags:
            for method in route.methods or ():
                yield method, route.path.replace("{snapshot_id}", "20260101T000000Z-00000000")


def test_without_a_token_every_admin_route_is_off_with_a_message(tmp_path):
    # Not the demo, which changes nothing and is open without a token (test_demo_admin.py).
    app, _ = make_app(tmp_path, mode="embedded", admin_token=None)
    client = TestClient(app)
    routes = list(admin_routes(app))
    assert len(routes) >= 9
    for method, path in routes:
        response = client.request(method, path, headers=AUTH)
        assert response.status_code == 403, (method, path)
        assert "GPUMEM_ADMIN_TOKEN" in response.json()["detail"]
    assert client.get("/metrics").status_code == 200  # open routes stay open
    assert client.get("/healthz").status_code == 200


def test_a_wrong_or_missing_token_is_401_and_never_logged(demo, caplog):
    client, _ = demo
    with caplog.at_level(logging.DEBUG):
        for headers in (
            {},
            {"Authorization": "Bearer nope"},
            {"Authorization": TOKEN},
            {"Authorization": f"Basic {TOKEN}"},
        ):
            response = client.post("/snapshot", headers=headers)
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"
        client.get("/stats", headers=AUTH)
    assert TOKEN not in caplog.text
    assert TOKEN not in client.get("/metrics").text


def test_token_file_is_reread_so_rotation_works(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("first\n")
    app, _ = make_app(tmp_path, admin_token=None, admin_token_file=str(token_file))
    client = TestClient(app)
    assert client.get("/stats", headers={"Authorization": "Bearer first"}).status_code == 200
    token_file.write_text("second\n")
    assert client.get("/stats", headers={"Authorization": "Bearer first"}).status_code == 401
    assert client.get("/stats", headers={"Authorization": "Bearer second"}).status_code == 200


def test_snapshot_list_download_view_delete_on_the_demo(demo):
    client, _ = demo
    created = client.post("/snapshot", headers=AUTH)
    assert created.status_code == 201, created.text
    assert created.json()["replay"] is True and "replay" in created.json()["note"]
    info = only(created)
    assert info["status"] == "ready" and info["size_bytes"] > 0
    listed = client.get("/snapshots", headers=AUTH).json()["snapshots"]
    assert [s["id"] for s in listed] == [info["id"]]
    download = client.get(f"/snapshots/{info['id']}", headers=AUTH)
    assert download.status_code == 200
    snapshot = pickle.loads(download.content)  # the format torch's memory_viz loads
    assert snapshot["segments"] and "device_traces" in snapshot
    assert info["id"] in download.headers["content-disposition"]
    view = client.get(f"/snapshots/{info['id']}/view", headers=AUTH)
    assert view.status_code == 200 and view.headers["content-type"].startswith("text/html")
    assert "http://" not in view.text and "https://" not in view.text
    assert client.delete(f"/snapshots/{info['id']}", headers=AUTH).status_code == 204
    assert client.get(f"/snapshots/{info['id']}", headers=AUTH).status_code == 404
    assert client.get("/snapshots", headers=AUTH).json()["snapshots"] == []
    metrics = client.get("/metrics").text
    assert 'gpumem_exporter_snapshots_total{trigger="api"} 1.0' in metrics
    assert 'gpumem_exporter_admin_requests_total{action="snapshot",outcome="ok"} 1.0' in metrics


def test_files_are_private_and_named_for_incidents(demo):
    client, runtime = demo
    info = only(client.post("/snapshot", headers=AUTH))
    directory = runtime.actions.store.directory
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    name = info["filename"]
    # Named for the process it shows: the demo's recorded one.
    assert f"pid{demo_pid()}" in name and info["id"] in name and name.endswith(".pickle")
    assert not [p for p in directory.iterdir() if p.name.endswith(".partial")]


def test_windowed_capture_is_202_then_ready_and_one_at_a_time(demo):
    client, _ = demo
    started = client.post("/snapshot", json={"record_s": 0.3}, headers=AUTH)
    assert started.status_code == 202
    info = only(started)
    assert info["status"] == "recording"
    assert client.get(f"/snapshots/{info['id']}/info", headers=AUTH).json()["status"] == "recording"
    busy = client.post("/snapshot", headers=AUTH)
    assert busy.status_code == 409 and info["id"] in busy.json()["detail"]
    assert only(busy)["outcome"] == "conflict"
    assert client.get(f"/snapshots/{info['id']}", headers=AUTH).status_code == 409
    assert client.delete(f"/snapshots/{info['id']}", headers=AUTH).status_code == 409
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        listed = client.get("/snapshots", headers=AUTH).json()["snapshots"]
        if listed[0]["status"] == "ready":
            break
        time.sleep(0.05)
    assert listed[0]["status"] == "ready" and listed[0]["trigger"] == "record"
    assert client.get(f"/snapshots/{info['id']}", headers=AUTH).status_code == 200
    assert client.post("/snapshot", headers=AUTH).status_code == 201


@pytest.mark.slow
def test_empty_cache_reports_release_and_enforces_its_cooldown(demo):
    client, _ = demo
    first = client.post("/empty-cache", headers=AUTH)
    assert first.status_code == 200, first.text
    body = only(first)
    before, after = body["reserved_before_bytes"]["0"], body["reserved_after_bytes"]["0"]
    assert body["would_release_bytes"] == before - after > 0  # a replay releases nothing
    assert first.json()["replay"] is True
    again = client.post("/empty-cache", headers=AUTH)
    assert again.status_code == 429
    assert 1 <= int(again.headers["retry-after"]) <= 10
    assert "blocks allocations" in again.json()["detail"]


def test_history_reset_peak_and_stats_on_the_demo(demo):
    client, _ = demo
    on = client.post("/history", json={"enabled": True, "max_entries": 5000}, headers=AUTH)
    assert on.status_code == 200 and only(on)["enabled"] is True
    assert only(client.get("/history", headers=AUTH))["max_entries"] == 5000
    off = only(client.post("/history", json={"enabled": False}, headers=AUTH))
    assert off["enabled"] is False and off["snapshot"]["trigger"] == "history"
    reset = client.post("/reset-peak", json={"device": 0}, headers=AUTH)
    assert only(reset)["devices"] == [0]
    stats = client.get("/stats", headers=AUTH).json()
    assert stats["mode"] == "demo" and stats["sample"]["allocators"]


def test_pid_and_rank_select_this_process_or_nothing(demo):
    """One client for every mode: pid/rank are accepted everywhere, and in a single process
    they name it or nothing (404). The demo is the recorded process, by its pid."""
    client, _ = demo
    me = {"pid": int(demo_pid())}
    assert only(client.post("/reset-peak", json=me, headers=AUTH))["devices"]
    assert only(client.get(f"/history?pid={demo_pid()}", headers=AUTH))["enabled"] is False
    for method, path, body in (
        ("POST", "/snapshot", {"pid": 1}),
        ("POST", "/empty-cache", {"rank": 7}),
        ("POST", "/reset-peak", {"pid": 1}),
        ("POST", "/history", {"enabled": True, "rank": 7}),
        ("GET", "/history?pid=1", None),
    ):
        response = client.request(method, path, json=body, headers=AUTH)
        assert response.status_code == 404, (path, response.text)
        assert "no process matches" in response.json()["detail"]
    bad = client.get("/history?pid=zero", headers=AUTH)
    assert bad.status_code == 422 and "pid" in bad.json()["detail"]
    assert client.get("/stats?nope=1", headers=AUTH).status_code == 422
    assert client.get("/stats?rank=7", headers=AUTH).json()["sample"]["allocators"] == []
    # /stats names the recorded process as the actions do: its readings, its ledger
    stats = client.get(f"/stats?pid={demo_pid()}", headers=AUTH).json()
    assert stats["sample"]["allocators"] and stats["ledgers"]
    assert client.get("/stats?pid=1", headers=AUTH).json()["ledgers"] == []


@pytest.mark.parametrize(
    ("path", "body", "status", "detail"),
    [
        ("/snapshot", b"{not json", 422, "invalid request"),
        ("/snapshot", b'{"record_s": -1}', 422, "record_s"),
        ("/snapshot", b'{"record_s": 301}', 422, "record_s"),
        ("/snapshot", b'{"stacks": "cpp"}', 422, "stacks"),
        ("/snapshot", b'{"surprise": 1}', 422, "surprise"),
        ("/snapshot", b"[]", 422, "invalid request"),
        ("/empty-cache", b'{"device": "zero"}', 422, "device"),
        ("/history", b"{}", 422, "enabled"),
        ("/snapshot", b'{"x": "' + b"a" * 20000 + b'"}', 413, "16384 bytes"),
    ],
)
def test_bad_requests_get_a_clear_4xx(demo, path, body, status, detail):
    client, _ = demo
    response = client.post(path, content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == status
    assert detail in response.json()["detail"]


@pytest.mark.parametrize(
    "snapshot_id", ["../../etc/passwd", "..%2F..%2Fetc", "x" * 300, "20260101T000000Z-zzzzzzzz"]
)
def test_ids_are_never_paths(demo, snapshot_id):
    client, _ = demo
    for method in ("GET", "DELETE"):
        response = client.request(method, f"/snapshots/{snapshot_id}", headers=AUTH)
        assert response.status_code == 404


def test_live_process_without_cuda_answers_409_not_500(tmp_path):
    app, _ = make_app(tmp_path, mode="embedded", nvml=False)
    client = TestClient(app)
    for path in ("/snapshot", "/empty-cache", "/reset-peak"):
        response = client.post(path, headers=AUTH)
        assert response.status_code == 409, (path, response.text)
        assert "CUDA is not initialized" in response.json()["detail"]
    assert client.post("/history", json={"enabled": True}, headers=AUTH).status_code == 409
    assert client.get("/stats", headers=AUTH).json()["replay"] is False


def test_retention_keeps_the_newest_within_count_and_bytes(tmp_path):
    store = SnapshotStore(tmp_path, max_count=3, max_bytes=10_000)
    ids = [store.write({"segments": [], "n": i}, "api").id for i in range(5)]
    assert [i.id for i in store.list()] == ids[::-1][:3]
    assert len(list(tmp_path.glob("*.pickle"))) == 3
    assert len(list(tmp_path.glob("*.json"))) == 3
    small = store.list()[0].size_bytes
    store.max_bytes = 8000 + 3 * small  # the big one plus about one small one
    big = store.write({"segments": [], "blob": b"x" * 8000}, "api")
    kept = store.list()
    assert [i.id for i in kept] == [big.id, ids[-1]]
    assert sum(i.size_bytes for i in kept) <= store.max_bytes
    # A restarted exporter finds what is on disk.
    assert [i.id for i in SnapshotStore(tmp_path).list()] == [big.id, ids[-1]]
    # The newest is kept even when it alone is over the byte limit.
    store.max_bytes = 10
    assert [i.id for i in [store.write({"segments": []}, "api")]] == [store.list()[0].id]
    assert len(store.list()) == 1


def test_a_capture_whose_process_died_reads_as_failed_elsewhere(tmp_path):
    """Under `run` the launcher lists captures that agents reserved; one whose writer died
    while recording is failed (with why), not recording forever."""
    import json
    import subprocess
    import sys

    writer = SnapshotStore(tmp_path)
    info = writer.reserve("record")
    sidecar = tmp_path / (info.filename + ".json")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    data = json.loads(sidecar.read_text())
    data["meta"]["writer_pid"] = int(dead.stdout)
    sidecar.write_text(json.dumps(data))
    seen = SnapshotStore(tmp_path).get(info.id)
    assert seen is not None and seen.status == "failed"
    assert "exited while recording" in seen.meta["error"]
    alive = SnapshotStore(tmp_path).get(writer.reserve("record").id)
    assert alive is not None and alive.status == "recording"  # this process is alive


def test_a_snapshot_removed_by_another_process_leaves_the_listing(tmp_path):
    first, second = SnapshotStore(tmp_path), SnapshotStore(tmp_path)
    info = first.write({"segments": []}, "api")
    assert [i.id for i in second.list()] == [info.id]
    first.delete(info.id)
    assert second.list() == []


def test_the_demo_arms_no_oom_capture_or_history_but_remediates(tmp_path):
    _, runtime = make_app(tmp_path, oom_snapshot=True, history_max_entries=100, remediate=True)
    names = [getattr(listener, "__name__", "") for listener in runtime.sampler.listeners]
    assert "oom_capture" not in names and "history_startup" not in names
    assert runtime.actions.remediation is not None
