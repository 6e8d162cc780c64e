"""exporter.start()'s part in the serving process: the probe (the agent of `run`, connected at
once) and the helper it reports to, found or started (exporter.run.join), and started again
when it dies: backoff from RESTART_BACKOFF_S to RESTART_BACKOFF_MAX_S, each restart counted
(gpumem_exporter_helper_restarts_total). Everything here runs on the probe's own thread, or
in start() and stop(): never on the host's threads otherwise."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import time
import urllib.request
from collections.abc import Callable

from exporter.config import Config
from exporter.ratelimit import RateLimitedLog
from exporter.run import join
from exporter.run.agent import SOCKET_NAME, Agent

log = logging.getLogger("exporter")
_limited = RateLimitedLog(log)

RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
# stop(): how long to wait for a helper this process started to leave (it leaves
# LEAVE_AFTER_S after its last process; one that others still use stays).
STOP_WAIT_S = 3.0


class Probe:
    def __init__(self, config: Config, on_url: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.helper: join.Helper | None = None
        self.agent: Agent | None = None
        self._on_url = on_url
        self._backoff_s = RESTART_BACKOFF_S
        self._next_try = 0.0

    def start(self) -> str:
        """Join or start the helper and start the probe; the URL served. JoinError if there
        is no helper (a taken port, a refused folder)."""
        try:
            self.helper = join.join_or_start(self.config)
        except join.JoinError:
            if not self.config.helper_spawn:
                # A sidecar's helper that is not there (yet): the probe connects once it is.
                folder = join.folder_for(self.config)
                self.agent = Agent(str(folder), early=True, on_lost=self._lost)
                self.agent.start()
            raise
        self.agent = Agent(str(self.helper.folder), early=True, on_lost=self._lost)
        # Connected before start() returns: the helper serves this process from now on, and
        # leaves when it does, even at once (it waits FIRST_PEER_S for a first process).
        self.agent.connect()
        self.agent.start()
        return self.helper.url

    def _lost(self) -> bool | None:
        """The helper does not answer: find or start one (True: started here), or None."""
        now = time.monotonic()
        if now < self._next_try or self.agent is None:
            return None
        try:
            helper = join.join_or_start(self.config)
        except join.JoinError as exc:
            self._next_try = now + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, RESTART_BACKOFF_MAX_S)
            _limited.warning("helper", f"gpumem-exporter: the helper is gone: {exc}; retrying")
            return None
        self._backoff_s = RESTART_BACKOFF_S
        self.helper = helper
        self.agent.socket_path = str(helper.folder / SOCKET_NAME)  # port 0: a new folder
        if self._on_url is not None:
            self._on_url(helper.url)
        if helper.process is None:
            return False  # another process of the server started it first
        log.warning("gpumem-exporter: the helper serving %s died; started it again", helper.url)
        return True

    def unavailable(self) -> dict[str, str]:
        """What the helper says has nothing to read here (its /healthz), {} if it cannot say."""
        if self.helper is None:
            return {}
        try:
            with urllib.request.urlopen(self.helper.url + "/healthz", timeout=2) as response:
                health = json.loads(response.read())
        except Exception as exc:  # a 503 (starting, stale) says it too
            body = getattr(exc, "read", None)
            try:
                health = json.loads(body()) if body is not None else {}
            except Exception:
                return {}
        found = health.get("unavailable_sources", {}) if isinstance(health, dict) else {}
        return dict(found) if isinstance(found, dict) else {}

    def stop(self) -> None:
        """Stop the probe (the helper sees this process leave). A helper started here is
        waited for a moment: it leaves at once unless other processes still use it."""
        if self.agent is not None:
            self.agent.stop()
        process = self.helper.process if self.helper is not None else None
        if process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):  # others still use it
                process.wait(STOP_WAIT_S)

    def forget(self) -> None:
        """In a child forked after start(): close this copy of the parent's connection (the
        helper then sees the parent leave when it exits); the child's start() joins anew."""
        if self.agent is not None:
            self.agent.forget()
