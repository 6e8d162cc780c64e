"""Find the helper that serves a port, or start it: what exporter.start() does in a server.

One helper serves one port for one user (exporter.helper). Its folder is
`gpumem-helper-<uid>-<port>`, 0700, in a place of this user's that no other user can take
(private_base): several workers calling start() with one port find the same folder and the
first starts the helper; the others join it (`start.lock` makes them wait in turn, so 64 at
once start one helper). A folder of another user, or one open to others, is refused: its
socket would take this process's allocator readings and admin commands. Port 0 asks for a
port of its own: a fresh folder, never joined.

The helper is a fresh interpreter (`sys.executable -m exporter.helper FOLDER`): a server
that holds a CUDA context is never forked. It says on its stdout, in one JSON line, the URL it
serves or why it cannot (a taken port); the starter reaps it when it leaves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import secrets
import select
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exporter import atomic
from exporter.config import SECRETS, SETTINGS, Config, public_settings
from exporter.port_holder import port_taken
from exporter.transport.agent import SOCKET_NAME
from exporter.transport.folder import LOCK_NAME, fits

HELPER_PREFIX = "gpumem-helper-"
START_LOCK = "start.lock"  # held by whoever looks for or starts the helper
HELPER_LOCK = LOCK_NAME  # held by the helper for as long as it lives (serving.hold_lock)
SETTINGS_NAME = "helper.json"  # the helper's settings, secrets left out
URL_NAME = "url"  # what the helper serves, written once it listens
# How long start() waits for the others starting at once, then for the helper to listen.
START_TIMEOUT_S = 20.0
SECRET_DIGESTS_NAME = "secrets.sha256"  # salted digests: whether a joiner's secrets match
# Settings that are each process's own choice of how to find the helper, not the helper's.
HOW_FOUND = frozenset({"helper_dir", "helper_spawn", "port_per_local_rank"})


class JoinError(Exception):
    """No helper: why, in one line (on the handle and in the log)."""


@dataclass
class Helper:
    folder: Path
    url: str
    process: subprocess.Popen[bytes] | None  # None: joined, another process started it
    restarted: bool  # an earlier helper of this folder died without leaving it clean
    # What the helper runs with that this process asked otherwise (joined: not applied).
    differences: list[str] = dataclasses.field(default_factory=list)


def join_or_start(config: Config, *, timeout_s: float = START_TIMEOUT_S) -> Helper:
    """The helper serving `config.port` for this user: joined, or started. JoinError if
    neither (a taken port, a refused folder, a helper that does not answer in time)."""
    deadline = time.monotonic() + timeout_s
    sweep(base(config))
    if config.port == 0:
        prefix = f"{HELPER_PREFIX}{os.getuid()}-0-"
        folder = Path(tempfile.mkdtemp(prefix=prefix, dir=base(config)))
    else:
        folder = folder_for(config)
    lock = _take_start_lock(folder, deadline)
    try:
        url = _live_helpers_url(folder, deadline) if config.port else None
        if url is not None:
            return Helper(folder, url, None, False, settings_differences(folder, config))
        if not config.helper_spawn:
            raise JoinError(
                f"no helper serves port {config.port} in {folder} (helper_spawn is off)"
            )
        taken = port_taken(config.host, config.port) if config.port else None
        if taken is not None:  # said without starting a helper that would say the same
            shutil.rmtree(folder, ignore_errors=True)  # nothing of it left behind
            raise JoinError(taken)
        restarted = (folder / URL_NAME).exists()  # a helper died and left its URL behind
        for name in (SOCKET_NAME, URL_NAME):
            with contextlib.suppress(FileNotFoundError):
                (folder / name).unlink()
        write_settings(folder, config)
        process = _spawn(folder, config)
        answer = _report(process, deadline)
        if "url" not in answer:
            _end(process)
            shutil.rmtree(folder, ignore_errors=True)  # nothing of it left behind
            raise JoinError(str(answer.get("error", "the helper did not start")))
        threading.Thread(target=process.wait, name="gpumem-helper-reaper", daemon=True).start()
        return Helper(folder, str(answer["url"]), process, restarted)
    finally:
        os.close(lock)


def write_settings(folder: Path, config: Config) -> None:
    """What the helper runs with, for it and for the processes that join it later: its
    settings (secrets left out) and a salted digest of each secret."""
    atomic.write_bytes(folder / SETTINGS_NAME, json.dumps(public_settings(config)).encode())
    salt = secrets.token_hex(16)
    digests = {name: _digest(salt, getattr(config, name)) for name in sorted(SECRETS)}
    atomic.write_bytes(
        folder / SECRET_DIGESTS_NAME, json.dumps({"salt": salt, "digests": digests}).encode()
    )


def _digest(salt: str, value: object) -> str:
    return hashlib.sha256(f"{salt}:{value or ''}".encode()).hexdigest()


def settings_differences(folder: Path, config: Config) -> list[str]:
    """What the helper in `folder` runs with that `config` asks otherwise, in words (a
    secret only by name); [] where its files say nothing."""
    try:
        theirs = json.loads((folder / SETTINGS_NAME).read_text())
        kept = json.loads((folder / SECRET_DIGESTS_NAME).read_text())
    except (OSError, ValueError):
        return []
    ours = public_settings(config)
    found = [
        f"{name} is {theirs[name]!r}, not {ours[name]!r}"
        for name in sorted(ours)
        if name in theirs and name not in HOW_FOUND and theirs[name] != ours[name]
    ]
    salt, digests = str(kept.get("salt", "")), kept.get("digests", {})
    for name in sorted(SECRETS):
        if name in digests and digests[name] != _digest(salt, getattr(config, name)):
            found.append(f"{name} differs")
    return found


# A folder of a dead helper younger than this may be its starter's, between mkdir and spawn.
SWEEP_AFTER_S = 60.0


def sweep(where: str) -> None:
    """Remove this user's helper folders whose helper is dead (SIGKILL leaves its folder) and
    that nobody is starting one in: port 0's fresh folders would pile up otherwise."""
    for folder in Path(where).glob(f"{HELPER_PREFIX}{os.getuid()}-*"):
        try:
            info = folder.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if time.time() - info.st_mtime < SWEEP_AFTER_S or alive(folder):
            continue
        remove_unless_starting(folder)


def remove_unless_starting(folder: Path) -> None:
    """Remove a helper folder, unless a start() is in it right now (it holds the start lock,
    and starts the next helper there)."""
    try:
        fd = os.open(folder / START_LOCK, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        shutil.rmtree(folder, ignore_errors=True)
        return
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        shutil.rmtree(folder, ignore_errors=True)  # under its start lock: nobody inside
    except BlockingIOError:
        pass
    finally:
        os.close(fd)


def base(config: Config) -> str:
    """Where helper folders live: `helper_dir` (a volume shared with a sidecar), else this
    user's private place (private_base)."""
    return config.helper_dir or private_base()


PRIVATE_PREFIX = "gpumem-"  # + uid-creation us-random: this user's place in the temp dir


def private_base() -> str:
    """A folder of this user's that another local user can neither make first nor enter:
    `$XDG_RUNTIME_DIR` where it is this user's and closed to others (systemd's per-user
    runtime folder), else a folder of this user's in the temp dir, found by its owner and
    mode, never by a name others could take first. (A predictable name in a shared /tmp
    was taken by one `mkdir` of another user, and the server went unserved.)

    The temp dir's place is `gpumem-<uid>-<microseconds>-<random>`, 0700: every process of
    this user takes the oldest such folder that is this user's own, a real folder, closed to
    others (lstat: no link followed); the first one makes it. Two first ones at once each
    make one, then both take the older; the other is removed."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime) and _own_and_closed(runtime) and _fits(runtime):
        return runtime
    where = tempfile.gettempdir()
    if not _fits(os.path.join(where, f"{PRIVATE_PREFIX}{os.getuid()}-{2**53}-12345678")):
        where = "/tmp"
    found = _oldest_private(where)
    if found is not None:
        return found
    prefix = f"{PRIVATE_PREFIX}{os.getuid()}-{time.time_ns() // 1000}-"
    made = tempfile.mkdtemp(prefix=prefix, dir=where)  # 0700, a name nobody can guess
    oldest = _oldest_private(where) or made
    if oldest != made:
        with contextlib.suppress(OSError):
            os.rmdir(made)  # another process made one first: its place is ours too
    return oldest


def _own_and_closed(path: str) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077


def _fits(where: str) -> bool:
    """Whether a helper's socket path there fits the 107 bytes a Unix socket's path may have."""
    return fits(where, f"{HELPER_PREFIX}{os.getuid()}-0-12345678")


def _oldest_private(where: str) -> str | None:
    """This user's oldest private place in `where` (its name says when it was made)."""
    prefix = f"{PRIVATE_PREFIX}{os.getuid()}-"
    found = []
    try:
        entries = list(os.scandir(where))
    except OSError:
        return None
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        made, _, _ = entry.name[len(prefix) :].partition("-")
        if made.isdigit() and _own_and_closed(entry.path):
            found.append((int(made), entry.name, entry.path))
    return min(found)[2] if found else None


def folder_for(config: Config) -> Path:
    """The helper folder of `config.port` for this user (not for port 0: a fresh one each)."""
    return Path(base(config)) / f"{HELPER_PREFIX}{os.getuid()}-{config.port}"


def alive(folder: Path) -> bool:
    """Whether a helper holds the folder's lock: the kernel drops it when the helper dies,
    however it dies."""
    try:
        fd = os.open(folder / HELPER_LOCK, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def private_folder(folder: Path) -> None:
    """Make `folder` (0700), or check the one there: this user's, a real folder, closed to
    others. JoinError otherwise."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    try:
        info = os.lstat(folder)
    except OSError as exc:
        raise JoinError(f"helper folder {folder}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise JoinError(f"helper folder {folder} is not a folder: refused")
    if info.st_uid != os.getuid():
        raise JoinError(
            f"helper folder {folder} belongs to uid {info.st_uid}, not {os.getuid()}: refused "
            "(another user's helper serves this port?)"
        )
    if info.st_mode & 0o077:
        raise JoinError(f"helper folder {folder} is open to other users: refused")


def _take_start_lock(folder: Path, deadline: float) -> int:
    """The folder's start lock, once the others starting at once are done. The lock is on the
    file in the folder as it is now: a helper that removed the folder as it left makes this
    take the new one's."""
    while True:
        private_folder(folder)
        try:
            fd = os.open(folder / START_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            continue  # removed between the check and the open: make it again
        except OSError as exc:
            raise JoinError(f"helper folder {folder}: {exc.strerror or exc}") from None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise JoinError(
                        f"helper folder {folder}: still locked by another start"
                    ) from None
                time.sleep(0.02)
        try:
            same = os.fstat(fd).st_ino == os.stat(folder / START_LOCK).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _live_helpers_url(folder: Path, deadline: float) -> str | None:
    """The URL of the helper that lives in the folder, or None if none does. A live one with
    no URL is leaving (its starter held the start lock until it listened): wait it out."""
    while alive(folder):
        try:
            return (folder / URL_NAME).read_text().strip()
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise JoinError(f"the helper in {folder} neither serves nor leaves") from None
            time.sleep(0.02)
    return None


def _spawn(folder: Path, config: Config) -> subprocess.Popen[bytes]:
    # Not the server's multiprocess folder: the helper's series are its own registry's, and
    # must not land among the files the server's MultiProcessCollector serves.
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    for name in SECRETS:
        value = getattr(config, name)
        key = SETTINGS[name].env(name)
        if value:
            env[key] = str(value)
        else:
            env.pop(key, None)
    # The package this process imported, wherever it came from (a checkout on sys.path).
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "exporter.helper", str(folder)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
            # Not in the server's process group: a Ctrl-C or a group signal meant for the
            # server does not hit it mid-scrape; it leaves when the server's agents are gone.
            start_new_session=True,
        )
    except OSError as exc:
        raise JoinError(f"cannot start the helper: {exc.strerror or exc}") from None


def _report(process: subprocess.Popen[bytes], deadline: float) -> dict[str, Any]:
    """The helper's one line: {"url": ...} or {"error": ...}; an error if it says nothing."""
    assert process.stdout is not None
    data = b""
    with process.stdout:
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0:
                return {"error": "the helper did not answer in time"}
            ready, _, _ = select.select([process.stdout], [], [], left)
            if not ready:
                continue
            chunk = os.read(process.stdout.fileno(), 4096)
            if not chunk:
                code = process.wait()
                return {"error": f"the helper exited with status {code} before it served"}
            data += chunk
    try:
        answer = json.loads(data.partition(b"\n")[0])
    except ValueError:
        return {"error": "the helper said something else than its URL"}
    return answer if isinstance(answer, dict) else {"error": "the helper's answer is not JSON"}


def _end(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
