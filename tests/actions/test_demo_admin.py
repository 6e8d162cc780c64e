"""The demo's admin actions answer without set-up: they replay a recording and change nothing,
so without a configured token they are open. With a token configured the demo requires it, and
every other mode keeps admin actions off without one."""

from __future__ import annotations

import os

import pytest
from fastapi.testclient import TestClient

from exporter.config import load_config
from exporter.http.server import create_app
from exporter.runtime import build_runtime
from exporter.sources.replay import ReplaySource
from tests.helpers import captured_oom_samples, runtime_of, trace_of_sample

TOKEN = "demo-admin-token"


def client_for(tmp_path, mode: str, **settings) -> TestClient:
    sources = [ReplaySource()] if mode == "demo" else []
    runtime = runtime_of(tmp_path, mode, sources, **settings)
    runtime.sampler.tick()
    return TestClient(create_app(runtime))


@pytest.mark.slow
def test_the_demo_without_a_token_answers_every_action_from_its_recording(tmp_path):
    client = client_for(tmp_path, "demo")
    created = client.post("/snapshot")
    assert created.status_code == 201, created.text
    assert created.json()["replay"] is True
    snapshot_id = created.json()["processes"][0]["result"]["id"]
    listed = client.get("/snapshots")
    assert listed.status_code == 200
    assert [s["id"] for s in listed.json()["snapshots"]] == [snapshot_id]
    assert client.get(f"/snapshots/{snapshot_id}/view").text.startswith("<!")
    emptied = client.post("/empty-cache")
    assert emptied.status_code == 200 and emptied.json()["ok"] is True
    # What empty_cache would release at the replayed moment, named; nothing is released.
    (entry,) = emptied.json()["processes"]
    assert entry["result"]["would_release_bytes"] > 0 and "released_bytes" not in entry["result"]
    assert entry["result"]["recorded"].startswith("second ")
    # As the recorded process, whose pid the page and the series show: one pid everywhere.
    recorded = ReplaySource().recorded_process()
    assert entry["process"] == recorded and recorded["pid"] != str(os.getpid())
    assert client.get("/stats").status_code == 200
    assert client.delete(f"/snapshots/{snapshot_id}").status_code == 204
    # A wrong token changes nothing: there is none to match.
    assert client.get("/snapshots", headers={"Authorization": "Bearer nope"}).status_code == 200


def test_the_demo_with_a_token_requires_it(tmp_path):
    client = client_for(tmp_path, "demo", admin_token=TOKEN)
    for method, path in (("POST", "/snapshot"), ("GET", "/snapshots"), ("POST", "/empty-cache")):
        response = client.request(method, path)
        assert response.status_code == 401, (method, path)
        assert response.headers["www-authenticate"] == "Bearer"
    ok = client.get("/snapshots", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200


def test_the_demo_with_an_empty_token_file_stays_off(tmp_path):
    """A named token file is a configured token, even while it is empty (being rotated)."""
    token_file = tmp_path / "token"
    token_file.write_text("\n")
    client = client_for(tmp_path, "demo", admin_token_file=str(token_file))
    assert client.post("/snapshot").status_code == 403


@pytest.mark.parametrize("mode", ["embedded", "node", "run"])
def test_every_other_mode_keeps_admin_actions_off_without_a_token(tmp_path, mode):
    client = client_for(tmp_path, mode)
    for method, path in (("POST", "/snapshot"), ("GET", "/snapshots"), ("POST", "/empty-cache")):
        response = client.request(method, path)
        assert response.status_code == 403, (mode, method, path)
        assert "GPUMEM_ADMIN_TOKEN" in response.json()["detail"]


@pytest.mark.slow
def test_a_demo_snapshot_is_the_recorded_one_of_the_moment_it_replays(tmp_path):
    """The recording asked its exporter for snapshots as it ran: just after the snapshot its
    first OOM wrote, the demo answers with that one, which holds the OOM; near the trace's end
    with a later one; each names its moment in the viewer's header."""
    from exporter.actions.replay import recorded_snapshots
    from exporter.viewer import load_snapshot

    now = [0.0]
    replay = ReplaySource(clock=lambda: now[0])
    replay.position()  # the replay starts at 0 on this clock
    config = load_config(env={}, snapshot_dir=str(tmp_path / "snaps"))
    runtime = build_runtime(config, mode="demo", sources=[replay])
    client = TestClient(create_app(runtime))
    at_oom_s = min(at for at, path in recorded_snapshots() if "-oom." in path.name)
    last_s = replay.duration_s - 1.0
    taken = {}
    for second in (at_oom_s + 1.0, last_s):
        now[0] = second
        runtime.sampler.tick()
        answer = client.post("/snapshot").json()["processes"][0]["result"]
        taken[second] = answer
        page = client.get(f"/snapshots/{answer['id']}/view").text
        recorded = max(at for at, _ in recorded_snapshots() if at <= replay.moment())
        assert f"second {recorded:.0f} of the demo trace" in page
        assert "{&#x27;" not in page and "{'" not in page  # no dict in the header
    oom_id = taken[at_oom_s + 1.0]["id"]
    info = runtime.actions.store.get(oom_id)
    assert info is not None
    at_oom = load_snapshot(runtime.actions.store.path(info))
    assert any(e["action"] == "oom" for e in at_oom["device_traces"][0])
    assert "oom snapshot" in client.get(f"/snapshots/{oom_id}/view").text
    assert "api snapshot" in client.get(f"/snapshots/{taken[last_s]['id']}/view").text


@pytest.mark.slow
def test_the_replayed_oom_snapshot_is_listed_counted_and_linked_from_its_verdict(tmp_path):
    """From the moment the replay reaches the recorded OOM, its snapshot (taken in the recorded
    server's OOM observer) is in the demo's own folder under the id its verdict links to."""
    from exporter.actions.replay import recorded_snapshots

    now = [0.0]
    replay = ReplaySource(clock=lambda: now[0])
    replay.position()
    runtime = build_runtime(load_config(env={}), mode="demo", sources=[replay])
    client = TestClient(create_app(runtime))
    runtime.sampler.tick()
    assert client.get("/snapshots").json()["snapshots"] == []
    # Its own folder, removed when the demo exits, not the shared default one.
    folder = runtime.actions.store.directory
    assert folder.name.startswith("gpumem-demo-") and folder.stat().st_mode & 0o077 == 0
    assert folder != load_config(env={}).snapshot_directory
    for second in (60.0, 120.0, replay.duration_s + 1.0):  # after the OOM, later, next loop
        now[0] = second
        runtime.sampler.tick()
        latest = runtime.sampler.latest
        assert latest is not None
        verdict = latest.allocators[0].last_oom
        assert verdict is not None and verdict.verdict == "fragmentation"
        listed = {s["id"]: s for s in client.get("/snapshots").json()["snapshots"]}
        assert {s["trigger"] for s in listed.values()} == {"oom"}
        if verdict.snapshot:  # an OOM within the recording's snapshot cooldown has none
            oom = listed[verdict.snapshot]
            assert oom["meta"]["process"] == replay.recorded_process()
            assert oom["meta"]["oom"]["verdict"] == "fragmentation"
    # The recording's OOM snapshots (one per OOM outside a 20 s cooldown), once each.
    recorded_ooms = [at for at, path in recorded_snapshots() if "-oom." in path.name]
    assert len(listed) == len(recorded_ooms) >= 1
    metrics = client.get("/metrics").text
    assert f'gpumem_exporter_snapshots_total{{trigger="oom"}} {len(recorded_ooms)}.0' in metrics
    assert verdict is not None
    assert client.get(f"/snapshots/{verdict.snapshot}/view").text.startswith("<!")


def test_a_trace_without_recorded_snapshots_says_so_and_one_with_them_answers(tmp_path):
    """`demo --trace FILE` answers from that recording's snapshots, never the packaged ones."""
    from exporter.sources.replay import demo_snapshots_folder

    (sample,) = [
        s for s in captured_oom_samples() if s.allocators[0].ooms_by_verdict.get("fragmentation")
    ]
    trace = trace_of_sample(tmp_path / "t.jsonl.gz", sample)
    for snapshots, status in ((None, 501), (demo_snapshots_folder(), 201)):
        config = load_config(env={}, snapshot_dir=str(tmp_path / f"s{status}"))
        replay = ReplaySource(trace, snapshots=snapshots)
        runtime = build_runtime(config, mode="demo", sources=[replay])
        runtime.sampler.tick()
        answer = TestClient(create_app(runtime)).post("/snapshot")
        assert answer.status_code == status, answer.text
        if status == 501:
            assert "this trace has no recorded snapshots" in answer.text
