"""`gpumem-exporter run -- CMD ARGS...`: run a server with every Python process instrumented.

The launcher starts the aggregator (a Unix socket in a fresh 0700 folder), NVML, host and
per-process host memory sources and the HTTP endpoint, then CMD with exporter/run/inject first
on PYTHONPATH, so that each Python process of the server loads the agent at start-up, the way
opentelemetry-instrument injects itself. The launcher never uses CUDA: allocator actions fan
out to the agents (FanOutActions), which also run OOM capture, history and remediation with
the launcher's settings (written to the run folder, without the admin token, which the
server's processes never see, nor can read from the launcher: it is not dumpable). The
launcher supervises CMD's whole process tree (exporter.run.supervisor: subreaper, signals to
CMD's process group, one reaper, everything left stopped when CMD ends or the launcher is told
to stop) and exits with CMD's exit status (128 + N if CMD died of signal N). If the launcher
itself is killed, its keeper (exporter.run.reaper) stops CMD and removes the run folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from exporter import atomic
from exporter.config import SETTINGS, Config
from exporter.http.server import ServerStartError
from exporter.run import reaper
from exporter.run.agent import RUN_DIR_ENV
from exporter.run.supervisor import PR_SET_DUMPABLE, Supervisor, prctl
from exporter.sources.kinds import gpu_pids
from exporter.sources.process_memory import describe
from exporter.transport.agent import CONFIG_NAME
from exporter.transport.aggregator import Aggregator
from exporter.transport.folder import LOCK_NAME, hold_lock, socket_base
from exporter.transport.serving import serving_runtime

log = logging.getLogger("exporter.launcher")

INJECT_DIR = Path(__file__).resolve().parent / "inject"
RUN_PREFIX = "gpumem-run-"  # then the launcher's pid


# Secrets of the launcher that the server's processes must not inherit.
WITHHELD = ("GPUMEM_ADMIN_TOKEN", "GPUMEM_ADMIN_TOKEN_FILE")


def withheld(base: Mapping[str, str]) -> dict[str, str]:
    """`base` without the secrets (WITHHELD) that only the launcher may hold."""
    return {k: v for k, v in base.items() if k not in WITHHELD}


def child_environment(config: Config, run_dir: str, base: dict[str, str]) -> dict[str, str]:
    env = withheld(base)
    env[RUN_DIR_ENV] = run_dir
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(INJECT_DIR), base.get("PYTHONPATH")]))
    env["GPUMEM_EXPORTER_PATH"] = str(Path(__file__).resolve().parents[2])
    return env


def write_agent_config(config: Config, run_dir: str) -> None:
    """The settings the agents run with: the launcher's, those declared for agents (no admin
    token, no listening address)."""
    settings = {
        name: getattr(config, name) for name, declared in SETTINGS.items() if declared.agents
    }
    settings["snapshot_dir"] = str(config.snapshot_directory)  # one folder for the pod
    atomic.write_bytes(Path(run_dir) / CONFIG_NAME, json.dumps(settings).encode())


def run(command: Sequence[str], config: Config) -> int:
    supervisor = Supervisor(grace_s=config.stop_grace_s, describe=lambda pid: describe(pid)["role"])
    # First of all: a signal that comes while the launcher sets up is not lost (a stop signal
    # then means the command never starts).
    restore_signals = supervisor.install()
    try:
        return _run(command, config, supervisor)
    finally:
        restore_signals()


def _run(command: Sequence[str], config: Config, supervisor: Supervisor) -> int:
    # The admin token is in this process's environment and memory: not dumpable, so that the
    # server's processes (same uid) can neither read /proc/<launcher>/environ nor ptrace it.
    prctl(PR_SET_DUMPABLE, 0)
    sweep_run_folders()
    with contextlib.ExitStack() as cleanup:  # whatever was set up is undone, on any exit
        # 0700: only this user reaches the socket.
        try:
            run_dir = tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}-", dir=socket_base())
            cleanup.callback(shutil.rmtree, run_dir, ignore_errors=True)
            cleanup.callback(os.close, hold_lock(run_dir))  # the folder's proof of life
            # Stops the command if this process is killed; without the admin token.
            keeper = reaper.start(run_dir, withheld(os.environ), f"{RUN_DIR_ENV}={run_dir}")
            supervisor.spared.add(keeper.pid)
            cleanup.callback(reaper.release, keeper)
            write_agent_config(config, run_dir)
            aggregator = Aggregator(run_dir, silent_after_s=config.stale_threshold_s)
            cleanup.callback(aggregator.close)
        except OSError as exc:  # no process or file to spare, a full or read-only /tmp
            raise ServerStartError(f"cannot set up the run: {exc.strerror or exc}") from None

        runtime, machine = serving_runtime(config, "run", aggregator, supervisor.tree)
        pids = gpu_pids(machine)
        if pids is not None:  # which of the processes it stops still held GPU memory
            supervisor.gpu_pids = pids
        http = runtime.server()  # ServerStartError
        cleanup.callback(http.stop)
        aggregator.pace(runtime.sampler)  # ticks as the processes report (Aggregator.pace)
        cleanup.callback(runtime.sampler.stop)
        http.start()
        log.info("gpumem-exporter run: serving %s/metrics for %s", http.url, " ".join(command))

        try:
            pid = supervisor.spawn(command, child_environment(config, run_dir, dict(os.environ)))
        except OSError as exc:
            log.error("cannot start %s: %s", command[0], exc.strerror or exc)
            return 127 if isinstance(exc, FileNotFoundError) else 126
        if pid is None:
            signum = supervisor.stop_signal or signal.SIGTERM
            log.info("stopped by %s before the command started", signal.Signals(signum).name)
            return 128 + signum
        with contextlib.suppress(psutil.Error, OSError):  # gone already: nothing to guard
            reaper.watch(psutil.Process(pid), keeper)
        return supervisor.wait()


# A folder without its lock yet may be a launcher between mkdtemp and flock: spared this long.
NEW_FOLDER_S = 60.0


def folder_in_use(folder: Path) -> bool:
    """Whether a live launcher holds the folder's lock (a new folder not locked yet counts)."""
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        try:
            return time.time() - folder.lstat().st_mtime < NEW_FOLDER_S
        except OSError:
            return False
    except OSError:
        return True  # cannot tell: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops a lock taken here
    return False


def sweep_run_folders() -> None:
    """Remove run folders of this user left by launchers that are gone (one killed together
    with its keeper, e.g. by `kill -9 -PGID`). Liveness is the launcher's own lock on its
    folder, so no launcher removes another's, whatever PID namespace either runs in."""
    bases = {tempfile.gettempdir(), socket_base()}  # it may have fallen back to /tmp
    for folder in (f for base in bases for f in Path(base).glob(f"{RUN_PREFIX}*-*")):
        try:
            info = folder.lstat()
        except OSError:
            continue
        mine = info.st_uid == os.getuid() and stat.S_ISDIR(info.st_mode)
        if mine and not folder_in_use(folder):
            shutil.rmtree(folder, ignore_errors=True)
