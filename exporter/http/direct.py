"""The scrape and the probes answered on the connection, without the ASGI app.

Prometheus scrapes, and the kubelet probes, several times a minute for as long as the server
runs; the ASGI round trip (a task, a scope, Starlette's routing and middleware, FastAPI's
dependency solving) cost 4x the work of the answer itself inside the serving process. So a
plain `GET /metrics`, `/healthz` or `/readyz` that arrives whole in one read is parsed by h11
as uvicorn would, and answered from the same functions the app's routes call
(exporter.http.server), with the headers uvicorn would send. Anything else (HEAD, a body,
an upgrade, a pipelined request, a request split over reads, a Host the loopback guard would
refuse) goes to the app the usual way, so behaviour at the edges stays uvicorn's and the app's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import h11
from starlette.responses import Response
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES

from exporter.http.browser import is_loopback
from exporter.http.guard import GuardedH11Protocol
from exporter.http.quiet import refresh_date

# path -> the answer, from the request's headers (lower-case names).
Routes = Mapping[bytes, Callable[[dict[bytes, bytes]], Response]]
# Headers whose presence, or repetition, sends a request the usual way.
_NOT_DIRECT = (b"content-length", b"transfer-encoding", b"upgrade", b"expect")
_END = b"\r\n\r\n"


class DirectH11Protocol(GuardedH11Protocol):
    """GuardedH11Protocol that answers `routes` itself. Made with functools.partial (uvicorn
    creates one protocol per connection): `routes`, and `loopback_only` where the server
    listens on loopback (the Host must then be a loopback name, as LoopbackHostGuard asks)."""

    def __init__(self, *args: Any, routes: Routes, loopback_only: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.routes = routes
        self.loopback_only = loopback_only

    def data_received(self, data: bytes) -> None:
        refresh_date(self.server_state, self.config)
        if self._waiting is None and self._answer(data):
            return
        super().data_received(data)

    def _direct_request(self, data: bytes) -> tuple[bytes, dict[bytes, bytes]] | None:
        """(path, headers) of a request this protocol answers itself, else None."""
        conn = self.conn
        if conn.our_state is not h11.IDLE or conn.their_state is not h11.IDLE:
            return None  # mid-request, or an answer still going out
        if not data.startswith(b"GET /") or not data.endswith(_END) or data.count(_END) != 1:
            return None
        if conn.trailing_data[0]:
            return None  # bytes of an earlier read wait in h11's buffer
        line, *lines = data[: -len(_END)].split(b"\r\n")
        parts = line.split(b" ")
        if len(parts) != 3:
            return None
        path = parts[1].partition(b"?")[0]
        if path not in self.routes:
            return None
        headers: dict[bytes, bytes] = {}
        for header in lines:
            name, colon, value = header.partition(b":")
            name = name.lower()
            if not colon or name in headers or name in _NOT_DIRECT:
                return None
            headers[name] = value.strip(b" \t")
        if self.loopback_only and not is_loopback(headers.get(b"host", b"").decode("latin-1")):
            return None  # the app's guard answers 403
        return path, headers

    def _answer(self, data: bytes) -> bool:
        request = self._direct_request(data)
        if request is None:
            return False
        path, headers = request
        self._unset_keepalive_if_required()
        self._disarm()  # the whole request is in: no read deadline
        conn = self.conn
        conn.receive_data(data)
        try:
            event, end = conn.next_event(), conn.next_event()
        except h11.RemoteProtocolError:
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
            return True
        if not isinstance(event, h11.Request) or not isinstance(end, h11.EndOfMessage):
            self.send_400_response("Invalid HTTP request received.")  # not reached: a GET head
            return True
        response = self.routes[path](headers)
        head = h11.Response(
            status_code=response.status_code,
            headers=[*self.server_state.default_headers, *response.raw_headers],
            reason=STATUS_PHRASES[response.status_code],
        )
        events = (head, h11.Data(data=bytes(response.body)), h11.EndOfMessage())
        # One write: the head and the body leave in one segment.
        self.transport.write(b"".join(conn.send(e) or b"" for e in events))
        if conn.our_state is h11.MUST_CLOSE:  # the client asked to close, or HTTP/1.0
            conn.send(h11.ConnectionClosed())
            self.transport.close()
        self.on_response_complete()  # keep-alive timer, next cycle, as uvicorn does
        return True
