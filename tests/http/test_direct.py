"""The scrape and the probes answered on the connection (exporter.http.direct): the same
answer as the app's routes give, byte for byte but the Date, without entering the app; and
whatever is not plainly one of them still goes to the app."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from exporter.http.server import HttpServer
from tests.helpers import served

OPENMETRICS = "application/openmetrics-text;version=1.0.0;escaping=underscores"


class CountingApp:
    """The ASGI app behind a server, counting the requests that reach it."""

    def __init__(self, app: Any) -> None:
        self.app, self.calls = app, 0
        self.state = app.state  # HttpServer finds the direct routes here

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.calls += 1
        await self.app(scope, receive, send)


@contextlib.contextmanager
def serving(tmp_path, host: str = "127.0.0.1") -> Iterator[tuple[HttpServer, CountingApp]]:
    apps: list[CountingApp] = []

    def counting(app: Any) -> CountingApp:
        apps.append(CountingApp(app))
        return apps[0]

    with served(tmp_path, host=host, wrap=counting) as (server, _):
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
def test_the_direct_answer_is_the_apps_answer(tmp_path, path: str, headers: str) -> None:
    """A request in one read is answered directly; the same request split over two reads
    goes to the app: both answers are the same bytes but the Date."""
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}Connection: close\r\n\r\n"
    with serving(tmp_path) as (server, app):
        whole = exchange(server.port, request.encode())
        assert app.calls == 0
        split = exchange(server.port, request[:9].encode(), request[9:].encode())
        assert app.calls == 1
    assert whole.startswith(b"HTTP/1.1 200 OK\r\n"), whole[:200]
    assert without_date(whole) == without_date(split)
    assert b"\r\ndate: " in whole.lower() and b"\r\nconnection: close" in whole.lower()


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


@pytest.mark.slow
@pytest.mark.parametrize(
    "request_bytes",
    [
        b"HEAD /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n"
        b"Connection: close\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n",
        b"GET /metricsx HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n",  # HTTP/1.1 without a Host
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Name: caf\xc3\xa9\r\n"  # obs-text
        b"Connection: close\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: 1\r\n folded\r\n"  # obs-fold
        b"Connection: close\r\n\r\n",
        b"GET /metrics HTTP/1.2\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        # Pipelined: both answered, in order, by the usual way.
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    ],
)
def test_what_is_not_plainly_a_scrape_or_probe_goes_the_usual_way(tmp_path, request_bytes) -> None:
    """Answered as the same bytes split over two reads are (never direct): by the app, or by
    h11's 400 where uvicorn refuses the request (a repeated Host)."""
    with serving(tmp_path) as (server, app):
        whole = exchange(server.port, request_bytes)
        calls = app.calls
        split = exchange(server.port, request_bytes[:9], request_bytes[9:])
        assert app.calls == 2 * calls
    assert whole.startswith(b"HTTP/1.1 "), whole[:200]
    assert without_date(whole) == without_date(split)


def test_a_request_h11_refuses_is_a_400_not_an_answer(tmp_path) -> None:
    """Looks plain to the direct path, but h11 (as uvicorn parses) refuses the header."""
    with serving(tmp_path) as (server, app):
        response = exchange(
            server.port,
            b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header: x\r\n\r\n",
        )
        assert app.calls == 0
    assert response.startswith(b"HTTP/1.1 400 "), response[:200]


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /readyz HTTP/1.1\r\nHost: localhost\r\nConnection: keep-alive, Close\r\n\r\n",
        b"GET /readyz HTTP/1.0\r\nHost: localhost\r\nConnection: keep-alive\r\n\r\n",
        b"GET /readyz HTTP/1.0\r\n\r\n",
    ],
)
def test_the_connection_closes_when_h11_would_close_it(tmp_path, request_bytes) -> None:
    """The server closes (the read ends) with the same bytes as the usual way."""
    with serving(tmp_path, host="0.0.0.0") as (server, app):
        whole = exchange(server.port, request_bytes)
        assert app.calls == 0
        split = exchange(server.port, request_bytes[:9], request_bytes[9:])
    assert whole.startswith(b"HTTP/1.1 200 OK\r\n") and without_date(whole) == without_date(split)


def test_http_1_0_is_answered_and_closed(tmp_path) -> None:
    with serving(tmp_path) as (server, app):
        response = exchange(server.port, b"GET /readyz HTTP/1.0\r\nHost: localhost\r\n\r\n")
        assert app.calls == 0
    assert response.startswith(b"HTTP/1.1 200 OK\r\n") and response.endswith(b'{"ready":true}')


def test_on_every_address_any_host_may_scrape(tmp_path) -> None:
    """Only a loopback listener checks the Host (exporter.http.browser); HTTP/1.1 without
    any Host is h11's 400 still."""
    with serving(tmp_path, host="0.0.0.0") as (server, app):
        response = exchange(
            server.port,
            b"GET /readyz HTTP/1.1\r\nHost: node-7.cluster:9445\r\nConnection: close\r\n\r\n",
        )
        hostless = exchange(server.port, b"GET /readyz HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert app.calls == 0
    assert response.startswith(b"HTTP/1.1 200 OK\r\n")
    assert hostless.startswith(b"HTTP/1.1 400 Bad Request\r\n"), hostless[:100]


@pytest.mark.parametrize("path", [b"/readyz", b"/stats"])
def test_http_1_0_without_a_host_is_served_on_loopback(tmp_path, path) -> None:
    """An HTTP/1.0 client sends no Host; a browser always does, so the loopback guard lets
    it through (issue 38), on the direct path and the app's."""
    with serving(tmp_path) as (server, _):
        response = exchange(server.port, b"GET " + path + b" HTTP/1.0\r\n\r\n")
        named = exchange(server.port, b"GET " + path + b" HTTP/1.0\r\nHost: evil.example\r\n\r\n")
    assert not response.startswith(b"HTTP/1.1 403"), response[:200]
    assert response.startswith((b"HTTP/1.1 200", b"HTTP/1.1 401")), response[:200]
    assert named.startswith(b"HTTP/1.1 403"), named[:200]
