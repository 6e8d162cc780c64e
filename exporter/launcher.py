"""`gpumem-exporter run -- CMD ARGS...`: run a server with every Python process instrumented.

The launcher starts the aggregator (a Unix socket in a fresh 0700 folder), NVML and host
sources and the HTTP endpoint, then CMD with exporter/inject first on PYTHONPATH, so that each
Python process of the server loads the agent at start-up, the way opentelemetry-instrument
injects itself. CMD runs in its own session: every signal the launcher gets (SIGTERM from
Kubernetes, SIGINT from a terminal, ...) is passed on once, and the launcher exits with CMD's
exit status (128 + N if CMD died of signal N).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from exporter.agent import RUN_DIR_ENV
from exporter.aggregator import Aggregator
from exporter.config import Config
from exporter.runtime import build_runtime, live_sources
from exporter.server import HttpServer, create_app

log = logging.getLogger("exporter.launcher")

INJECT_DIR = Path(__file__).resolve().parent / "inject"
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGWINCH")


def child_environment(config: Config, run_dir: str, base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env[RUN_DIR_ENV] = run_dir
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(INJECT_DIR), base.get("PYTHONPATH")]))
    env["GPUMEM_EXPORTER_PATH"] = str(Path(__file__).resolve().parent.parent)
    env["GPUMEM_SNAPSHOT_DIR"] = str(config.snapshot_directory)
    env["GPUMEM_INTERVAL_S"] = str(config.interval_s)
    return env


def run(command: Sequence[str], config: Config) -> int:
    run_dir = tempfile.mkdtemp(prefix="gpumem-run-")  # 0700: only this user reaches the socket
    aggregator = Aggregator(run_dir)
    sources = [aggregator, *live_sources(config, torch=False)]
    runtime = build_runtime(config, mode="run", sources=sources, aggregator=aggregator)
    http = HttpServer(create_app(runtime), config.host, config.port)  # may raise ServerStartError
    runtime.sampler.start()
    http.start()
    log.info("gpumem-exporter run: serving %s/metrics for %s", http.url, " ".join(command))
    child: subprocess.Popen[bytes] | None = None
    previous = {}

    def forward(signum: int, frame: FrameType | None) -> None:
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    try:
        for name in FORWARDED:
            if hasattr(signal, name):
                previous[name] = signal.signal(getattr(signal, name), forward)
        try:
            child = subprocess.Popen(
                list(command),
                env=child_environment(config, run_dir, dict(os.environ)),
                start_new_session=True,
            )
        except OSError as exc:
            log.error("cannot start %s: %s", command[0], exc.strerror or exc)
            return 127 if isinstance(exc, FileNotFoundError) else 126
        code = child.wait()
        return code if code >= 0 else 128 - code
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)
        http.stop()
        runtime.sampler.stop()
        aggregator.close()
        shutil.rmtree(run_dir, ignore_errors=True)
