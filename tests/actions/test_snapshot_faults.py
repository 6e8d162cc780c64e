"""The snapshot folder under faults: planted entries, a folder another user owns, a full or
read-only disk, SIGKILL mid-write, a sidecar with a bad field (docs/reliability.md).

The disk tests mount a small tmpfs: they need root (CI runs as root); elsewhere they skip,
and fail under GPUMEM_REQUIRE_TOOLS=1.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import pickle
import random
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from exporter.actions.base import ActionFailed
from exporter.actions.snapshots import SnapshotStore
from exporter.config import ConfigError, load_config
from exporter.http.server import create_app
from exporter.runtime import build_runtime
from exporter.sources.replay import ReplaySource
from tests.conftest import REPO_ROOT, mount_tmpfs

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OTHER_UID = 12345


def demo_app(folder: Path, **settings):
    """The demo (replayed allocator) with its snapshots in `folder`."""
    config = load_config(env={}, admin_token=TOKEN, snapshot_dir=str(folder), **settings)
    runtime = build_runtime(config, mode="demo", sources=[ReplaySource()])
    runtime.sampler.tick()
    return TestClient(create_app(runtime)), runtime


def private_folder(path: Path) -> Path:
    path.mkdir(mode=0o700)
    return path


def plant(folder: Path, snapshot_id: str, data: bytes | None = b"planted", **fields) -> Path:
    """A sidecar as the store writes it (fields overridden), and its data file unless None."""
    filename = f"host_pid1_{snapshot_id}_api.pickle"
    entry = {
        "id": snapshot_id,
        "trigger": "api",
        "created": 1.0,  # older than anything the server writes: retention drops it first
        "status": "ready",
        "size_bytes": 7,
        "filename": filename,
        "meta": {},
        **fields,
    }
    if data is not None:
        (folder / filename).write_bytes(data)
    sidecar = folder / (filename + ".json")
    sidecar.write_text(json.dumps(entry))
    return sidecar


def listed_ids(client: TestClient) -> list[str]:
    response = client.get("/snapshots", headers=AUTH)
    assert response.status_code == 200, response.text
    return [s["id"] for s in response.json()["snapshots"]]


# -- 1. the index serves and deletes only what the store made ------------------------------


def test_planted_paths_are_never_served_or_deleted(tmp_path):
    folder = private_folder(tmp_path / "snaps")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    planted = {
        "20260101T000000Z-0000000a": {"filename": "../victim.txt"},
        "20260101T000000Z-0000000b": {"filename": str(victim)},
        "20260101T000000Z-0000000c": {"filename": "../../victim.txt"},
    }
    for snapshot_id, fields in planted.items():
        plant(folder, snapshot_id, data=None, **fields)
    # A name the store could have made, but the data file is a symlink out of the folder.
    linked = "20260101T000000Z-0000000d"
    plant(folder, linked, data=None)
    (folder / f"host_pid1_{linked}_api.pickle").symlink_to(victim)
    client, _ = demo_app(folder, snapshot_max_count=1)

    assert listed_ids(client) == []
    for snapshot_id in [*planted, linked]:
        for path in (f"/snapshots/{snapshot_id}", f"/snapshots/{snapshot_id}/view"):
            assert client.get(path, headers=AUTH).status_code == 404, path
        assert client.delete(f"/snapshots/{snapshot_id}", headers=AUTH).status_code == 404
    created = client.post("/snapshot", headers=AUTH)  # retention keeps 1: drops the oldest
    assert created.status_code == 201, created.text
    assert victim.read_text() == "precious"
    assert (folder / f"host_pid1_{linked}_api.pickle").is_symlink()  # not followed, not served
    assert len(listed_ids(client)) == 1


def test_a_sidecar_not_named_after_its_file_is_ignored(tmp_path):
    """One sidecar per file: a second one, under another name, never comes back as an entry
    once the snapshot is deleted."""
    folder = private_folder(tmp_path / "snaps")
    client, runtime = demo_app(folder)
    info = runtime.actions.store.write({"segments": []}, "api")
    stale = json.loads((folder / (info.filename + ".json")).read_text())
    stale.update(status="recording", meta={"writer_pid": os.getpid()})
    (folder / "other.json").write_text(json.dumps(stale))
    assert client.delete(f"/snapshots/{info.id}", headers=AUTH).status_code == 204
    assert listed_ids(client) == []
    assert client.get(f"/snapshots/{info.id}/info", headers=AUTH).status_code == 404


@pytest.mark.parametrize(
    "fields",
    [
        {"id": 20260101},
        {"created": "yesterday"},
        {"created": None},
        {"created": True},
        {"size_bytes": "7"},
        {"status": "gone"},
        {"status": ["ready"]},
        {"meta": []},
        {"trigger": 1},
        {"filename": None},
        {"unknown_field": 1},
    ],
    ids=lambda fields: "-".join(f"{k}={v!r}" for k, v in fields.items()),
)
def test_entries_with_wrong_types_are_skipped(tmp_path, fields):
    folder = private_folder(tmp_path / "snaps")
    bad_id = "20260101T000000Z-000000ff"
    plant(folder, bad_id, **fields)
    client, _ = demo_app(folder, snapshot_max_count=1)
    assert listed_ids(client) == []
    assert client.get(f"/snapshots/{bad_id}", headers=AUTH).status_code == 404
    assert client.post("/snapshot", headers=AUTH).status_code == 201
    assert (folder / f"host_pid1_{bad_id}_api.pickle").read_bytes() == b"planted"


# -- 1. the folder belongs to this user alone -----------------------------------------------


def take_over(folder: Path, how: str) -> Path:
    """What another local user could have done to `folder` before the exporter starts."""
    if how == "owner":
        folder.mkdir(mode=0o700)
        os.chown(folder, OTHER_UID, OTHER_UID)
    elif how == "mode":
        folder.mkdir()
        folder.chmod(0o777)
    else:
        real = folder.with_name(folder.name + "-real")
        real.mkdir(mode=0o700)
        folder.symlink_to(real)
    return folder


TAKEN = ["owner", "mode", "symlink"]
PROBLEM = {"owner": f"uid {OTHER_UID}", "mode": "writable by group or others", "symlink": "symlink"}


@pytest.mark.parametrize("how", ["owner", "symlink"])
def test_a_configured_folder_not_ours_alone_is_a_config_error(tmp_path, how):
    folder = take_over(tmp_path / "snaps", how)
    with pytest.raises(ConfigError, match=PROBLEM[how]) as raised:
        load_config(env={"GPUMEM_SNAPSHOT_DIR": str(folder)})
    assert str(raised.value).startswith("GPUMEM_SNAPSHOT_DIR: ")
    assert "\n" not in str(raised.value)


def test_a_configured_folder_of_ours_open_to_others_is_closed_to_them(tmp_path, caplog):
    folder = take_over(tmp_path / "snaps", "mode")  # as a volume mounted 0777 would be
    config = load_config(env={"GPUMEM_SNAPSHOT_DIR": str(folder)})
    assert config.snapshot_directory == folder
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert "was writable by others (mode 777): now 755" in caplog.text


@pytest.mark.slow
def test_the_cli_reports_a_configured_folder_not_ours_in_one_line(tmp_path):
    folder = take_over(tmp_path / "snaps", "owner")
    env = {**os.environ, "GPUMEM_SNAPSHOT_DIR": str(folder)}
    result = subprocess.run(
        [sys.executable, "-m", "exporter.cli", "demo", "--port", "0"],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("gpumem-exporter demo: error: GPUMEM_SNAPSHOT_DIR: snapshot folder")
    assert f"uid {OTHER_UID}" in line


@pytest.mark.parametrize("how", TAKEN)
def test_a_default_folder_not_ours_alone_falls_back_to_a_private_one(
    tmp_path, monkeypatch, caplog, how
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    default = take_over(tmp_path / f"gpumem-snapshots-{os.getuid()}", how)
    plant(default.resolve(), "20260101T000000Z-0000000a", filename="../victim.txt")
    with caplog.at_level(logging.WARNING):
        config = load_config(env={})
        folder = config.snapshot_directory
        assert config.snapshot_directory == folder  # resolved once
    assert folder != default and folder.parent == tmp_path
    assert folder.name.startswith(f"gpumem-snapshots-{os.getuid()}-")
    assert folder.stat().st_uid == os.getuid() and folder.stat().st_mode & 0o777 == 0o700
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert PROBLEM[how] in warning.getMessage() and str(folder) in warning.getMessage()
    store = SnapshotStore.for_config(config)
    assert store.list() == []
    assert store.write({"segments": []}, "api").filename in os.listdir(folder)


def test_a_store_reads_and_writes_nothing_once_its_folder_is_not_private(tmp_path, caplog):
    folder = private_folder(tmp_path / "snaps")
    store = SnapshotStore(folder)
    store.write({"segments": []}, "api")
    os.chown(folder, OTHER_UID, OTHER_UID)
    with caplog.at_level(logging.WARNING):
        assert store.list() == [] and store.list() == []
    assert len([r for r in caplog.records if f"uid {OTHER_UID}" in r.getMessage()]) == 1
    with pytest.raises(ActionFailed, match=f"uid {OTHER_UID}") as raised:
        store.write({"segments": []}, "api")
    assert raised.value.outcome == "insufficient_storage"


# -- 5. a full or read-only disk is a 507 that leaves nothing behind ------------------------


def fill(path: Path, size: int | None = None) -> None:
    """Write `size` bytes to `path`, or as many as the disk takes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        chunk = b"\0" * 65536
        written = 0
        while size is None or written < size:
            try:
                written += os.write(fd, chunk[: 65536 if size is None else size - written])
            except OSError as exc:
                if exc.errno != errno.ENOSPC or size is not None:
                    raise
                return
    finally:
        os.close(fd)


def assert_507(response, reason: str) -> None:
    assert response.status_code == 507, response.text
    assert reason in response.json()["detail"]
    assert response.json()["processes"][0]["outcome"] == "insufficient_storage"


def test_a_full_disk_answers_507_with_the_reason_and_leaves_nothing(small_disk):
    disk = small_disk("1m")
    folder = private_folder(disk / "snaps")
    fill(disk / "filler")
    client, _ = demo_app(folder)
    assert_507(client.post("/snapshot", headers=AUTH), "No space left on device")
    assert_507(client.post("/snapshot", json={"record_s": 1}, headers=AUTH), "No space left")
    assert os.listdir(folder) == []
    assert listed_ids(client) == []
    metrics = client.get("/metrics").text
    assert 'admin_requests_total{action="snapshot",outcome="insufficient_storage"} 2.0' in metrics


def test_a_snapshot_whose_index_entry_does_not_fit_is_removed(small_disk):
    """Room for the snapshot, not for its sidecar: the snapshot goes too."""
    disk = small_disk("8m")
    folder = private_folder(disk / "snaps")
    client, runtime = demo_app(folder)
    size = len(pickle.dumps(runtime.actions.capture(), protocol=pickle.HIGHEST_PROTOCOL))
    pages = math.ceil(size / 4096)
    free_pages = os.statvfs(disk).f_bavail
    fill(disk / "filler", (free_pages - pages) * 4096)
    assert os.statvfs(disk).f_bavail == pages
    assert_507(client.post("/snapshot", headers=AUTH), "No space left on device")
    assert os.listdir(folder) == []
    assert listed_ids(client) == []


def test_a_read_only_disk_answers_507_with_the_reason(small_disk):
    disk = small_disk("8m")
    folder = private_folder(disk / "snaps")
    client, _ = demo_app(folder)
    mount_tmpfs("-o", "remount,ro", str(disk))
    assert_507(client.post("/snapshot", headers=AUTH), "Read-only file system")
    assert_507(client.post("/snapshot", json={"record_s": 1}, headers=AUTH), "Read-only")
    assert os.listdir(folder) == []


def test_deleting_on_a_read_only_disk_answers_507_and_keeps_the_snapshot_listed(small_disk):
    disk = small_disk("8m")
    folder = private_folder(disk / "snaps")
    client, _ = demo_app(folder)
    created = client.post("/snapshot", headers=AUTH)
    assert created.status_code == 201, created.text
    snapshot_id = created.json()["processes"][0]["result"]["id"]
    files = sorted(os.listdir(folder))
    mount_tmpfs("-o", "remount,ro", str(disk))
    deleted = client.delete(f"/snapshots/{snapshot_id}", headers=AUTH)
    assert deleted.status_code == 507, deleted.text
    assert "Read-only file system" in deleted.json()["detail"]
    # Still listed, still there, still downloadable: the index says what the folder holds.
    assert listed_ids(client) == [snapshot_id]
    assert sorted(os.listdir(folder)) == files
    assert client.get(f"/snapshots/{snapshot_id}", headers=AUTH).status_code == 200
    mount_tmpfs("-o", "remount,rw", str(disk))
    assert client.delete(f"/snapshots/{snapshot_id}", headers=AUTH).status_code == 204
    assert listed_ids(client) == [] and os.listdir(folder) == []


# -- 6. SIGKILL mid-write: a restart leaves the folder exactly what the index says -----------

WRITER = """
import os, random, sys
from exporter.actions.snapshots import SnapshotStore
store = SnapshotStore(sys.argv[1], max_count=100_000, max_bytes=1 << 40)
print("ready", flush=True)
snapshot = {"segments": [], "blob": os.urandom(1 << 20)}
while True:
    if random.random() < 0.5:  # windowed: a sidecar `recording` first, then the data
        info = store.write(snapshot, "record", info=store.reserve("record"))
    else:
        info = store.write(snapshot, "api")
    print(info.id, flush=True)
"""
KILL_ROUNDS = 20


def leftovers(folder: Path) -> dict[str, int]:
    """What a killed writer left that the index does not account for."""
    names = set(os.listdir(folder))
    found = {"temp": 0, "unindexed": 0, "recording": 0, "no_data": 0}
    for name in names:
        if name.startswith(".") and name.endswith(".partial"):
            found["temp"] += 1
        elif name.endswith(".pickle") and name + ".json" not in names:
            found["unindexed"] += 1
        elif name.endswith(".pickle.json"):
            status = json.loads((folder / name).read_text())["status"]
            found["recording"] += status == "recording"
            found["no_data"] += status == "ready" and name[: -len(".json")] not in names
    return found


def assert_exactly_the_index(folder: Path, store: SnapshotStore) -> None:
    entries = store.list()
    assert not [i for i in entries if i.status == "recording"]
    expected = {i.filename + ".json" for i in entries}
    expected |= {i.filename for i in entries if i.status == "ready"}
    assert set(os.listdir(folder)) == expected


@pytest.mark.slow
def test_sigkill_mid_write_leaves_nothing_a_restart_does_not_sort_out(tmp_path):
    folder = private_folder(tmp_path / "snaps")
    rng = random.Random(6)
    written: list[str] = []
    seen = {"temp": 0, "unindexed": 0, "recording": 0, "no_data": 0}
    for _ in range(KILL_ROUNDS):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(folder)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert writer.stdout is not None
        assert writer.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0.0, 0.3))
        writer.send_signal(signal.SIGKILL)
        out, _ = writer.communicate(timeout=30)
        written += out.split()  # every id the writer saw written
        for kind, count in leftovers(folder).items():
            seen[kind] += count
    print(f"\n{KILL_ROUNDS} SIGKILL rounds, {len(written)} snapshots written, left after kills:")
    print(f"  {seen}")

    store = SnapshotStore(folder, max_count=100_000, max_bytes=1 << 40)
    assert_exactly_the_index(folder, store)
    ready = {i.id for i in store.list() if i.status == "ready"}
    lost = set(written) - ready
    print(f"  after a restart: lost {len(lost)}, stray files 0, entries {len(store.list())}")
    assert not lost
    assert sum(seen.values()) > 0, "no kill hit a write: the test proves nothing"
    # Retention counts every entry, adopted and failed ones included.
    store.max_count = 3
    store.write({"segments": []}, "api")
    assert len(store.list()) == 3
    assert_exactly_the_index(folder, store)


def test_a_live_writers_temp_file_is_left_alone_and_an_old_one_is_swept(tmp_path):
    """Other processes of the server (gpumem-exporter run) write into the same folder."""
    folder = private_folder(tmp_path / "snaps")
    live = folder / f".x.pickle.{os.getpid()}.abcd1234.partial"
    dead_pid = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], text=True, capture_output=True
    ).stdout.strip()
    dead = folder / f".x.pickle.{dead_pid}.abcd1234.partial"
    old = folder / ".x.pickle.abcd1234.partial"  # no pid in the name: by its age
    for path in (live, dead, old):
        path.write_bytes(b"half")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    SnapshotStore(folder)
    assert os.listdir(folder) == [live.name]


# -- 7. one bad sidecar costs one warning, never a 500 --------------------------------------


def test_a_bad_created_value_is_skipped_with_one_warning_per_file(tmp_path, caplog):
    folder = private_folder(tmp_path / "snaps")
    sidecar = plant(folder, "20260101T000000Z-0000000a", created="yesterday")
    nan = plant(folder, "20260101T000000Z-0000000b", created=math.nan)
    client, _ = demo_app(folder)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert listed_ids(client) == []
        for _ in range(2):
            assert client.post("/snapshot", headers=AUTH).status_code == 201
        assert len(listed_ids(client)) == 2
    for bad in (sidecar, nan):
        warnings = [r for r in caplog.records if bad.name in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
        assert bad.exists()  # skipped, not deleted: it may say why something went wrong
    assert len(os.listdir(folder)) == 4 + 2 * 2


def test_recording_entries_of_dead_writers_are_settled_at_start(tmp_path):
    folder = private_folder(tmp_path / "snaps")
    dead_pid = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], text=True, capture_output=True
        ).stdout
    )
    no_data = plant(
        folder,
        "20260101T000000Z-0000000a",
        data=None,
        status="recording",
        meta={"writer_pid": dead_pid},
    )
    with_data = plant(
        folder,
        "20260101T000000Z-0000000b",
        data=b"complete",
        status="recording",
        meta={"writer_pid": dead_pid},
    )
    store = SnapshotStore(folder)
    assert json.loads(no_data.read_text())["status"] == "failed"
    assert json.loads(with_data.read_text())["status"] == "ready"  # its data was complete
    assert {i.status for i in store.list()} == {"failed", "ready"}
    assert_exactly_the_index(folder, store)


def test_a_restart_adopts_unindexed_data_and_drops_entries_without_data(tmp_path):
    folder = private_folder(tmp_path / "snaps")
    unindexed = plant(folder, "20260101T000000Z-0000000a", data=b"complete")
    unindexed.unlink()  # killed between the data's rename and its sidecar's
    no_data = plant(folder, "20260101T000000Z-0000000b", data=None)  # killed mid-delete
    store = SnapshotStore(folder)
    (adopted,) = store.list()
    assert adopted.id == "20260101T000000Z-0000000a" and adopted.trigger == "api"
    assert adopted.size_bytes == len(b"complete") and adopted.status == "ready"
    assert adopted.created == (folder / adopted.filename).stat().st_mtime
    assert not no_data.exists()
    assert_exactly_the_index(folder, store)


def test_retention_counts_failed_captures_and_other_processes_entries(tmp_path):
    folder = private_folder(tmp_path / "snaps")
    ours, other = SnapshotStore(folder, max_count=3), SnapshotStore(folder, max_count=3)
    ours.fail(ours.reserve("record"), "the window's dump failed")
    for _ in range(2):
        other.write({"segments": []}, "api")  # another process of the server
    ours.write({"segments": []}, "api")
    assert len(ours.list()) == 3 and [i.status for i in ours.list()].count("failed") == 0
    assert_exactly_the_index(folder, ours)


def test_a_snapshot_file_is_named_after_its_host_pod_process_and_rank(tmp_path, monkeypatch):
    """Files from several pods and ranks can be gathered in one folder without clashing."""
    monkeypatch.setenv("POD_NAME", "llama-0")
    monkeypatch.setenv("RANK", "3")
    store = SnapshotStore(tmp_path / "snaps")
    info = store.reserve("manual")
    assert info.filename.startswith(f"{socket.gethostname()}_llama-0_pid{os.getpid()}_rank3_")
    assert info.filename.endswith(f"_{info.id}_manual.pickle")
