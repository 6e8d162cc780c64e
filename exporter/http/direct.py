"""The scrape and the probes answered on the connection, without the ASGI app or h11.

Prometheus scrapes, and the kubelet probes, several times a minute for as long as the server
runs. Inside the serving process the ASGI round trip (a task, a scope, Starlette's routing
and middleware, FastAPI's dependency solving) cost 4x the work of the answer itself, and h11's
parsing and writing of a scrape another 137 us (of 147 us for the whole exchange, measured
on the development machine): so a `GET /metrics`, `/healthz` or `/readyz` that arrives whole
in one read, and that matches a strict subset of HTTP/1.x (the request line and header
fields in their plain token and visible-ASCII forms, a Host, no body, no upgrade), is read
here and answered from the same functions the app's routes call (exporter.http.server),
with the bytes uvicorn and h11 would write. Anything else (HEAD, a body, an upgrade, a
pipelined request, a request split over reads, a repeated or unusual header, a Host the
loopback guard would refuse) goes to h11 and the app the usual way, so what is accepted here
is a subset of what h11 accepts, and behaviour at the edges stays uvicorn's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import h11
from starlette.responses import PlainTextResponse, Response
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES

from exporter.http.browser import is_loopback
from exporter.http.guard import GuardedH11Protocol
from exporter.http.quiet import refresh_date
from exporter.http.web import DEFER, Refusal, WebSecurity

# path -> the answer, from the request's headers (lower-case names).
Routes = Mapping[bytes, Callable[[dict[bytes, bytes]], Response]]
# Headers whose presence sends a request the usual way.
_NOT_DIRECT = frozenset((b"content-length", b"transfer-encoding", b"upgrade", b"expect"))
# A whole request head of the plain form: GET, a target of visible ASCII, HTTP/1.0 or 1.1,
# header fields of a token name and a visible-ASCII value (RFC 9110's field-value without
# obs-text), nothing after the blank line. h11 accepts all of these.
_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_FIELD = _TOKEN + rb":[ \t]*(?:[!-~](?:[ \t!-~]*[!-~])?)?[ \t]*\r\n"
_HEAD = re.compile(rb"GET (/[!-~]*) HTTP/1\.([01])\r\n((?:" + _FIELD + rb")*)\r\n\Z")
# The longest head read here (h11's own limit is larger; Prometheus sends ~400 bytes).
_MAX_HEAD = 8192


class DirectH11Protocol(GuardedH11Protocol):
    """GuardedH11Protocol that answers `routes` itself. Made with functools.partial (uvicorn
    creates one protocol per connection): `routes`, and `loopback_only` where the server
    listens on loopback (the Host must then be a loopback name, as LoopbackHostGuard asks)."""

    def __init__(
        self,
        *args: Any,
        routes: Routes,
        loopback_only: bool,
        web: WebSecurity | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.routes = routes
        self.loopback_only = loopback_only
        self.web = web
        # Why this connection's client certificate is refused (client_allowed_sans): every
        # request on it is answered 403 with the reason, then the connection closes.
        self.refused: str | None = None
        self._refusal: Refusal | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if self.web is not None and self.scheme == "https":
            self.refused = self.web.peer_refused(transport.get_extra_info("peercert"))

    def data_received(self, data: bytes) -> None:
        self.heard = True  # answered here or not, the client has spoken (guard: room)
        refresh_date(self.server_state, self.config)
        if self.refused is not None:
            self._refuse(self.refused)
            return
        # Only while the last answer has left: one the client has not read yet makes this
        # request h11's, which waits for the buffer to drain and stops reading meanwhile
        # (round 4: answered here regardless, clients that never read grew the process by
        # hundreds of MB).
        drained = self.transport.get_write_buffer_size() == 0
        if self._waiting is None and drained and self._answer(data):
            return
        super().data_received(data)

    def _refuse(self, reason: str) -> None:
        body = reason.encode() + b"\n"
        self.transport.write(
            b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()

    def _direct_request(self, data: bytes) -> tuple[bytes, dict[bytes, bytes], bool] | None:
        """(path, headers, keep-alive) of a request this protocol answers, else None."""
        conn = self.conn
        if conn.our_state is not h11.IDLE or conn.their_state is not h11.IDLE:
            return None  # mid-request, or an answer still going out
        if len(data) > _MAX_HEAD or conn.trailing_data[0]:
            return None  # bytes of an earlier read wait in h11's buffer
        match = _HEAD.match(data)
        if match is None:
            return None
        target, minor, fields = match.groups()
        path = target.partition(b"?")[0]
        if path not in self.routes:
            return None
        headers: dict[bytes, bytes] = {}
        for field in fields.split(b"\r\n")[:-1]:
            name, _, value = field.partition(b":")
            name = name.lower()
            if name in headers or name in _NOT_DIRECT:
                return None  # h11 decides what a repeated field means
            headers[name] = value.strip(b" \t")
        host = headers.get(b"host")
        if host is None and minor == b"1":
            return None  # h11 answers 400: HTTP/1.1 needs a Host
        if self.loopback_only and host is not None and not is_loopback(host.decode("ascii")):
            return None  # the app's guard answers 403
        self._refusal = None
        if self.web is not None:
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            client = self.client[0] if self.client else ""
            refusal = self.web.admit(
                path.decode("ascii"), authorization, client=client, may_block=False
            )
            if refusal is DEFER:
                return None  # a password not seen yet: checked in a thread by the app's guard
            self._refusal = refusal
        connection = {t.strip().lower() for t in headers.get(b"connection", b"").split(b",")}
        # As h11 decides: HTTP/1.0 closes, HTTP/1.1 keeps the connection unless told to close;
        # and a reserved slot serves one request (GuardedH11Protocol).
        keep_alive = minor == b"1" and b"close" not in connection and not self.one_request
        return path, headers, keep_alive

    def _answer(self, data: bytes) -> bool:
        request = self._direct_request(data)
        if request is None:
            return False
        path, headers, keep_alive = request
        self._unset_keepalive_if_required()
        self._disarm()  # the whole request is in: no read deadline
        refusal = self._refusal
        if refusal is not None:
            response: Response = PlainTextResponse(
                refusal.reason + "\n", refusal.status, headers=dict(refusal.headers)
            )
        else:
            response = self.routes[path](headers)
        status = response.status_code
        # What h11 writes for uvicorn: the status line, the default headers (date, server),
        # the response's own (and the web config's), and h11's Connection: close when the
        # connection ends.
        head = [b"HTTP/1.1 %d %s\r\n" % (status, STATUS_PHRASES[status])]
        fields = (*self.server_state.default_headers, *response.raw_headers)
        if self.web is not None:
            fields += tuple(
                (name.encode("latin-1"), value.encode("latin-1"))
                for name, value in self.web.config.headers.items()
            )
        head += [name + b": " + value + b"\r\n" for name, value in fields]
        if not keep_alive:
            head.append(b"Connection: close\r\n")
        head.append(b"\r\n")
        # One write: the head and the body leave in one segment.
        self.transport.write(b"".join(head) + response.body)
        if not keep_alive:
            self.transport.close()
        self.on_response_complete()  # the count, the keep-alive timer, reading resumed
        return True
