"""`gpumem-exporter run -- CMD ARGS...`: run a server with every Python process instrumented.

The launcher starts the aggregator (a Unix socket in a fresh 0700 folder), NVML, host and
per-process host memory sources and the HTTP endpoint, then CMD with exporter/run/inject first
on PYTHONPATH, so that each Python process of the server loads the agent at start-up, the way
opentelemetry-instrument injects itself. The launcher never uses CUDA: allocator actions fan
out to the agents (FanOutActions), which also run OOM capture, history and remediation with
the launcher's settings (written to the run folder, without the admin token, which the
server's processes never see). CMD runs in its own session: every signal the launcher gets
(SIGTERM from Kubernetes, SIGINT from a terminal, ...) is passed on once, and the launcher
exits with CMD's exit status (128 + N if CMD died of signal N). If the launcher itself is
killed, its reaper (exporter.run.reaper) stops CMD and removes the run folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import psutil

from exporter import atomic
from exporter.actions.fanout import FanOutActions
from exporter.actions.snapshots import SnapshotStore
from exporter.config import Config
from exporter.http.server import HttpServer, create_app
from exporter.run import reaper
from exporter.run.agent import CONFIG_NAME, RUN_DIR_ENV, SOCKET_NAME
from exporter.run.aggregator import Aggregator
from exporter.runtime import build_runtime, live_sources
from exporter.sources import Source
from exporter.sources.process_memory import ProcessMemorySource, process_tree

log = logging.getLogger("exporter.launcher")

INJECT_DIR = Path(__file__).resolve().parent / "inject"
RUN_PREFIX = "gpumem-run-"  # then the launcher's pid
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGWINCH")


# Secrets of the launcher that the server's processes must not inherit.
WITHHELD = ("GPUMEM_ADMIN_TOKEN", "GPUMEM_ADMIN_TOKEN_FILE")


def child_environment(config: Config, run_dir: str, base: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in WITHHELD}
    env[RUN_DIR_ENV] = run_dir
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(INJECT_DIR), base.get("PYTHONPATH")]))
    env["GPUMEM_EXPORTER_PATH"] = str(Path(__file__).resolve().parents[2])
    env["GPUMEM_INTERVAL_S"] = str(config.interval_s)
    return env


def write_agent_config(config: Config, run_dir: str) -> None:
    """The settings the agents run with: the launcher's, less the admin token."""
    settings = dataclasses.asdict(config)
    for name in ("admin_token", "admin_token_file", "host", "port"):
        settings.pop(name)
    settings["snapshot_dir"] = str(config.snapshot_directory)  # one folder for the pod
    atomic.write_bytes(Path(run_dir) / CONFIG_NAME, json.dumps(settings).encode())


def run(command: Sequence[str], config: Config) -> int:
    sweep_run_folders()
    with contextlib.ExitStack() as cleanup:  # whatever was set up is undone, on any exit
        # 0700: only this user reaches the socket.
        run_dir = tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}-", dir=run_base())
        cleanup.callback(shutil.rmtree, run_dir, ignore_errors=True)
        keeper = reaper.start(run_dir)  # stops the command if this process is killed
        cleanup.callback(reaper.release, keeper)
        write_agent_config(config, run_dir)
        aggregator = Aggregator(run_dir)
        cleanup.callback(aggregator.close)
        child: subprocess.Popen[bytes] | None = None

        def agent_labels() -> dict[int, dict[str, str]]:
            return {int(p["pid"]): p for p in aggregator.processes() if p.get("pid")}

        server_processes = ProcessMemorySource(
            lambda: process_tree(child.pid if child is not None else None), labels=agent_labels
        )
        sources: list[Source] = [
            aggregator,
            server_processes,
            *live_sources(config, torch=False, gpu_users=aggregator.gpu_users),
        ]
        actions = FanOutActions(aggregator, SnapshotStore.for_config(config))
        runtime = build_runtime(config, mode="run", sources=sources, actions=actions)
        http = HttpServer(create_app(runtime), config.host, config.port)  # ServerStartError
        cleanup.callback(http.stop)
        runtime.sampler.start()
        cleanup.callback(runtime.sampler.stop)
        http.start()
        log.info("gpumem-exporter run: serving %s/metrics for %s", http.url, " ".join(command))

        def forward(signum: int, frame: FrameType | None) -> None:
            if child is not None and child.poll() is None:
                child.send_signal(signum)

        for name in FORWARDED:
            signum = getattr(signal, name, None)
            if signum is not None:
                cleanup.callback(signal.signal, signum, signal.signal(signum, forward))
        try:
            child = subprocess.Popen(
                list(command),
                env=child_environment(config, run_dir, dict(os.environ)),
                start_new_session=True,
            )
        except OSError as exc:
            log.error("cannot start %s: %s", command[0], exc.strerror or exc)
            return 127 if isinstance(exc, FileNotFoundError) else 126
        with contextlib.suppress(psutil.Error, OSError):  # gone already: nothing to guard
            reaper.watch(psutil.Process(child.pid), keeper)
        code = child.wait()
        return code if code >= 0 else 128 - code


def run_base() -> str:
    """The temp dir, unless the socket's path in it would pass the 107 bytes a Unix socket's
    path may have: then /tmp."""
    base = tempfile.gettempdir()
    longest = os.path.join(base, f"{RUN_PREFIX}{2**22}-12345678", SOCKET_NAME)
    return base if len(longest.encode()) <= 107 else "/tmp"


def sweep_run_folders() -> None:
    """Remove run folders of this user left by launchers that are gone (one killed together
    with its reaper, e.g. by `kill -9 -PGID`)."""
    bases = {tempfile.gettempdir(), run_base()}  # run_base may have fallen back to /tmp
    for folder in (f for base in bases for f in Path(base).glob(f"{RUN_PREFIX}*-*")):
        pid = folder.name[len(RUN_PREFIX) :].partition("-")[0]
        try:
            mine = folder.lstat().st_uid == os.getuid() and folder.is_dir()
        except OSError:
            continue
        if mine and pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
