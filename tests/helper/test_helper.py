"""exporter.start()'s helper process (exporter.helper: process, join, link): servers that call
start() in processes of their own, killed and forked as real ones are; the helper found through
the processes and folders it leaves (or not); what blocks it (another user, a taken port, a
helper that refuses) and how that ends."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

import exporter
from exporter.config import Config
from exporter.helper import join
from exporter.transport.agent import SOCKET_NAME
from exporter.transport.aggregator import Aggregator
from tests.helpers import close_pipes, free_port, kill_process, require_module

# A server: start() at argv[1]'s port, say what the handle says, then idle (or fork first).
SERVER = textwrap.dedent(
    """
    import json, os, sys, time
    import exporter
    port = int(sys.argv[1])

    def say(what):  # one write a line: a forked parent and child share this pipe
        os.write(1, (json.dumps(what) + "\\n").encode())

    handle = exporter.start(port=port, interval_s=0.1)
    if len(sys.argv) > 2 and sys.argv[2] == "fork":
        child = os.fork()
        if child == 0:  # a pre-forking server's worker: its own start() joins anew
            again = exporter.start(port=port, interval_s=0.1)
            say({"pid": os.getpid(), "url": again.url})
            time.sleep(600)
            os._exit(0)
    web = [m for m in ("fastapi", "uvicorn", "prometheus_client", "psutil") if m in sys.modules]
    said = {"pid": os.getpid(), "url": handle.url, "error": handle.error, "web": web}
    say(said)
    time.sleep(600)
    """
)


def helpers(port: int) -> list[psutil.Process]:
    """The helper processes of this user serving `port` (their folder names it)."""
    folder = f"{join.HELPER_PREFIX}{os.getuid()}-{port}"
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "exporter.helper" in cmdline and any(folder in part for part in cmdline):
            found.append(process)
    return found


def folder_of(port: int) -> Path:
    return join.folder_for(Config(port=port))


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@contextmanager
def servers(
    port: int, count: int = 1, *extra: str, env: dict[str, str] | None = None
) -> Iterator[list[subprocess.Popen[str]]]:
    """`count` servers started at once, each with its handle's answer read; all killed after."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SERVER, str(port), *extra],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(exporter.__file__).parents[1],
            env=env,
        )
        for _ in range(count)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
            close_pipes(proc)


def answer(proc: subprocess.Popen[str]) -> dict:
    assert proc.stdout is not None
    return dict(json.loads(proc.stdout.readline()))


def test_a_process_that_called_start_owns_no_listening_socket_and_its_sigkill_leaves_nothing():
    port = free_port()
    with servers(port) as [server]:
        said = answer(server)
        assert said["error"] is None and said["url"] == f"http://127.0.0.1:{port}"
        assert said["web"] == []  # the probe's modules only: no web stack in the server
        assert "gpumem_exporter_build_info" in metrics(port)
        listening = [
            c for c in psutil.Process(server.pid).net_connections("all") if c.status == "LISTEN"
        ]
        assert listening == []
        [helper] = helpers(port)
        assert helper.pid != server.pid
        server.send_signal(signal.SIGKILL)
        server.wait()
        began = time.monotonic()
        wait_for(lambda: not helpers(port), "the helper outlived its only process by 5 s", 5.0)
        left_after = time.monotonic() - began
    assert not folder_of(port).exists()
    assert left_after < 5.0


def test_a_server_with_uvloop_installed_is_served():
    """vLLM and `uvicorn[standard]` install uvloop, and uvicorn's default loop is uvloop
    wherever it is installed: under it the helper accepted every scrape and dropped it (the
    guard is built on asyncio's transports). The test environment has uvloop, as theirs does;
    the helper serves on asyncio's own loop."""
    require_module("uvloop", "uvloop")
    port = free_port()
    with servers(port) as [server]:
        assert answer(server)["error"] is None
        for _ in range(3):  # kept-alive or not, each answered
            assert "gpumem_exporter_build_info" in metrics(port)


def test_workers_with_one_port_share_one_helper_that_leaves_with_the_last():
    port = free_port()
    with servers(port, 3) as procs:
        urls = {answer(p)["url"] for p in procs}
        assert urls == {f"http://127.0.0.1:{port}"}
        assert len(helpers(port)) == 1
        # Every worker is a process of the one endpoint (its host memory, by pid).
        wait_for(
            lambda: all(f'pid="{p.pid}"' in metrics(port) for p in procs),
            "every worker on the one /metrics",
        )
        procs[0].kill()
        procs[0].wait()
        time.sleep(2.0)  # longer than the helper waits after the last one
        assert len(helpers(port)) == 1, "the helper left while two workers still use it"
        for proc in procs[1:]:
            proc.kill()
            proc.wait()
        wait_for(lambda: not helpers(port), "the helper outlived the last worker", 5.0)


@pytest.mark.slow
def test_64_workers_starting_at_once_get_one_helper():
    port = free_port()
    with servers(port, 64) as procs:
        said = [answer(p) for p in procs]
        assert {s["error"] for s in said} == {None}, said
        assert {s["url"] for s in said} == {f"http://127.0.0.1:{port}"}
        assert len(helpers(port)) == 1
        wait_for(
            lambda: metrics(port).count("host_process_resident_memory_bytes{") == 64,
            "all 64 on /metrics",
            20.0,
        )


def test_a_helper_that_dies_is_started_again_and_counted():
    port = free_port()
    with servers(port) as [server]:
        answer(server)
        [first] = helpers(port)
        first.kill()
        first.wait(5)

        def restarted() -> bool:
            try:
                return "\ngpumem_exporter_helper_restarts_total{" in metrics(port)
            except OSError:
                return False

        wait_for(restarted, "a new helper, and the restart on /metrics", 15.0)
        [second] = helpers(port)
        assert second.pid != first.pid
        text = metrics(port)
        line = next(
            x for x in text.splitlines() if x.startswith("gpumem_exporter_helper_restarts_total")
        )
        assert line.endswith(" 1.0"), line


def test_a_helper_told_to_stop_stops_at_once_while_it_serves():
    """SIGTERM ends the helper's wait for its processes to leave (it waits to be told of a
    departure, and looks at its folder only every FOLDER_LOOK_S): gone in well under that."""
    from exporter.helper import process as helper_process

    port = free_port()
    with servers(port) as [server]:
        answer(server)
        [helper] = helpers(port)
        started = time.monotonic()
        helper.send_signal(signal.SIGTERM)
        helper.wait(helper_process.FOLDER_LOOK_S)
        assert time.monotonic() - started < helper_process.FOLDER_LOOK_S / 2


def test_the_helper_is_told_its_last_process_left_and_leaves_after_leave_after_s(
    run_dir, monkeypatch
):
    """The helper does not look whether it is still needed: the aggregator wakes it when a
    connection closes, and it leaves LEAVE_AFTER_S later. Its folder look is put off here
    (60 s), so that only the wake can end the wait in time."""
    import threading

    from exporter.helper import process as helper_process

    monkeypatch.setattr(helper_process, "FOLDER_LOOK_S", 60.0)
    wake, stop = threading.Event(), threading.Event()
    aggregator = Aggregator(run_dir, on_change=wake.set)
    try:
        agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        agent.connect(str(run_dir / SOCKET_NAME))
        wait_for(lambda: aggregator.connections() == 1, "the connection taken", 5.0)
        waiting = threading.Thread(
            target=helper_process._until_unneeded,
            # A sampler too slow to look on its ticks: the main thread's (put-off) timer.
            args=(helper_process.FolderLook(run_dir, wake, 3600.0), aggregator, stop, wake),
        )
        waiting.start()
        time.sleep(0.3)
        assert waiting.is_alive()  # one process served: it stays
        left = time.monotonic()
        agent.close()
        waiting.join(helper_process.LEAVE_AFTER_S + 2.0)
        assert not waiting.is_alive(), "still waiting after its last process left"
        assert time.monotonic() - left >= helper_process.LEAVE_AFTER_S
    finally:
        stop.set()
        wake.set()
        aggregator.close()


def test_a_folder_of_another_user_is_refused(caplog, tmp_path):
    """A helper folder for the port that another user made: never joined (its socket would
    take this process's readings and commands), and the handle says why."""
    if os.getuid() != 0:
        pytest.skip("making a folder of another user needs root")
    port = free_port()
    folder = tmp_path / f"{join.HELPER_PREFIX}{os.getuid()}-{port}"
    folder.mkdir(mode=0o700)
    os.chown(folder, 65534, 65534)
    handle = exporter.start(port=port, interval_s=0.1, helper_dir=str(tmp_path))
    try:
        assert handle.url is None
        assert handle.error is not None and "belongs to uid 65534" in handle.error
        assert "refused" in caplog.text
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1)
    finally:
        exporter.stop()


def test_a_folder_open_to_others_is_refused(tmp_path):
    port = free_port()
    folder = tmp_path / f"{join.HELPER_PREFIX}{os.getuid()}-{port}"
    folder.mkdir()
    folder.chmod(0o777)
    handle = exporter.start(port=port, interval_s=0.1, helper_dir=str(tmp_path))
    try:
        assert handle.error is not None and "open to other users" in handle.error
    finally:
        exporter.stop()


def test_a_fork_after_start_keeps_the_helper_for_the_child_and_leaves_with_both():
    """A pre-forking server: the child lets go of the parent's connection and joins anew, so
    the helper serves both, stays while either lives, and leaves when both are gone."""
    port = free_port()
    with servers(port, 1, "fork") as [server]:
        first, second = answer(server), answer(server)
        child = first["pid"] if first["pid"] != server.pid else second["pid"]
        assert child != server.pid
        wait_for(lambda: f'pid="{child}"' in metrics(port), "the child on /metrics")
        server.kill()
        server.wait()
        time.sleep(2.0)
        assert len(helpers(port)) == 1, "the helper left while the forked child lives"
        os.kill(child, signal.SIGKILL)
        wait_for(lambda: not helpers(port), "the helper outlived parent and child", 5.0)


def test_a_sidecar_helper_is_joined_never_replaced_and_stays():
    """Kubernetes: the helper in a container of its own (GPUMEM_HELPER_DIR a shared volume),
    the server's processes with GPUMEM_HELPER_SPAWN=0. A probe that starts before it says so
    on its handle and connects once it serves; the sidecar stays when the server goes, and
    leaves clean on SIGTERM."""
    import tempfile

    port = free_port()
    shared = tempfile.mkdtemp(prefix="gpumem-shared-")
    env = dict(os.environ, GPUMEM_HELPER_DIR=shared, GPUMEM_PORT=str(port))
    server_env = dict(env, GPUMEM_HELPER_SPAWN="0")
    root = Path(exporter.__file__).parents[1]
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port)],
        stdout=subprocess.PIPE,
        text=True,
        env=server_env,
        cwd=root,
    )
    sidecar = None
    try:
        said = answer(server)
        assert said["url"] is None and "no helper serves port" in said["error"]
        assert helpers(port) == []  # the probe started none
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "exporter.helper", "--sidecar"], env=env, cwd=root
        )
        wait_for(lambda: f'pid="{server.pid}"' in metrics_or_empty(port), "the probe joined", 15.0)
        server.kill()
        server.wait()
        time.sleep(2.0)
        assert sidecar.poll() is None, "the sidecar left with the server"
        sidecar.send_signal(signal.SIGTERM)
        assert sidecar.wait(10) == 0
        assert os.listdir(shared) == []
    finally:
        kill_process(server)
        if sidecar is not None and sidecar.poll() is None:
            sidecar.kill()
            sidecar.wait()


def metrics_or_empty(port: int) -> str:
    try:
        return metrics(port)
    except OSError:
        return ""


def test_a_removed_folder_makes_the_helper_leave_and_the_probe_start_a_new_one():
    """A temp cleaner removed the helper's folder: new workers could not join it. The helper
    leaves, and the probe starts a new helper in a new folder (counted)."""
    import shutil

    port = free_port()
    with servers(port) as [server]:
        answer(server)
        [first] = helpers(port)
        shutil.rmtree(folder_of(port))
        first.wait(5)  # it left
        wait_for(
            lambda: "\ngpumem_exporter_helper_restarts_total{" in metrics_or_empty(port),
            "a new helper, its restart on /metrics",
            15.0,
        )
        [second] = helpers(port)
        assert second.pid != first.pid
        assert (folder_of(port) / SOCKET_NAME).exists()


def test_the_helper_keeps_out_of_the_servers_multiprocess_folder(tmp_path):
    """A server with PROMETHEUS_MULTIPROC_DIR (vLLM): the helper has its own registry, and
    is not told the folder whose files the server's /metrics serves."""
    port = free_port()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    with servers(port, env=env) as [server]:
        answer(server)
        [helper] = helpers(port)
        assert "PROMETHEUS_MULTIPROC_DIR" not in helper.environ()
        assert "gpumem_exporter_build_info" in metrics(port)
    assert list(tmp_path.iterdir()) == []


def test_folders_of_dead_helpers_are_swept_by_the_next_start(run_dir):
    """A SIGKILLed helper cannot remove its folder: the next start() of this user removes the
    folders no helper holds (not a fresh one, which may be its starter's). In a short folder:
    a socket's path has at most 107 bytes, which pytest's own temp paths pass under xdist."""
    dead = run_dir / f"{join.HELPER_PREFIX}{os.getuid()}-0-dead"
    fresh = run_dir / f"{join.HELPER_PREFIX}{os.getuid()}-0-fresh"
    for folder in (dead, fresh):
        folder.mkdir(mode=0o700)
        (folder / join.HELPER_LOCK).touch()  # nobody holds it
        (folder / join.URL_NAME).write_text("http://127.0.0.1:1\n")
    old = time.time() - 2 * join.SWEEP_AFTER_S
    os.utime(dead, (old, old))
    handle = exporter.start(port=0, interval_s=0.1, helper_dir=str(run_dir))
    try:
        assert handle.error is None
        assert not dead.exists() and fresh.exists()
    finally:
        exporter.stop()


# -- what blocks the helper, and how it ends (issue 63, items 2-4) ----------------------------

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


def test_a_runtime_folder_of_this_user_is_the_private_place(shared_tmp, monkeypatch):
    runtime = shared_tmp / "run"  # short: a socket's path there must fit its 107 bytes
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert join.private_base() == str(runtime)
    runtime.chmod(0o755)  # open to others: not private, the temp dir's place instead
    assert join.private_base() != str(runtime)


def said_once_then_served(
    handle: Any, caplog: Any, reason: str, clear: Callable[[], None], port: int
) -> None:
    """What blocks the helper is on the handle and logged once while it is tried again;
    once `clear()` removes it, the endpoint is served and the handle says so."""
    assert handle.url is None
    assert reason in str(handle.error), handle.error
    time.sleep(2.5)  # tried again meanwhile
    assert caplog.text.count(reason) == 1, caplog.text
    clear()
    wait_for(lambda: handle.url is not None, "served once the obstacle was gone", 20.0)
    assert handle.error is None
    assert "gpumem_exporter_build_info" in metrics(port)


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
        said_once_then_served(handle, caplog, f"belongs to uid {NOBODY}", folder.rmdir, port)
    finally:
        exporter.stop()


@pytest.mark.slow
def test_a_port_taken_at_start_up_is_said_with_its_holder_and_served_once_free(caplog):
    port = free_port()
    squatter = socket.create_server(("127.0.0.1", port))
    caplog.set_level(logging.INFO, logger="exporter")
    handle = exporter.start(port=port, interval_s=0.1)
    try:
        holder = f"port {port} on 127.0.0.1 is already in use (held by uid {os.getuid()}"
        assert f"pid {os.getpid()})" in str(handle.error), handle.error
        said_once_then_served(handle, caplog, holder, squatter.close, port)
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
from exporter.helper import join
from exporter.transport.aggregator import Aggregator
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


# A server on the torch double (tests/support/fake_torch: torch's lazy initialization queue
# as torch has it): start() before CUDA is up, then the first allocation runs out of memory.
FIRST_ALLOCATION_OOM = textwrap.dedent(
    """
    import json, sys, time, urllib.request
    sys.path.insert(0, sys.argv[2])
    import torch
    import exporter
    port = int(sys.argv[1])
    handle = exporter.start(port=port, interval_s=1.0)
    assert not torch.cuda.is_initialized()
    try:
        torch._fake_oom(0)  # the process's first allocation: CUDA starts, then it fails
    except torch.cuda.OutOfMemoryError:
        pass
    oom_at = time.monotonic()
    seen = None
    while time.monotonic() - oom_at < 10 and seen is None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        lines = [l for l in text.splitlines() if l.startswith("torch_cuda_ooms_by_verdict")]
        if lines:
            seen = {"after_s": time.monotonic() - oom_at, "lines": lines}
        time.sleep(0.02)
    print(json.dumps(seen), flush=True)
    """
)


def test_an_oom_in_the_first_allocation_right_after_start_gets_its_verdict_at_once():
    """Issue 63 item 1: the OOM observer was attached at the agent's first full tick after the
    process had used CUDA, so an OOM in that first interval (a server's start-up) got no
    verdict, ever. It is attached inside CUDA's initialization now (exporter.cuda_init), and
    the verdict's full sample goes at once. The real torch: tests/gpu/test_gpu_oom_at_start.py."""
    port = free_port()
    fake = str(Path(exporter.__file__).parents[1] / "tests" / "support" / "fake_torch")
    done = subprocess.run(
        [sys.executable, "-c", FIRST_ALLOCATION_OOM, str(port), fake],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(exporter.__file__).parents[1],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen is not None, "no verdict on /metrics within 10 s of the OOM"
    assert seen["after_s"] < 1.5, seen  # the helper samples at 1 Hz
    assert any(line.endswith(" 1.0") for line in seen["lines"]), seen


def test_a_helper_whose_sampler_ticks_slower_than_its_folder_look_looks_itself(
    run_dir, monkeypatch
):
    """The folder is looked at on the sampler's ticks (FolderLook, a listener). Where ticks
    are further apart than FOLDER_LOOK_S, the main thread looks on its own timer: a removed
    folder still ends the wait, with a process served and no tick at all."""
    import threading

    from exporter.helper import process as helper_process

    monkeypatch.setattr(helper_process, "FOLDER_LOOK_S", 0.2)
    wake, stop = threading.Event(), threading.Event()
    aggregator = Aggregator(run_dir, on_change=wake.set)
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        agent.connect(str(run_dir / SOCKET_NAME))
        wait_for(lambda: aggregator.connections() == 1, "the connection taken", 5.0)
        look = helper_process.FolderLook(run_dir, wake, interval_s=1.0)  # 1.5 s > 0.2 s
        assert not look.on_ticks
        waiting = threading.Thread(
            target=helper_process._until_unneeded, args=(look, aggregator, stop, wake)
        )
        waiting.start()
        time.sleep(0.5)
        assert waiting.is_alive()  # its folder is there and a process is served: it stays
        (run_dir / SOCKET_NAME).unlink()
        waiting.join(2.0)
        assert not waiting.is_alive(), "its folder is gone and it still waits"
        assert look.gone
    finally:
        stop.set()
        wake.set()
        agent.close()
        aggregator.close()


def test_a_tick_looks_at_the_folder_at_most_every_folder_look_s(run_dir, monkeypatch):
    """FolderLook on the sampler's ticks: a look at most every FOLDER_LOOK_S, and the main
    thread woken once the folder is gone."""
    import threading

    from exporter.helper import process as helper_process

    monkeypatch.setattr(helper_process, "FOLDER_LOOK_S", 0.3)
    wake = threading.Event()
    (run_dir / SOCKET_NAME).touch()
    look = helper_process.FolderLook(run_dir, wake, interval_s=0.1)
    assert look.on_ticks
    (run_dir / SOCKET_NAME).unlink()
    look(None)  # a tick right after the last look: not looked at yet
    assert not look.gone and not wake.is_set()
    time.sleep(0.35)
    look(None)
    assert look.gone and wake.is_set()
