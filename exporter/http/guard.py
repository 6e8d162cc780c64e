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

The guard wraps uvicorn's HTTP/1.1 protocol (httptools) rather than extending it: it sits
between the transport and that protocol as an asyncio protocol of its own (GuardedConnection),
reads the request stream with its own httptools parser (where each request starts and ends,
how long its head is), and learns where each answer starts and ends from the ASGI side
(AnswerWatch, the outermost app), where it also says `Connection: close` and the Date. Nothing
of uvicorn's protocol is reached into but its access log and logger (exporter.internals).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import struct
import termios
import time
from collections.abc import Callable
from email.utils import formatdate
from typing import Any

import httptools

from exporter.internals import quiet_http_protocol
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


class Connections:
    """One server's open connections as the guard sees them, and each by its client's address
    (the ASGI scope's `client`: how AnswerWatch finds the connection a request came on)."""

    def __init__(self) -> None:
        self.open: set[GuardedConnection] = set()
        self.by_client: dict[tuple[Any, ...], GuardedConnection] = {}

    def add(self, connection: GuardedConnection) -> None:
        self.open.add(connection)
        if connection.client is not None:
            self.by_client[connection.client] = connection

    def discard(self, connection: GuardedConnection) -> None:
        self.open.discard(connection)
        if connection.client is not None and self.by_client.get(connection.client) is connection:
            del self.by_client[connection.client]

    def abort_all(self) -> None:
        """Close at once every connection still open: what uvicorn's graceful shutdown left
        (an answer its client never reads cannot be flushed, so closing it waits forever),
        which the stopped server's event loop would otherwise leave open behind it."""
        for connection in list(self.open):
            connection.transport.abort()


class GatheredWrites:
    """The connection's transport as uvicorn's protocol uses it (what its HTTP/1.1 protocol
    and flow control call; it never hands the connection on: websockets are off). uvicorn writes an
    answer's head and body apart, and with TCP_NODELAY (bind_socket says why) each write was a
    segment of its own: a scrape's two sends cost the server more than the rest of its answer
    (docs/performance.md). Gathered here, they leave as one write at the end of the event
    loop's turn (before the task of a pipelined request's answer takes its turn)."""

    __slots__ = ("_loop", "_pending", "_transport", "ended")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._pending: list[bytes] = []
        self.ended = False  # the guard answered and half-closed: uvicorn's writes are dropped

    def write(self, data: bytes) -> None:
        if self.ended:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        self._pending = []
        if not self.ended and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()


def guarded(
    connections: Connections, web: WebSecurity | None, **uvicorn_args: Any
) -> GuardedConnection:
    """A new connection's protocol: uvicorn's HTTP/1.1 protocol (exporter.internals), made with
    the arguments uvicorn gives its protocol factory, inside the guard."""
    return GuardedConnection(quiet_http_protocol(log, **uvicorn_args), connections, web)


class GuardedConnection(asyncio.Protocol):
    """One connection: the deadlines and slots above, the request head bounded
    (MAX_HEAD_BYTES), and, where the web config asks for client certificates with allowed
    names, a 403 for every request of a connection whose certificate has none of them; what
    passes goes to `inner` (uvicorn's HTTP protocol), which writes through GatheredWrites."""

    def __init__(
        self,
        inner: asyncio.Protocol,
        connections: Connections,
        web: WebSecurity | None = None,
    ) -> None:
        self.inner = inner
        self.connections = connections
        self.web = web
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.writes: GatheredWrites | None = None
        self.client: tuple[Any, ...] | None = None  # (host, port), as the ASGI scope has it
        # Why this connection's client certificate is refused (client_allowed_sans).
        self.refused: str | None = None
        self.opened = time.monotonic()
        self._read_deadline: asyncio.TimerHandle | None = None
        self._reading_since = 0.0
        self._write_deadline: asyncio.TimerHandle | None = None
        # The request stream as the guard reads it (uvicorn's protocol reads it again).
        self._parser: Any = httptools.HttpRequestParser(self)
        self._parsing = True  # False after what httptools cannot read: uvicorn answers it
        # The request head in progress (None: not in one): its bytes parsed, and the bytes of
        # the reads that left it open; and whether a whole head of this read was too long.
        self._head_bytes: int | None = None
        self._head_read = 0
        self._head_too_large = False
        # Requests handed to the app whose answers are not complete (AnswerWatch), and whether
        # one of them has begun its answer.
        self.in_flight = 0
        self.answering = False
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

    # -- the transport's calls -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        self.client = tuple(peer[:2]) if isinstance(peer, tuple) else None
        self.connections.add(self)
        if self.web is not None and transport.get_extra_info("sslcontext") is not None:
            self.refused = self.web.peer_refused(transport.get_extra_info("peercert"))
        self.writes = GatheredWrites(transport, self.loop)
        self.inner.connection_made(self.writes)  # type: ignore[arg-type]
        self._arm()
        full = len(self.connections.open) > MAX_CONNECTIONS and self._open() > MAX_CONNECTIONS
        if full and not self._make_room():
            self._waiting = bytearray()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_write()
        if self._lingering is not None:
            self._lingering.cancel()
            self._lingering = None
        self.connections.discard(self)
        self.inner.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(WRITE_TIMEOUT_S, self._write_stalled)

    def resume_writing(self) -> None:
        self.inner.resume_writing()
        self._disarm_write()

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
        if self._parsing:
            try:
                self._parser.feed_data(data)
            # What httptools cannot read (uvicorn answers 400), or an upgrade's head (uvicorn
            # answers it as plain HTTP: websockets are off), after which the stream is not
            # HTTP's: the guard reads no further. HttpParserUpgrade is not an HttpParserError.
            except (httptools.HttpParserError, httptools.HttpParserUpgrade):
                self._parsing = False
        if self._head_bytes is not None:
            # A head still open after this read: httptools keeps a header field's bytes until
            # it ends, so what this read brought counts (at most a read of earlier requests'
            # bytes too many).
            self._head_read += len(data)
            self._head_too_large |= self._head_read > MAX_HEAD_BYTES
        if self._head_too_large:
            if self.in_flight:
                self.transport.close()  # an answer going out: no room for ours
            else:
                self._linger(HEAD_TOO_LARGE)
            return
        self.inner.data_received(data)

    # -- the guard's parser: where a request starts and ends --------------------------------

    def on_message_begin(self) -> None:
        self._head_bytes, self._head_read = 0, 0
        if not self.reading:  # the first bytes of the next request on a kept-alive one
            self._arm()

    def on_url(self, url: bytes) -> None:
        if self._head_bytes is not None:
            self._head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head_bytes is not None:
            self._head_bytes += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        if (self._head_bytes or 0) > MAX_HEAD_BYTES:
            self._head_too_large = True  # answered 431 instead of by the app
        else:
            self.in_flight += 1
        self._head_bytes = None

    def on_message_complete(self) -> None:
        self._disarm()  # the request is in: no read deadline while it is answered

    # -- AnswerWatch's calls -----------------------------------------------------------------

    def answer_started(self) -> None:
        self.answering = True

    def answer_done(self) -> None:
        self.answering = False
        self.in_flight = max(self.in_flight - 1, 0)

    # -- answers of the guard's own ----------------------------------------------------------

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
        return sum(1 for c in self.connections.open if c._lingering is None)

    def _busy(self) -> None:
        """503 with Retry-After, then close: a full server says so in HTTP (a reset reads as a
        dead target)."""
        _dropped.warning("busy", "HTTP connections at the limit: answered 503 to a newcomer")
        self._waiting = None
        self._linger(BUSY_RESPONSE)

    def _linger(self, answer: bytes) -> None:
        """Write `answer`, send FIN, drain the client for up to LINGER_S, then close. uvicorn's
        protocol writes nothing after it (a write after the FIN would raise)."""
        self._disarm()
        transport = self.transport
        if transport.is_closing():
            return
        if self.writes is not None:
            self.writes.flush()
            self.writes.ended = True
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
        elif not self.answering:
            self._linger(BUSY_RESPONSE)
        else:
            self.transport.close()

    # -- making room -----------------------------------------------------------------------

    def _others(self) -> list[GuardedConnection]:
        """The other connections that may be closed for room, oldest first (not those going
        already: closing one frees nothing)."""
        return sorted(
            (c for c in self.connections.open if c is not self and not c.transport.is_closing()),
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


_date = (0, b"")  # (the second, its Date header value), shared: the clock is one


def http_date() -> bytes:
    """The Date header's value (RFC 9110: an origin server with a clock sends it), formatted
    once a second."""
    global _date
    second = int(time.time())
    if second != _date[0]:
        _date = (second, formatdate(second, usegmt=True).encode())
    return _date[1]


def _asks_to_close(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name == b"connection" and b"close" in value.lower() for name, value in headers)


class AnswerWatch:
    """The guard's ASGI side, the outermost app: every answer gets the current Date, and the
    connection a request came on (found by the client's address) learns when its answer
    starts and ends. Where that connection serves one request (a reserved slot) or the client
    asked to close, the answer says `Connection: close`, and uvicorn closes after it (uvicorn
    0.40 and older kept such a connection open on httptools: the header decides)."""

    def __init__(self, app: Callable[..., Any], connections: Connections) -> None:
        self.app = app
        self.connections = connections

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        connection = self.connections.by_client.get(tuple(client)) if client else None
        close = connection is not None and (
            connection.one_request or _asks_to_close(scope["headers"])
        )

        async def watched(message: Any) -> None:
            if message["type"] == "http.response.start":
                extra = [(b"date", http_date())]
                if close:
                    extra.append((b"connection", b"close"))
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
                if connection is not None:
                    connection.answer_started()
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:  # answered, or failed (uvicorn then answers 500 itself)
            if connection is not None:
                connection.answer_done()
