"""The scrape and the probes answered before the app (exporter.http.server.OpenRoutes): the
same answer as the app's routes give, byte for byte but the Date, without entering the app.
And what httptools (llhttp) refuses, the request-smuggling forms among it, is its 400 before
any route sees it, whole or split over reads; a head past MAX_HEAD_BYTES is 431."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from exporter.http import guard
from exporter.http.server import HttpServer, around
from tests.helpers import served

OPENMETRICS = "application/openmetrics-text;version=1.0.0;escaping=underscores"


class CountingApp:
    """The ASGI app behind a server, counting the requests that reach it."""

    def __init__(self, app: Any, *, shortcut: bool = True) -> None:
        self.app, self.calls = app, 0
        self.runtime: Any = None  # serving() sets the runtime it serves
        # HttpServer finds the open routes here (none: every request goes to the app).
        parts = around(app)
        self.state = SimpleNamespace(around=parts if shortcut else replace(parts, open_routes={}))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.calls += 1
        await self.app(scope, receive, send)


@contextlib.contextmanager
def serving(
    tmp_path, host: str = "127.0.0.1", *, shortcut: bool = True
) -> Iterator[tuple[HttpServer, CountingApp]]:
    apps: list[CountingApp] = []

    def counting(app: Any) -> CountingApp:
        apps.append(CountingApp(app, shortcut=shortcut))
        return apps[0]

    with served(tmp_path, host=host, wrap=counting) as (server, runtime):
        apps[0].runtime = runtime
        yield server, apps[0]


def exchange(port: int, *parts: bytes, pause_s: float = 0.05) -> bytes:
    """Send `parts` (each its own write, `pause_s` apart), read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        for i, part in enumerate(parts):
            if i:
                time.sleep(pause_s)
            sock.sendall(part)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def without_date(response: bytes) -> bytes:
    """The response(s) but the Date, and but /healthz's sample age (and so its length),
    which moves between two requests."""
    response = re.sub(rb"(?im)^date: [^\r]*\r\n", b"", response)
    if b'"sample_age_s":' in response:
        response = re.sub(rb'"sample_age_s":[0-9.]+', b'"sample_age_s":_', response)
        response = re.sub(rb"(?im)^content-length: [0-9]+\r\n", b"", response)
    return response


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/metrics", ""),
        ("/metrics", f"Accept: {OPENMETRICS}\r\n"),
        ("/metrics", f"Accept: {OPENMETRICS}\r\nAccept-Encoding: gzip\r\n"),
        ("/metrics?collect[]=x", "Accept-Encoding: gzip\r\n"),
        ("/healthz", ""),
        ("/readyz", ""),
    ],
)
def test_the_open_routes_answer_is_the_apps_answer(tmp_path, path: str, headers: str) -> None:
    """Answered before the app, or by the app's own route (a second server on the same app,
    with no open routes of its own): the same bytes but the Date, the sample held still."""
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}Connection: close\r\n\r\n"
    with serving(tmp_path) as (server, app):
        through_app = CountingApp(app.app, shortcut=False)
        second = HttpServer(through_app, "127.0.0.1", 0)  # type: ignore[arg-type]
        second.start()
        try:
            app.runtime.sampler.stop()  # one sample for both
            shortcut = exchange(server.port, request.encode())
            split = exchange(server.port, request[:9].encode(), request[9:].encode())
            by_app = exchange(second.port, request.encode())
        finally:
            second.stop()
        assert app.calls == 0 and through_app.calls == 1
    assert shortcut.startswith(b"HTTP/1.1 200 OK\r\n"), shortcut[:200]
    assert without_date(shortcut) == without_date(by_app) == without_date(split)
    assert b"\r\ndate: " in shortcut.lower() and b"\r\nconnection: close" in shortcut.lower()


def test_prometheus_kept_alive_scrapes_never_enter_the_app(tmp_path) -> None:
    with serving(tmp_path) as (server, app):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        for _ in range(5):
            conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
            response = conn.getresponse()
            body = gzip.decompress(response.read())
            assert response.status == 200 and b"gpumem_exporter_build_info" in body
            conn.request("GET", "/healthz")
            assert conn.getresponse().read().startswith(b'{"status":')
        conn.close()
        assert app.calls == 0
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        conn.request("GET", "/")  # the page is the app's
        assert conn.getresponse().status == 200
        conn.close()
        assert app.calls == 1


# What llhttp refuses with uvicorn's 400, the forms request smuggling is made of among them.
REFUSED = {
    "Content-Length and Transfer-Encoding": b"POST /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "two Content-Lengths": b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Length: 0\r\nContent-Length: 5\r\n\r\n",
    "obs-fold": b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: 1\r\n folded\r\n"
    b"Connection: close\r\n\r\n",
    "bare LF": b"GET /metrics HTTP/1.1\nHost: 127.0.0.1\nConnection: close\n\n",
    "space in a field name": b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header: x\r\n\r\n",
    "space before the colon": b"GET /metrics HTTP/1.1\r\nHost : 127.0.0.1\r\n\r\n",
    "HTTP/1.2": b"GET /metrics HTTP/1.2\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    # RFC 9112's Host rule, which llhttp leaves to the server (exporter.http.access).
    "HTTP/1.1 without a Host": b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n",
    "two Hosts": b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\n"
    b"Connection: close\r\n\r\n",
}


@pytest.mark.parametrize("request_bytes", REFUSED.values(), ids=REFUSED.keys())
def test_what_the_parser_refuses_is_its_400_whole_or_split(tmp_path, request_bytes) -> None:
    """One answer, the parser's: a 400 and nothing else, in one read or in two, and never a
    route's answer (the app is not called)."""
    with serving(tmp_path) as (server, app):
        whole = exchange(server.port, request_bytes)
        split = exchange(server.port, request_bytes[:9], request_bytes[9:])
        assert app.calls == 0
    for answer in (whole, split):
        assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer[:200]
        assert answer.count(b"HTTP/1.1 ") == 1, answer


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"HEAD /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n"
        b"Connection: close\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Name: caf\xc3\xa9\r\n"  # obs-text
        b"Connection: close\r\n\r\n",
        # Pipelined: both answered, in order.
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    ],
)
def test_what_the_parser_accepts_is_answered_alike_whole_or_split(tmp_path, request_bytes):
    with serving(tmp_path) as (server, app):
        whole = exchange(server.port, request_bytes)
        split = exchange(server.port, request_bytes[:9], request_bytes[9:])
        assert app.calls == 0
    assert whole.startswith(b"HTTP/1.1 200 OK\r\n"), whole[:200]
    assert without_date(whole) == without_date(split)
    assert whole.count(b"HTTP/1.1 200 OK") == request_bytes.count(b" HTTP/1.1\r\n")


@pytest.mark.parametrize("pieces", [1, 8])
def test_a_request_head_past_the_limit_is_431(tmp_path, pieces) -> None:
    """Whole in one read, or trickled over several and never ended (httptools keeps a field's
    bytes until it ends: they are counted as they come), a head past MAX_HEAD_BYTES is
    answered 431 and closed; one just under it is served."""
    field = b"X-Padding: " + b"a" * guard.MAX_HEAD_BYTES
    request = b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + field
    if pieces == 1:
        request += b"\r\n\r\n"
    step = len(request) // pieces + 1
    with serving(tmp_path) as (server, _):
        answer = exchange(
            server.port, *(request[i : i + step] for i in range(0, len(request), step))
        )
        fits = exchange(
            server.port,
            b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"X-Padding: " + b"a" * (guard.MAX_HEAD_BYTES - 200) + b"\r\n\r\n",
        )
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), answer[:200]
    assert fits.startswith(b"HTTP/1.1 200 OK\r\n"), fits[:200]


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /readyz HTTP/1.1\r\nHost: localhost\r\nConnection: keep-alive, Close\r\n\r\n",
        b"GET /readyz HTTP/1.0\r\nHost: localhost\r\nConnection: keep-alive\r\n\r\n",
        b"GET /readyz HTTP/1.0\r\n\r\n",
    ],
)
def test_the_connection_closes_when_the_request_says_so(tmp_path, request_bytes) -> None:
    """The server closes (the read ends) after the answer, whole or split."""
    with serving(tmp_path, host="0.0.0.0") as (server, app):
        whole = exchange(server.port, request_bytes)
        split = exchange(server.port, request_bytes[:9], request_bytes[9:])
        assert app.calls == 0
    assert whole.startswith(b"HTTP/1.1 200 OK\r\n") and without_date(whole) == without_date(split)


def test_http_1_0_is_answered_and_closed(tmp_path) -> None:
    with serving(tmp_path) as (server, app):
        response = exchange(server.port, b"GET /readyz HTTP/1.0\r\nHost: localhost\r\n\r\n")
        assert app.calls == 0
    assert response.startswith(b"HTTP/1.1 200 OK\r\n") and response.endswith(b'{"ready":true}')


def test_on_every_address_any_host_may_scrape(tmp_path) -> None:
    """Only a loopback listener checks the Host's name (exporter.http.access)."""
    with serving(tmp_path, host="0.0.0.0") as (server, app):
        response = exchange(
            server.port,
            b"GET /readyz HTTP/1.1\r\nHost: node-7.cluster:9445\r\nConnection: close\r\n\r\n",
        )
        assert app.calls == 0
    assert response.startswith(b"HTTP/1.1 200 OK\r\n")


@pytest.mark.parametrize("path", [b"/readyz", b"/stats"])
def test_http_1_0_without_a_host_is_served_on_loopback(tmp_path, path) -> None:
    """An HTTP/1.0 client sends no Host; a browser always does, so the loopback guard lets
    it through (issue 38), on the open routes and the app's."""
    with serving(tmp_path) as (server, _):
        response = exchange(server.port, b"GET " + path + b" HTTP/1.0\r\n\r\n")
        named = exchange(server.port, b"GET " + path + b" HTTP/1.0\r\nHost: evil.example\r\n\r\n")
    assert not response.startswith(b"HTTP/1.1 403"), response[:200]
    assert response.startswith((b"HTTP/1.1 200", b"HTTP/1.1 401")), response[:200]
    assert named.startswith(b"HTTP/1.1 403"), named[:200]
