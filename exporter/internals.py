"""Every reach into the internals of uvicorn, asyncio and ssl, in one module.

The HTTP layer needs a few things these packages do not offer publicly: a TLS handshake that
fails sends OpenSSL's alert before the connection closes (asyncio drops it unsent), a
certificate's expiry read from its file without loading the key, and uvicorn's HTTP/1.1
protocol and server extended rather than forked (the guard's deadlines and slots, the quiet
main loop). The underscore names live here and nowhere else in the package; the public but
undocumented ones that subclasses elsewhere lean on are listed beside them. RELIED_ON names
each, and tests/test_internals.py checks every one against the installed packages, so an
upgrade that moves one fails that test, not a production server. pyproject.toml bounds the
uvicorn versions this was checked against. asyncio's and ssl's are Python's, checked on 3.11
and 3.12; 3.10's TLS protocol has no `_outgoing` (the alert is then not sent: best effort; the
test of RELIED_ON fails there and says so).
"""

from __future__ import annotations

import contextlib
import ssl
from asyncio.sslproto import SSLProtocol
from typing import Any

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
    # uvicorn's server (exporter.http.quiet): its main loop, first tick, exit flag, and the
    # state whose default headers carry Date.
    ("uvicorn.Server", "main_loop"),
    ("uvicorn.Server", "on_tick"),
    ("uvicorn.Server", "should_exit"),
    ("uvicorn.Server", "handle_exit"),
    ("uvicorn.server.ServerState", "default_headers"),
    ("uvicorn.server.ServerState", "connections"),
    ("uvicorn.Config", "encoded_headers"),
    ("uvicorn.Config", "date_header"),
    # uvicorn's HTTP/1.1 protocol on httptools (exporter.http.guard): the parser's callbacks
    # it extends, the request in progress (whose keep_alive, default_headers and
    # response_started it reads and sets), its parser, loop, transport, connections and
    # server state, and the loggers it replaces.
    ("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "on_message_begin"),
    ("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "on_headers_complete"),
    ("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "on_message_complete"),
    ("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "cycle"),
    ("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "parser"),
    ("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "loop"),
    ("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "transport"),
    ("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "server_state"),
    ("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "connections"),
    ("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "config"),
    ("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "scheme"),
    ("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "access_log"),
    ("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", "logger"),
    ("uvicorn.protocols.http.httptools_impl.RequestResponseCycle", "keep_alive"),
    ("uvicorn.protocols.http.httptools_impl.RequestResponseCycle", "default_headers"),
    ("uvicorn.protocols.http.httptools_impl.RequestResponseCycle", "response_started"),
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
