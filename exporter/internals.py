"""Every reach into the internals of uvicorn, asyncio and ssl, in one module.

The HTTP layer needs a few things these packages do not offer publicly: a TLS handshake that
fails sends OpenSSL's alert before the connection closes (asyncio drops it unsent), a
certificate's expiry read from its file without loading the key, uvicorn's server without the
timer of its main loop (QuietServer), and uvicorn's HTTP/1.1 protocol without its access log
(the guard, exporter.http.guard, wraps that protocol and reaches into nothing else of it).
The underscore names live here and nowhere else in the package; the public but
undocumented ones this module leans on are listed beside them. RELIED_ON names
each, and tests/test_internals.py checks every one against the installed packages, so an
upgrade that moves one fails that test, not a production server. pyproject.toml bounds the
uvicorn versions this was checked against. asyncio's and ssl's are Python's, checked on 3.11
and 3.12; 3.10's TLS protocol has no `_outgoing` (the alert is then not sent: best effort; the
test of RELIED_ON fails there and says so).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from asyncio.sslproto import SSLProtocol
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# (what it belongs to, the attribute): the class, or the object its instances are, as the test
# builds them.
RELIED_ON: tuple[tuple[str, str], ...] = (
    # asyncio's TLS protocol (Python 3.11+): the handshake's end, the connection under it,
    # and OpenSSL's outgoing bytes (the alert of a failed handshake).
    ("asyncio.sslproto.SSLProtocol", "_on_handshake_complete"),
    ("asyncio.sslproto.SSLProtocol", "_transport"),
    ("asyncio.sslproto.SSLProtocol", "_outgoing"),
    # ssl: a certificate file's fields without a context (what `openssl x509` prints).
    ("ssl._ssl", "_test_decode_cert"),
    # uvicorn's server (QuietServer below): its main loop, first tick, exit flag.
    ("uvicorn.Server", "main_loop"),
    ("uvicorn.Server", "on_tick"),
    ("uvicorn.Server", "should_exit"),
    ("uvicorn.Server", "handle_exit"),
    # uvicorn's HTTP/1.1 protocol on httptools, which exporter.http.guard wraps: the access
    # log and the logger it replaces (quiet_http_protocol).
    ("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "access_log"),
    ("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "logger"),
)


class AlertingTlsProtocol(SSLProtocol):
    """asyncio's server-side TLS protocol, which sends OpenSSL's alert when a handshake
    fails (asyncio closes without it: the client then sees a reset, not "certificate
    required" or "handshake failure"). Subclasses override `handshake_done` and call
    `abort()`; the private names stay here."""

    def handshake_done(self, exc: BaseException | None) -> bytes | None:
        """Called at the handshake's end (`exc`: why it failed); what it returns is written
        to the client before asyncio closes (None: OpenSSL's alert)."""
        return None

    def abort(self) -> None:
        """Close the connection at once (a handshake in progress too)."""
        transport: Any = self._transport
        if transport is not None:
            transport.abort()

    def _on_handshake_complete(self, handshake_exc: BaseException | None) -> None:
        answer = self.handshake_done(handshake_exc)
        if handshake_exc is not None:
            with contextlib.suppress(Exception):  # best effort: it closes either way
                alert = self._outgoing.read()  # type: ignore[attr-defined]
                transport: Any = self._transport
                if (answer or alert) and transport is not None:
                    transport.write(answer or alert)
        super()._on_handshake_complete(handshake_exc)


def decode_certificate(path: str) -> dict[str, Any]:
    """A PEM certificate file's fields as ssl's getpeercert() gives them (notAfter, subject,
    ...), without a context or its key. Raises OSError or ssl.SSLError for what is no
    certificate."""
    decoded: dict[str, Any] = ssl._ssl._test_decode_cert(path)  # type: ignore[attr-defined]
    return decoded


def quiet_http_protocol(logger: logging.Logger, **uvicorn_args: Any) -> asyncio.Protocol:
    """uvicorn's HTTP/1.1 protocol on httptools (llhttp, Node.js's parser) for one connection,
    made with the arguments uvicorn gives its protocol factory, without an access log line per
    request and with its protocol errors on `logger`. uvicorn logs each request when its
    "uvicorn.access" logger has handlers, whatever Config.access_log says: in a host served by
    uvicorn that is the host's access log, which Prometheus's scrapes must not fill."""
    protocol: Any = HttpToolsProtocol(**uvicorn_args)
    protocol.access_log = False
    protocol.logger = logger
    quiet: asyncio.Protocol = protocol
    return quiet


class QuietServer(uvicorn.Server):
    """uvicorn's server without its wake-ups: nothing runs on the HTTP thread while nobody asks.

    uvicorn's main loop sleeps 0.1 s at a time to notice `should_exit` and to refresh the Date
    header once a second: ten wake-ups a second, which cost 3 ms of CPU per second in the
    serving process (measured: docs/performance.md), more than the exporter's own work. Here
    the main loop waits for an exit event instead, set by `exit()` from any thread or by
    uvicorn's signal handler; the Date header is each answer's (exporter.http.guard.AnswerWatch),
    and uvicorn's own is off (Config(date_header=False))."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_shutdown: Callable[[], None] | None = None,
        after_shutdown: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        # Closes the connections that uvicorn does not know of (exporter.http.tls's).
        self._on_shutdown = on_shutdown
        # Closes what uvicorn's shutdown left open (exporter.http.guard.Connections.abort_all).
        self._after_shutdown = after_shutdown
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit: asyncio.Event | None = None

    async def main_loop(self) -> None:
        await self.on_tick(0)  # the default headers, as uvicorn's first tick sets them
        # Set before should_exit is read: exit() from another thread either sees the event
        # or has set should_exit before this reads it.
        self._exit = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        while not self.should_exit:
            await self._exit.wait()
            self._exit.clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._on_shutdown is not None:
            self._on_shutdown()
        await super().shutdown(sockets)
        if self._after_shutdown is not None:
            self._after_shutdown()
            await asyncio.sleep(0)  # the aborted connections' sockets close on the next turn

    def exit(self) -> None:
        """Stop serving; safe from any thread."""
        self.should_exit = True
        self._wake()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)  # SIGINT/SIGTERM, when serving in the main thread
        self._wake()

    def _wake(self) -> None:
        loop, event = self._loop, self._exit
        if loop is None or event is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to wake
            loop.call_soon_threadsafe(event.set)
