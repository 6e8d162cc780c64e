"""Which connections the TLS port lets in, and what each costs before it is let in.

A connection accepted on the TLS port is only a socket (`_Arriving`) until its first bytes:
no TLS object, no read buffer, no HTTP protocol. Its first bytes start the handshake, with the
certificate in force at that moment (a rotated one is used from the next handshake on, as Go's
GetConfigForClient does for exporter-toolkit). Round 5 measured why: with the TLS protocol
built at accept, 5,000 connects that never sent a ClientHello (held 4 s, then closed) grew the
serving process from 60 MB to 360 MB, and the memory never came back. Each had its own TLS
object, buffers and HTTP protocol, caught in reference cycles that only the cyclic collector
frees, so thousands were alive at once however few the caps let stay.

Two caps, each with a rule for who gives way:
- MAX_WAITING connections that have not sent a byte: the oldest whose bytes have not come
  gives way to a newcomer, and each is closed after READ_TIMEOUT_S (a silent client cannot
  keep a real one out);
- MAX_HANDSHAKES handshakes in progress: a newcomer takes the place of one slower than
  READ_GRACE_S (a real handshake takes milliseconds), else it is closed at once.
"""

from __future__ import annotations

import asyncio
import fcntl
import ssl
import sys
import termios
import time
from collections.abc import Callable
from typing import Any

from exporter.http.guard import READ_GRACE_S, READ_TIMEOUT_S
from exporter.internals import AlertingTlsProtocol

_PLAIN_BODY = b"Client sent an HTTP request to an HTTPS server.\n"
PLAIN_HTTP_TO_TLS = (
    b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_PLAIN_BODY), _PLAIN_BODY)
)

# A TLS connection's first byte: the record type of a handshake (RFC 8446, 5.1).
_HANDSHAKE_RECORD = b"\x16"

# Connections that have sent nothing yet. Each holds a socket (a file descriptor of the host
# process) and a few hundred bytes; past this the oldest is closed.
MAX_WAITING = 256

# TLS handshakes in progress at once. Each holds asyncio's TLS protocol (its read buffer and
# OpenSSL's state) until it completes or READ_TIMEOUT_S passes, before the HTTP guard
# (exporter.http.guard) sees the connection.
MAX_HANDSHAKES = 64


class TlsAdmission:
    """One server's connections on the TLS port before the HTTP guard sees them: those that
    have sent nothing yet, and the handshakes in progress (both oldest first)."""

    def __init__(self) -> None:
        self.waiting: dict[_Arriving, None] = {}
        self.pending: dict[_TlsProtocol, float] = {}  # -> time.monotonic() it started

    def arriving(
        self, context: ssl.SSLContext, make_http: Callable[[], asyncio.Protocol]
    ) -> asyncio.Protocol:
        """The protocol for a connection just accepted: a socket until its first bytes."""
        return _Arriving(self, context, make_http)

    def close_all(self) -> None:
        """At shutdown: uvicorn closes the connections its HTTP protocol holds, not these."""
        for arriving in list(self.waiting):
            arriving.drop()
        for handshake in list(self.pending):
            handshake.drop()

    def _wait(self, arriving: _Arriving) -> bool:
        """Whether `arriving` may wait for its first bytes: room is made by closing the oldest
        one whose bytes have not come. One whose bytes are in the kernel already is about to
        be read: under a burst of a thousand connects accepted in one turn of the loop, a
        kubelet's probe that sent its ClientHello at once must not give way to idle ones."""
        if len(self.waiting) >= MAX_WAITING:
            victim = next((a for a in self.waiting if not a.has_bytes()), None)
            if victim is None:
                return False
            victim.drop()
        self.waiting[arriving] = None
        return True

    def _make_room(self) -> bool:
        if len(self.pending) < MAX_HANDSHAKES:
            return True
        slow_since = time.monotonic() - READ_GRACE_S
        victim = next((p for p, started in self.pending.items() if started <= slow_since), None)
        if victim is None:
            return False
        victim.drop()
        return True


class _Arriving(asyncio.Protocol):
    """A connection on the TLS port until its first bytes, which start its handshake: the TLS
    protocol takes the transport over (as `loop.start_tls` does) and is handed those bytes."""

    def __init__(
        self,
        admission: TlsAdmission,
        context: ssl.SSLContext,
        make_http: Callable[[], asyncio.Protocol],
    ) -> None:
        self._admission = admission
        self._context = context
        self._make_http = make_http
        self._transport: Any = None
        self._timeout: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        if not self._admission._wait(self):
            transport.abort()  # type: ignore[attr-defined]
            return
        self._timeout = asyncio.get_running_loop().call_later(READ_TIMEOUT_S, self.drop)

    def has_bytes(self) -> bool:
        """Whether its first bytes wait in the kernel, unread (one ioctl, no read)."""
        sock = self._transport.get_extra_info("socket") if self._transport else None
        if sock is None:
            return False
        try:
            unread = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except OSError:
            return False
        return int.from_bytes(unread, sys.byteorder) > 0

    def data_received(self, data: bytes) -> None:
        self._forget()
        transport, self._transport = self._transport, None
        if transport is None or transport.is_closing():
            return
        if data[:1] != _HANDSHAKE_RECORD:
            # Not TLS: plain HTTP to the TLS port (a scrape config without scheme: https) is
            # told so in HTTP, as Go's servers do, with no TLS object built for it. A flood of
            # request lines to the TLS port made thousands a second, and the process grew.
            if data[:1].isalpha():
                transport.write(PLAIN_HTTP_TO_TLS)
                transport.close()
            else:
                transport.abort()
            return
        if not self._admission._make_room():
            transport.abort()
            return
        tls = _TlsProtocol(
            asyncio.get_running_loop(),
            self._make_http(),
            self._context,
            None,  # no waiter: asyncio's own servers pass None too
            server_side=True,
            # A client that starts a handshake and stalls is dropped like a slow request.
            ssl_handshake_timeout=int(READ_TIMEOUT_S),
            admission=self._admission,
        )
        transport.set_protocol(tls)
        tls.connection_made(transport)
        # What the transport would have read into the TLS protocol's buffer (a ClientHello
        # fits in one read; a longer first read is handed over in buffers' worth).
        view = memoryview(data)
        while view and not transport.is_closing():
            buffer = tls.get_buffer(len(view))  # type: ignore[attr-defined]  # buffered (3.11+)
            n = min(len(buffer), len(view))
            buffer[:n] = view[:n]
            tls.buffer_updated(n)  # type: ignore[attr-defined]
            view = view[n:]

    def eof_received(self) -> bool:
        self._forget()
        return False  # the transport closes

    def connection_lost(self, exc: BaseException | None) -> None:
        self._forget()
        self._transport = None

    def drop(self) -> None:
        """Close now (its place goes to a newcomer, or it waited too long)."""
        self._forget()
        if self._transport is not None:
            self._transport.abort()

    def _forget(self) -> None:
        self._admission.waiting.pop(self, None)
        if self._timeout is not None:
            self._timeout.cancel()
            self._timeout = None


class _TlsProtocol(AlertingTlsProtocol):
    """asyncio's TLS protocol, sending OpenSSL's alert when a handshake fails
    (exporter.internals), counted from its first bytes to the handshake's end."""

    # asyncio's read buffer, allocated whole with each protocol (256 KiB): a TLS record is at
    # most 16 KiB and a request here a few hundred bytes. 32 KiB keeps a flood of connects
    # from holding (and, freed, fragmenting) hundreds of MB.
    max_size = 32 * 1024

    def __init__(self, *args: Any, admission: TlsAdmission, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._admission = admission

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._admission.pending[self] = time.monotonic()
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._admission.pending.pop(self, None)
        super().connection_lost(exc)

    def drop(self) -> None:
        """Close a handshake in progress now (its place goes to a newcomer)."""
        self._admission.pending.pop(self, None)
        self.abort()

    def handshake_done(self, exc: BaseException | None) -> bytes | None:
        self._admission.pending.pop(self, None)
        return None  # OpenSSL's alert (plain HTTP never gets here: _Arriving answers it)
