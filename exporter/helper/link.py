"""exporter.start()'s link to its helper, in the serving process: the agent (connected at once)
and the helper it reports to, found or started (exporter.helper.join), and started again when
it dies: backoff from RESTART_BACKOFF_S to RESTART_BACKOFF_MAX_S, each restart counted
(gpumem_exporter_helper_restarts_total). Everything here runs on the agent's own thread, or in
start() and stop(): never on the host's threads otherwise."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable

from exporter.config import Config
from exporter.helper import join
from exporter.transport import protocol
from exporter.transport.agent import SOCKET_NAME, Agent

log = logging.getLogger("exporter")

RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
# stop(): how long to wait for a helper this process started to leave (it leaves
# LEAVE_AFTER_S after its last process; one that others still use stays).
STOP_WAIT_S = 3.0


class HelperAgent(Agent):
    """The agent of a process that called exporter.start(): connected from the start, and
    saying it lives on every tick until this process uses CUDA, so that the helper serves it
    (and stays) from the start; when the helper leaves, the next tick finds or starts one."""

    def _before_cuda(self) -> None:
        if self._sock is not None or self._connect():
            self._send(protocol.sample([], self._counts(), None))  # alive, no GPU yet

    def _other_end_left(self, sock: socket.socket) -> None:
        if self._sock is sock:
            self._close()


class HelperLink:
    """This process's agent and its helper. `on_url(url)`: a helper serves this process
    (again, or at last); `on_error(reason)`: what keeps it from being served now (a taken
    port, a refused folder, a helper that closes the connection at once)."""

    def __init__(
        self,
        config: Config,
        on_url: Callable[[str], None] | None = None,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.helper: join.Helper | None = None
        self.agent: HelperAgent | None = None
        self.error: str | None = None
        # The helper joined runs with other settings than this process asked: they are not
        # applied here, and this says which (None: the same, or started here).
        self.warning: str | None = None
        self._on_url = on_url
        self._on_error = on_error
        self._backoff_s = RESTART_BACKOFF_S
        self._next_try = 0.0
        self._said: str | None = None  # the reason logged last: each one is logged once

    def start(self) -> str | None:
        """Start the agent and join or start the helper: the URL served, or None while
        something blocks it (then `error` says what, and the agent's thread tries again with
        backoff until it is served). Never raises."""
        self.agent = HelperAgent(None, config=self.config, on_lost=self._lost, on_dial=self._dialed)
        url = self._join()
        if url is not None:
            # Connected before start() returns: the helper serves this process from now on,
            # and leaves when it does, even at once (it waits FIRST_PEER_S for a first one).
            self.agent.connect()
        self.agent.start()
        return url if self.error is None else None

    def _join(self) -> str | None:
        """Join or start the helper; its URL, or None (backoff set, the reason said)."""
        try:
            helper = join.join_or_start(self.config)
        except join.JoinError as exc:
            self._blocked(str(exc))
            return None
        except Exception as exc:  # a bug: said and tried again, never raised into the host
            self._blocked(f"finding the helper failed: {type(exc).__name__}: {exc}")
            return None
        self._backoff_s = RESTART_BACKOFF_S
        self.helper = helper
        self._tell_differences(helper)
        assert self.agent is not None
        self.agent.socket_path = str(helper.folder / SOCKET_NAME)  # port 0: a new folder
        return helper.url

    def _tell_differences(self, helper: join.Helper) -> None:
        warning = None
        if helper.differences:
            warning = (
                f"this process joined the helper serving {helper.url}, which keeps its own "
                f"settings (those asked here are not applied; GET /stats lists them): "
                + "; ".join(helper.differences)
            )
        if warning is not None and warning != self.warning:
            log.warning("gpumem-exporter: %s", warning)
        self.warning = warning

    def _blocked(self, reason: str) -> None:
        self._next_try = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, RESTART_BACKOFF_MAX_S)
        self.error = reason
        if self._on_error is not None:
            self._on_error(reason)
        if reason != self._said:
            self._said = reason
            log.error(
                "gpumem-exporter: %s; /metrics is not served from this process until that "
                "is cleared (retrying with backoff up to %g s)",
                reason,
                RESTART_BACKOFF_MAX_S,
            )

    def _dialed(self, refused: str | None) -> None:
        """The agent reached a helper: it took this process (what blocked it is cleared), or
        it closed the connection at once (said, and tried again)."""
        if refused is not None:
            self._blocked(refused)
            return
        if self.error is not None and self.helper is not None:
            log.info("gpumem-exporter: %s/metrics is served now", self.helper.url)
        self.error, self._said = None, None
        self._backoff_s = RESTART_BACKOFF_S
        if self.helper is not None and self._on_url is not None:
            self._on_url(self.helper.url)

    def _lost(self) -> bool | None:
        """The helper does not answer: find or start one (True: started here), or None."""
        if time.monotonic() < self._next_try or self.agent is None:
            return None
        was_served = self.helper is not None and self.error is None
        if self._join() is None:
            return None
        assert self.helper is not None
        if self.helper.process is None:
            return False  # another process of the server started it first
        if was_served:
            log.warning(
                "gpumem-exporter: the helper serving %s died; started it again", self.helper.url
            )
            return True
        return False  # started at last, not again

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
        """Stop the agent (the helper sees this process leave). A helper started here is
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
