"""The helper: one process beside a server that serves what its processes' agents send.

exporter.start() leaves only an agent in the serving process (exporter.transport.agent, the
same as `run`'s); this process does the rest: NVML, host and per-process memory, merging the
agents' records, the detectors, /metrics, the admin API and the page. It is `run`'s launcher
without a command (exporter.transport.serving), started by the first start() for a port and
joined by the others (exporter.helper.join).

It leaves LEAVE_AFTER_S after the last process it serves is gone (SIGKILL of a server
included: the kernel closes its socket), or when none came within FIRST_PEER_S, and removes
its folder as it goes. SIGTERM or SIGINT make it leave at once.

    python -m exporter.helper FOLDER      # started by exporter.start()
    python -m exporter.helper --sidecar   # a container of its own (Kubernetes)

As a sidecar its settings are its container's GPUMEM_* variables, its folder is in
GPUMEM_HELPER_DIR (a volume shared with the server's container, whose processes set
GPUMEM_HELPER_SPAWN=0 and join it), and it stays for as long as its container runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exporter import atomic
from exporter.config import SETTINGS, Config, ConfigError, load_config
from exporter.helper import join
from exporter.http.server import ServerStartError
from exporter.sampler import PACED_LATEST
from exporter.transport.agent import SOCKET_NAME
from exporter.transport.aggregator import Aggregator
from exporter.transport.folder import hold_lock
from exporter.transport.serving import serving_runtime

log = logging.getLogger("exporter.helper")

# None of the processes it serves connected this long after it started: its starter is gone.
FIRST_PEER_S = 30.0
# The last process it served left this long ago: the helper leaves too.
LEAVE_AFTER_S = 1.0
# How often it looks whether it still has its folder. Whether it is still needed it is told
# (the aggregator wakes it when a connection opens or closes): looking every 0.1 s cost the
# helper 2 of its 5.7 ms of CPU a second at 1 Hz with a scrape a second, every 0.5 s 0.33 of
# 3.3 (`python -m bench.helper_cpu`, on a CPU-only machine). The look is made on the
# sampler's tick, by the thread already awake for it (FolderLook): a wake-up of its own every
# 2 s cost 0.13 ms/s more. Only a sampler slower than this wakes the main thread to look.
FOLDER_LOOK_S = 2.0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s gpumem-exporter helper[%(process)d] %(levelname)s %(message)s",
    )
    if len(args) != 1:
        print("usage: python -m exporter.helper FOLDER | --sidecar", file=sys.stderr)
        return 2
    sidecar = args[0] == "--sidecar"
    try:
        config = load_config() if sidecar else None
    except ConfigError as exc:
        return _failed(str(exc))
    folder = join.folder_for(config) if config is not None else Path(args[0])
    try:
        join.private_folder(folder)
        lock = hold_lock(str(folder))
    except (join.JoinError, OSError) as exc:
        return _failed(f"cannot hold the helper folder: {exc}")
    try:
        return _serve(folder, config)
    finally:
        if _still_mine(folder, lock):  # not a new helper's, in a folder made again
            _leave(folder)
        os.close(lock)


def _still_mine(folder: Path, lock: int) -> bool:
    try:
        return os.fstat(lock).st_ino == os.stat(folder / join.HELPER_LOCK).st_ino
    except OSError:
        return False


def _started_with(folder: Path) -> Config:
    """The settings exporter.start() wrote for it, and the secrets in its environment."""
    settings = json.loads((folder / join.SETTINGS_NAME).read_text())
    secrets = {SETTINGS[n].env(n): os.environ.get(SETTINGS[n].env(n), "") for n in join.SECRETS}
    return load_config(env=secrets, **settings)


def _serve(folder: Path, sidecar: Config | None) -> int:
    """Serve the folder's agents; `sidecar`: its container's settings, and it stays."""
    try:
        config = sidecar or _started_with(folder)
    except Exception as exc:  # a file its starter wrote: unreadable means a bug or a tamper
        return _failed(f"cannot read its settings: {exc}")
    stop = threading.Event()
    # What the main thread waits on: a stop, or a connection that opened or closed (a signal
    # handler's set() alone would not end a wait already in progress).
    wake = threading.Event()

    def stopped(*_: object) -> None:
        stop.set()
        wake.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stopped)
    with contextlib.ExitStack() as cleanup:
        if sidecar is not None:  # what the processes that join it are told they get
            join.write_settings(folder, config)
        with contextlib.suppress(FileNotFoundError):
            (folder / SOCKET_NAME).unlink()  # a dead helper's: the lock says none lives
        try:
            aggregator = Aggregator(
                folder, silent_after_s=config.stale_threshold_s, on_change=wake.set
            )
        except OSError as exc:
            return _failed(f"cannot open the agents' socket: {exc.strerror or exc}")
        cleanup.callback(aggregator.close)

        def served_pids() -> list[int]:
            return [int(p["pid"]) for p in aggregator.processes() if p.get("pid")]

        runtime, _ = serving_runtime(config, "helper", aggregator, served_pids)
        try:
            http = runtime.server()
        except ServerStartError as exc:
            return _failed(str(exc))
        cleanup.callback(http.stop)
        folder_look = FolderLook(folder, wake, config.interval_s)
        runtime.sampler.listeners.append(folder_look)
        aggregator.pace(runtime.sampler)  # ticks as the processes report (Aggregator.pace)
        cleanup.callback(runtime.sampler.stop)
        http.start()
        atomic.write_bytes(folder / join.URL_NAME, http.url.encode())
        _answer({"url": http.url})
        log.info("serving %s/metrics", http.url)
        if sidecar is not None:
            # A container of its own: until it is told to stop, or its folder goes (then
            # its container restarts it, with a new one).
            socket = str(folder / SOCKET_NAME)
            while not stop.wait(1.0) and _folder_kept(folder, socket):
                pass
            return 0
        _until_unneeded(folder_look, aggregator, stop, wake)
    return 0


class FolderLook:
    """Whether the helper still has its folder, looked at on the sampler's ticks (a listener,
    on the thread that ticks) at most every FOLDER_LOOK_S; `wake` is set once it is gone.
    `on_ticks`: whether a sampler of `interval_s` ticks often enough to look; where it does
    not, the main thread looks on its own timer (_until_unneeded)."""

    def __init__(self, folder: Path, wake: threading.Event, interval_s: float) -> None:
        self.folder, self._wake = folder, wake
        self._socket = str(folder / SOCKET_NAME)
        self.on_ticks = PACED_LATEST * interval_s <= FOLDER_LOOK_S  # its slowest tick
        self.gone = False
        self._looked_at = time.monotonic()

    def __call__(self, _sample: object) -> None:
        if not self.gone and time.monotonic() - self._looked_at >= FOLDER_LOOK_S:
            self.look()

    def look(self) -> None:
        self._looked_at = time.monotonic()
        if not _folder_kept(self.folder, self._socket):
            self.gone = True
            self._wake.set()


def _until_unneeded(
    folder_look: FolderLook, aggregator: Aggregator, stop: threading.Event, wake: threading.Event
) -> None:
    """Until no process has been served for LEAVE_AFTER_S (none came: FIRST_PEER_S), its
    folder is gone, or it is stopped. Woken by the aggregator when a connection opens or
    closes, and by `folder_look` when the folder is gone; where the sampler's ticks are
    too far apart to look (not `folder_look.on_ticks`), it looks every FOLDER_LOOK_S itself."""
    started = time.monotonic()
    left_at: float | None = None  # when the last connection closed; None while one is open
    while not stop.is_set() and not folder_look.gone:
        now = time.monotonic()
        deadline = None
        if aggregator.connections():
            left_at = None
        elif aggregator.admitted:  # one came, and all have left
            left_at = now if left_at is None else left_at
            deadline = left_at + LEAVE_AFTER_S
        else:
            deadline = started + FIRST_PEER_S
        if deadline is not None and now >= deadline:
            log.info("no process left to serve: leaving")
            return
        waits = [deadline - now] if deadline is not None else []
        if not folder_look.on_ticks:
            waits.append(FOLDER_LOOK_S)
        wake.wait(min(waits, default=None))
        wake.clear()
        if not folder_look.on_ticks:
            folder_look.look()


def _folder_kept(folder: Path, socket: str) -> bool:
    """Whether its socket (`socket`, the path in `folder`) is still where agents look for it.
    Someone removed the folder (a temp cleaner): new processes could not join, and would
    start a helper that finds the port taken. Leaving closes every agent's connection: their
    links start a new helper (counted in gpumem_exporter_helper_restarts_total) in a new
    folder."""
    # os.path on a kept string: pathlib's join and stat were 70 us a look on cold caches.
    if os.path.exists(socket):
        return True
    log.warning(
        "its folder %s was removed: leaving, for the agents' links to start a new helper", folder
    )
    return False


def _leave(folder: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (folder / join.URL_NAME).unlink()  # first: a URL left behind means a helper died
    join.remove_unless_starting(folder)


def _failed(reason: str) -> int:
    log.error("%s", reason)
    _answer({"error": reason})
    return 1


def _answer(answer: dict[str, Any]) -> None:
    """The one line its starter waits for; then stdout goes nowhere (the starter closed its
    end: a later print must not raise)."""
    with contextlib.suppress(OSError):
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
