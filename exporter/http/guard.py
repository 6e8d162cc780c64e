"""Slow and hostile clients: deadlines for reading each request and for writing each answer,
a cap on connections with room kept for Prometheus and the kubelet's probes, and an HTTP 503
(never a reset) for whoever finds the server full.

uvicorn bounds only the wait between requests on a kept-alive connection. A client that sends
half a request head (or trickles a body), or one that pipelines requests and never reads the
answers, is held forever: each holds a file descriptor and a slot, and 70 such connections
once took every scrape and health check away for 40 s (docs/reliability.md). This protocol
adds:

- a whole request (head and body; admin bodies are at most 16 KiB) must arrive within
  READ_TIMEOUT_S of its first byte, or of the connection opening;
- an answer that cannot be written for WRITE_TIMEOUT_S (the transport's buffer stays above
  its high-water mark: the client reads nothing, or a byte now and then) is dropped with the
  connection. uvicorn answers pipelined requests one at a time and stops reading while one is
  answered, so a client that never reads holds at most one answer and the buffer's 64 KiB;
- at most MAX_CONNECTIONS are open. A new connection beyond that closes, oldest first, one
  whose answer is stalled, else one that has been reading a request for READ_GRACE_S. If none
  can go, its request line decides: /metrics, /healthz and /readyz are served in
  PROBE_RESERVE more slots; anything else, or beyond those, gets 503 with Retry-After and the
  connection is closed after it. A request being answered, and a kept-alive connection
  between two requests (Prometheus between scrapes), are never cut to make room.
- a reserved slot answers one request and closes (`Connection: close`): clients that keep
  their connections and ask politely (a fleet of health checkers) can fill every regular slot,
  but not the reserve, so new scrapes and probes always get in (issue 38).
- when the reserve is full too, a connection that has sent nothing since it opened (nothing
  read, nothing waiting in its socket), then one whose request is not whole, gives way,
  whatever its age, to a newcomer whose request line asks for a probe path: connections that
  reopen every 0.4 s without a byte (round 4), or with half a request (round 5), were never
  old enough to be closed for room, and took every slot, the reserve included. It is told 503
  and closed lingering, like any other. While the reserve has room, nobody is closed for a
  probe: a client between connect() and send() is silent too.
- a connection closed to make room, or answered 503, is closed the way Apache and nginx do
  ("lingering close"): its 503 written, then FIN, then whatever the client still sends is
  read and dropped for up to LINGER_S. Closing a socket whose client's bytes are unread
  sends a reset, which destroys the 503 in flight: under 1,200 simultaneous connections, 153
  clients got resets instead of 503 (issue 38), their requests still unread behind a busy
  event loop when their connections were picked to make room.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import struct
import termios
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from exporter.http.quiet import refresh_date
from exporter.ratelimit import RateLimitedLog
from exporter.webconfig.security import WebSecurity

log = logging.getLogger(__name__)
_dropped = RateLimitedLog(log)

READ_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 10.0
# A connection that has not sent its whole request head this long after it started is slow,
# and may be closed to make room (a client on a network with a 300 ms round trip sends its
# request within one).
READ_GRACE_S = 0.5
MAX_CONNECTIONS = 64
# Slots beyond MAX_CONNECTIONS that only the probe paths may use, each for one request. Health
# checkers that ask on a timer reconnect together: with 100 of them (issue 38), the 36 beyond
# the regular slots came back within a few milliseconds of each other and 16 reserved slots
# turned a new scrape or probe away now and then (1 in 60 in CI, 1 run in 3 on a loaded
# 2-vCPU machine). 64 take the overflow of 128 such checkers at once.
PROBE_RESERVE = 64
PROBE_PATHS = (b"/metrics", b"/healthz", b"/readyz")
# The longest request line a full server waits for before it answers 503.
MAX_REQUEST_LINE = 8192
# The longest request head (request line and header fields) read: beyond it, 431 and close.
# Prometheus sends ~400 bytes; h11, which uvicorn used before, stopped at 16 KiB too.
MAX_HEAD_BYTES = 16 * 1024
RETRY_AFTER_S = 1
# How long a connection being closed is drained of what its client still sends (after the
# 503 and a FIN) before it is closed for good.
LINGER_S = 2.0

_BUSY_BODY = b"the exporter has too many connections; retry shortly\n"
_CORK: int | None = getattr(socket, "TCP_CORK", None)

_LARGE_BODY = b"request header fields too large\n"
HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n"
    b"Connection: close\r\n"
    b"Content-Length: " + str(len(_LARGE_BODY)).encode() + b"\r\n\r\n" + _LARGE_BODY
)
BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n"
    b"Retry-After: " + str(RETRY_AFTER_S).encode() + b"\r\n"
    b"Connection: close\r\n"
    b"Content-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY
)


async def _head_too_large(scope: Any, receive: Any, send: Any) -> None:
    headers, _, body = HEAD_TOO_LARGE.partition(b"\r\n\r\n")
    fields = [line.split(b": ", 1) for line in headers.split(b"\r\n")[1:]]
    await send({"type": "http.response.start", "status": 431, "headers": fields})
    await send({"type": "http.response.body", "body": body})


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol on httptools (llhttp, Node.js's parser), with the deadlines
    and slots above, the request head bounded (MAX_HEAD_BYTES), the Date header kept current
    without uvicorn's timer (exporter.http.quiet), and, where the web config asks for client
    certificates with allowed names, a 403 for every request of a connection whose certificate
    has none of them. Made with functools.partial (uvicorn creates one per connection)."""

    def __init__(self, *args: Any, web: WebSecurity | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn logs each request when its "uvicorn.access" logger has handlers, whatever
        # Config.access_log says: in a host served by uvicorn that is the host's access log,
        # which Prometheus's scrapes must not fill. Protocol errors go to our own logger too.
        self.access_log = False
        self.logger = log
        self.web = web
        # Why this connection's client certificate is refused (client_allowed_sans).
        self.refused: str | None = None
        self.opened = time.monotonic()
        self._read_deadline: asyncio.TimerHandle | None = None
        self._reading_since = 0.0
        self._write_deadline: asyncio.TimerHandle | None = None
        # The request head in progress (None: not in one): its bytes parsed, and the bytes of
        # the reads that left it open.
        self._head_bytes: int | None = None
        self._head_read = 0
        # The first bytes of a connection that found the server full, until its request line
        # says whether it may have a reserved slot; None once admitted.
        self._waiting: bytearray | None = None
        # Admitted to a reserved slot: one request, then the connection closes.
        self.one_request = False
        # Answered and half-closed: what the client still sends is dropped (_linger).
        self._lingering: asyncio.TimerHandle | None = None
        self.heard = False  # whether the client has sent a byte since it connected

    @property
    def reading(self) -> bool:
        """Waiting for the rest of a request (or for the first one)."""
        return self._read_deadline is not None

    @property
    def stalled(self) -> bool:
        """An answer waits for the client to read (the transport paused writing)."""
        return self._write_deadline is not None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.web is not None and self.scheme == "https":
            self.refused = self.web.peer_refused(transport.get_extra_info("peercert"))
        self._arm()
        full = len(self.connections) > MAX_CONNECTIONS and self._open() > MAX_CONNECTIONS
        if full and not self._make_room():
            self._waiting = bytearray()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_write()
        if self._lingering is not None:
            self._lingering.cancel()
            self._lingering = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.heard = True
        if self._lingering is not None:
            return  # the connection is being closed: read, so that closing sends no reset
        if self.refused is not None:
            self._refuse(self.refused)
            return
        if self._waiting is not None:
            self._admit(data)
            return
        super().data_received(data)
        if self._head_bytes is not None and not self.transport.is_closing():
            # A head still open after this read: httptools keeps a header field's bytes until
            # it ends, so what this read brought counts (at most a read of earlier requests'
            # bytes too many).
            self._head_read += len(data)
            if self._head_read > MAX_HEAD_BYTES:
                if self.cycle is not None and not self.cycle.response_complete:
                    self.transport.close()  # an answer going out: no room for ours
                else:
                    self._linger(HEAD_TOO_LARGE)

    # -- the parser's callbacks: where a request starts and ends ---------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes, self._head_read = 0, 0
        if not self.reading:  # the first bytes of the next request on a kept-alive one
            self._arm()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if self._head_bytes is not None:
            self._head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        if self._head_bytes is not None:
            self._head_bytes += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        too_large = (self._head_bytes or 0) > MAX_HEAD_BYTES
        self._head_bytes = None
        refresh_date(self.server_state, self.config)
        if too_large:  # a whole head in one read: answered 431 instead of by the app
            app, self.app = self.app, _head_too_large
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        else:
            super().on_headers_complete()
        # A reserved slot serves one request; and a client's "Connection: close" ends the
        # connection (uvicorn 0.40 and older kept it open on httptools: the version decided).
        cycle = self.cycle
        if cycle is not None and (self.one_request or not self.parser.should_keep_alive()):
            # The answer says Connection: close (uvicorn 0.40 and older only closed), then the
            # connection closes. A list of this answer's own: the server's is shared.
            cycle.keep_alive = False
            cycle.default_headers = [*cycle.default_headers, (b"connection", b"close")]
        self._cork(True)

    def on_response_complete(self) -> None:
        self._cork(False)  # the answer's last bytes leave now
        super().on_response_complete()

    def _cork(self, on: bool) -> None:
        """uvicorn writes an answer's head and body apart, and with TCP_NODELAY (bind_socket
        says why) each write was a segment of its own: a scrape's two sends cost the server
        more than the rest of its answer (docs/performance.md). Corked, the kernel sends
        them as one segment when the answer is complete (Linux; elsewhere a no-op)."""
        sock = self.transport.get_extra_info("socket") if _CORK is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, _CORK, on)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()  # the request is in: no read deadline while it is answered

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(WRITE_TIMEOUT_S, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_write()

    def _refuse(self, reason: str) -> None:
        body = reason.encode() + b"\n"
        self._linger(
            b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )

    # -- admission of a connection that found the server full ----------------------------

    def _admit(self, data: bytes) -> None:
        assert self._waiting is not None
        self._waiting += data
        line, found, _ = bytes(self._waiting[:MAX_REQUEST_LINE]).partition(b"\r\n")
        if not found:
            if len(self._waiting) >= MAX_REQUEST_LINE:
                self._busy()
            return
        target = line.split(b" ")[1] if line.count(b" ") >= 2 else b""
        path = target.partition(b"?")[0]
        if path in PROBE_PATHS and self._open() > MAX_CONNECTIONS + PROBE_RESERVE:
            self._silence_for_probe()
        open_now = self._open()
        regular = open_now <= MAX_CONNECTIONS
        room = regular or (path in PROBE_PATHS and open_now <= MAX_CONNECTIONS + PROBE_RESERVE)
        if not room:
            self._busy()
            return
        self.one_request = not regular
        buffered, self._waiting = bytes(self._waiting), None
        self.data_received(buffered)

    def _open(self) -> int:
        """The connections that hold a slot: not those being closed lingering (answered,
        half-closed, drained for up to LINGER_S), which would otherwise keep the slots of
        clients that have gone and turn the next newcomers away too."""
        return sum(
            1
            for c in self.connections
            if not (isinstance(c, GuardedProtocol) and c._lingering is not None)
        )

    def _busy(self) -> None:
        """503 with Retry-After, then close: a full server says so in HTTP (a reset reads as a
        dead target)."""
        _dropped.warning("busy", "HTTP connections at the limit: answered 503 to a newcomer")
        self._waiting = None
        self._linger(BUSY_RESPONSE)

    def _linger(self, answer: bytes) -> None:
        """Write `answer`, send FIN, drain the client for up to LINGER_S, then close."""
        self._disarm()
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(answer)
        if not transport.can_write_eof():  # TLS: close_notify, then close
            transport.close()
            return
        try:
            transport.write_eof()  # after the buffered answer
        except OSError:
            # The client has gone already (ENOTCONN from shutdown()): nothing to linger for.
            # Raised, it would end the newcomer whose request made room for it, unanswered.
            transport.abort()
            return
        self._lingering = self.loop.call_later(LINGER_S, transport.close)

    # -- deadlines -----------------------------------------------------------------------

    def _arm(self) -> None:
        self._reading_since = time.monotonic()
        self._read_deadline = self.loop.call_later(READ_TIMEOUT_S, self._too_slow)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _disarm_write(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _too_slow(self) -> None:
        self._read_deadline = None
        self.transport.close()  # a handler waiting for the body sees the client disconnect

    def _write_stalled(self) -> None:
        _dropped.warning("stalled", "dropped an HTTP connection whose client read nothing")
        self._drop()

    def _drop(self) -> None:
        """Close now. A stalled answer is aborted: close() would wait for a buffer that never
        drains. One still reading its request is told 503 (it may be a client whose request
        the busy server has not read yet) and closed lingering."""
        stalled = self.stalled
        self._disarm()
        self._disarm_write()
        if stalled:
            self.transport.abort()
        elif self.cycle is None or not self.cycle.response_started:
            self._linger(BUSY_RESPONSE)
        else:
            self.transport.close()

    # -- making room -----------------------------------------------------------------------

    def _others(self) -> list[GuardedProtocol]:
        """The other connections that may be closed for room, oldest first (not those going
        already: closing one frees nothing)."""
        return sorted(
            (
                c
                for c in self.connections
                if isinstance(c, GuardedProtocol) and c is not self and not c.transport.is_closing()
            ),
            key=lambda c: c.opened,
        )

    def _silence_for_probe(self) -> None:
        """Close connections that have sent nothing, then those whose request is not whole
        (oldest first each), until a reserved slot is free for this probe or scrape, or none
        is left: what a connection has done decides, not its age alone. Only once the reserve
        is full too: a client between its connect() and its send() (a few milliseconds,
        longer on a busy machine) is silent as well, and closing it while the reserve had
        room turned a new scrape away (1 in 60 in CI). Half requests count as silence: a
        request line with no end, reconnected as soon as it was closed, kept every slot with
        young half-requests (round 5: 15 of 16 probes 503)."""
        others = [c for c in self._others() if c._lingering is None]
        silent = [c for c in others if not c.heard and not _bytes_waiting(c.transport)]
        unfinished = [c for c in others if c.heard and c.reading]
        for victim in (*silent, *unfinished):
            if self._open() <= MAX_CONNECTIONS + PROBE_RESERVE:
                return
            victim._drop()

    def _make_room(self) -> bool:
        """Close the connection that should go first, if any may; True if one did."""
        others = self._others()
        slow_since = time.monotonic() - READ_GRACE_S
        # Not an idle kept-alive connection: that is Prometheus between two scrapes, and
        # closing it as it sends the next one resets that scrape (seen in bench/slow_clients).
        victim = next((c for c in others if c.stalled), None) or next(
            (c for c in others if c.reading and c._reading_since <= slow_since), None
        )
        if victim is None:
            return False
        victim._drop()
        return True


def _bytes_waiting(transport: asyncio.BaseTransport) -> bool:
    """Whether the client's bytes wait in the socket, not read yet by a busy event loop: it
    has spoken (FIONREAD, one ioctl; only asked when a probe finds the server full)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return True  # cannot tell: let it be
    try:
        count = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except OSError:
        return True
    return struct.unpack("i", count)[0] > 0
