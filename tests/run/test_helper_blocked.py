"""What blocks exporter.start()'s helper, and how it ends (issue 63, items 2 and 3): another
local user cannot take the helper's place; a taken folder or port is said on the handle, once
in the log with who holds it, and tried again until the endpoint is served; a helper that
closes the probe's connection at once never raises into the host."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import exporter
from exporter.config import Config
from exporter.run import join
from exporter.run.aggregator import Aggregator
from tests.helpers import free_port
from tests.run.test_helper import answer, metrics, servers, wait_for

NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.getuid() != 0 or shutil.which("setpriv") is None,
    reason="acting as another user needs root and setpriv",
)


def as_nobody(*command: str) -> None:
    """Run `command` as another local user (uid and gid 65534), as an attacker would."""
    subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *command],
        check=True,
    )


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temp folder shared by every user, as /tmp is (1777), short enough for sockets."""
    folder = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def no_runtime_dir(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    return {**env, "TMPDIR": str(tmp)}


@needs_root
def test_another_user_who_makes_the_helpers_old_names_first_cannot_keep_the_server_unserved(
    shared_tmp,
):
    """The folder names another user could make first in a shared temp folder (the one the
    helper used, and one that looks like this user's private place, older than any): one
    `mkdir` each, as uid 65534. The server's start() is served at once all the same."""
    port = free_port()
    uid = os.getuid()
    taken = [
        shared_tmp / f"{join.HELPER_PREFIX}{uid}-{port}",
        shared_tmp / f"{join.PRIVATE_PREFIX}{uid}-1-aaaaaaaa",
    ]
    for path in taken:
        as_nobody("mkdir", "-m", "700", str(path))
    as_nobody("ln", "-s", "/tmp", str(shared_tmp / f"{join.PRIVATE_PREFIX}{uid}-0-link"))
    with servers(port, env=no_runtime_dir(shared_tmp)) as [server]:
        said = answer(server)
        assert said["error"] is None, said
        assert said["url"] == f"http://127.0.0.1:{port}"
        assert "gpumem_exporter_build_info" in metrics(port)
    for path in taken:
        assert path.stat().st_uid == NOBODY  # left as they were, never entered


def test_the_private_place_is_this_users_own_closed_and_shared_by_its_processes(
    shared_tmp, monkeypatch
):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    first = join.private_base()
    info = os.lstat(first)
    assert info.st_uid == os.getuid() and info.st_mode & 0o777 == 0o700
    assert Path(first).parent == shared_tmp
    assert join.private_base() == first  # found again, by its owner, not made anew
    # Two made at once: both take the older one.
    younger = shared_tmp / f"{join.PRIVATE_PREFIX}{os.getuid()}-{time.time_ns()}-zzzzzzzz"
    younger.mkdir(mode=0o700)
    assert join.private_base() == first


def test_a_runtime_folder_of_this_user_is_the_private_place(tmp_path, monkeypatch):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert join.private_base() == str(runtime)
    runtime.chmod(0o755)  # open to others: not private, the temp dir's place instead
    assert join.private_base() != str(runtime)


@needs_root
@pytest.mark.slow
def test_a_helper_folder_another_user_took_is_tried_again_until_it_is_freed(shared_tmp, caplog):
    """helper_dir shared (a volume): another user makes the port's folder first. The handle
    says whose it is, the log says it once, and once it is removed the endpoint is served."""
    port = free_port()
    folder = shared_tmp / f"{join.HELPER_PREFIX}{os.getuid()}-{port}"
    as_nobody("mkdir", "-m", "700", str(folder))
    caplog.set_level(logging.INFO, logger="exporter")
    handle = exporter.start(port=port, interval_s=0.1, helper_dir=str(shared_tmp))
    try:
        assert handle.url is None
        assert handle.error is not None and f"belongs to uid {NOBODY}" in handle.error
        time.sleep(2.5)  # tried again meanwhile, said once
        assert caplog.text.count(f"belongs to uid {NOBODY}") == 1, caplog.text
        folder.rmdir()
        wait_for(lambda: handle.url is not None, "served once the folder was removed", 20.0)
        assert handle.error is None
        assert "gpumem_exporter_build_info" in metrics(port)
    finally:
        exporter.stop()


@pytest.mark.slow
def test_a_port_taken_at_start_up_is_said_with_its_holder_and_served_once_free(caplog):
    port = free_port()
    squatter = socket.create_server(("127.0.0.1", port))
    caplog.set_level(logging.INFO, logger="exporter")
    handle = exporter.start(port=port, interval_s=0.1)
    try:
        assert handle.url is None
        assert handle.error is not None and f"port {port}" in handle.error, handle.error
        assert f"held by uid {os.getuid()}" in handle.error, handle.error
        assert f"pid {os.getpid()}" in handle.error, handle.error
        time.sleep(2.5)
        assert caplog.text.count("already in use") == 1, caplog.text
        squatter.close()
        wait_for(lambda: handle.url is not None, "served once the port was free", 20.0)
        assert handle.error is None
        assert "gpumem_exporter_build_info" in metrics(port)
    finally:
        squatter.close()
        exporter.stop()


@pytest.mark.parametrize("attempt", range(3))
def test_a_helper_that_refuses_the_probe_leaves_the_host_alive_and_says_why(attempt, shared_tmp):
    """A helper whose process slots are all taken accepts the probe's connection and closes
    it at once: start() returns (it raised BrokenPipeError into the host before), and the
    handle says why. A sidecar's folder: a live helper's lock, its URL and its socket."""
    port = free_port()
    config = Config(port=port, helper_dir=str(shared_tmp))
    folder = join.folder_for(config)
    join.private_folder(folder)
    lock = os.open(folder / join.HELPER_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    import fcntl

    fcntl.flock(lock, fcntl.LOCK_EX)
    (folder / join.URL_NAME).write_text(f"http://127.0.0.1:{port}")
    full = Aggregator(folder, max_peers=0)
    try:
        handle = exporter.start(
            port=port, interval_s=0.1, helper_dir=str(shared_tmp), helper_spawn=False
        )
        wait_for(lambda: handle.error is not None, "the refusal on the handle", 5.0)
        assert "process connections are taken" in str(handle.error) or "at once" in str(
            handle.error
        ), handle.error
        assert full.rejected["too_many_connections"] >= 1
    finally:
        exporter.stop()
        full.close()
        os.close(lock)


@pytest.mark.slow
def test_a_host_whose_helper_refuses_it_lives_on():
    """The same, in a server process of its own: it is alive after start() and says why."""
    port = free_port()
    script = f"""
import fcntl, os, sys, tempfile, time
from pathlib import Path
import exporter
from exporter.config import Config
from exporter.run import join
from exporter.run.aggregator import Aggregator
base = tempfile.mkdtemp(dir="/tmp")
folder = join.folder_for(Config(port={port}, helper_dir=base))
join.private_folder(folder)
lock = os.open(folder / join.HELPER_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(lock, fcntl.LOCK_EX)
(folder / join.URL_NAME).write_text("http://127.0.0.1:{port}")
full = Aggregator(folder, max_peers=0)
handle = exporter.start(port={port}, interval_s=0.1, helper_dir=base, helper_spawn=False)
deadline = time.monotonic() + 5
while handle.error is None and time.monotonic() < deadline:
    time.sleep(0.05)
print("alive", handle.error, flush=True)
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(exporter.__file__).parents[1],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("alive the helper did not take this process"), done.stdout


@pytest.mark.slow
def test_a_process_that_joins_a_helper_with_other_settings_is_told_and_can_read_them(caplog):
    """The first server started the helper with full detail and its own admin token; a second
    one asks for basic detail and another token. It gets the helper's (one endpoint, one set
    of settings), and is told: a warning in its log and on its handle, naming each setting
    (a secret by name only), and /stats says which are in force."""
    import json
    import urllib.request

    port = free_port()
    first_token, second_token = "first-" + "a" * 32, "second-" + "b" * 32
    env = {**os.environ, "GPUMEM_DETAIL": "full", "GPUMEM_ADMIN_TOKEN": first_token}
    with servers(port, env=env) as [server]:
        assert answer(server)["error"] is None
        caplog.set_level(logging.INFO, logger="exporter")
        handle = exporter.start(port=port, interval_s=0.1, detail="basic", admin_token=second_token)
        try:
            assert handle.error is None and handle.url == f"http://127.0.0.1:{port}"
            warning = str(handle.warning)
            assert "detail is 'full', not 'basic'" in warning, warning
            assert "admin_token differs" in warning and second_token not in warning
            assert "interval_s" not in warning  # the server's script asks 0.1 too
            assert caplog.text.count("keeps its own settings") == 1
            assert first_token not in caplog.text and second_token not in caplog.text
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/stats",
                headers={"Authorization": f"Bearer {first_token}"},
            )
            with urllib.request.urlopen(request, timeout=5) as response:
                settings = json.loads(response.read())["settings"]
            assert settings["detail"] == "full"
            assert "admin_token" not in settings
        finally:
            exporter.stop()


def test_a_process_that_joins_with_the_same_settings_is_not_warned():
    port = free_port()
    with servers(port) as [server]:
        assert answer(server)["error"] is None
        handle = exporter.start(port=port, interval_s=0.1)
        try:
            assert handle.error is None and handle.warning is None
        finally:
            exporter.stop()
