"""A web page in the user's browser cannot drive the exporter: cross-site state changes are
refused (the demo's token-free admin actions included), and on a loopback-only server a
rebound Host name is refused (exporter/http/access.py)."""

from __future__ import annotations

import contextlib
import http.client
import json

import pytest

from exporter.http.access import is_loopback
from exporter.http.server import HttpServer
from tests.helpers import make_app, served


@pytest.fixture
def open_demo(tmp_path):
    """The demo as it ships (admin actions need no token), on a real server: the access check
    is the server's (exporter.http.access)."""
    with served(tmp_path, admin_token=None) as (server, _):
        yield server


def _ask(
    server, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b""
) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.request(method, path, body=body, headers=headers or {})
    response = connection.getresponse()
    answer = response.status, response.read()
    connection.close()
    return answer


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "http://evil.example"},
        {"Origin": "http://127.0.0.1.evil.example"},
        {"Origin": "null"},  # a sandboxed frame or a file:// page
        {"Sec-Fetch-Site": "cross-site"},
    ],
)
def test_a_cross_site_page_cannot_act(open_demo, headers):
    for method, path in (("POST", "/snapshot"), ("POST", "/empty-cache"), ("POST", "/history")):
        status, body = _ask(
            open_demo, method, path, {**headers, "Content-Type": "text/plain"}, b"{}"
        )
        assert status == 403, (method, path, body)
        assert "cross-origin" in json.loads(body)["detail"]
    assert json.loads(_ask(open_demo, "GET", "/snapshots")[1])["snapshots"] == []


def test_the_page_itself_and_non_browser_clients_still_act(open_demo):
    origin = f"http://127.0.0.1:{open_demo.port}"
    status, body = _ask(open_demo, "POST", "/snapshot", {"Origin": origin})
    assert status == 201, body
    assert _ask(open_demo, "POST", "/snapshot")[0] == 201  # curl, the CLI: no Origin
    # Reading is not a state change: a cross-site GET passes here (the browser itself keeps
    # the page from reading the answer; rebinding is the Host check's).
    assert _ask(open_demo, "GET", "/api/window", {"Origin": "http://evil.example"})[0] == 200


def _get(port: int, host: str) -> int:
    with contextlib.closing(http.client.HTTPConnection("127.0.0.1", port, timeout=10)) as c:
        c.putrequest("GET", "/metrics", skip_host=True)
        c.putheader("Host", host)
        c.endheaders()
        response = c.getresponse()
        response.read()
        return response.status


@pytest.mark.slow
def test_a_loopback_server_refuses_a_rebound_host_name(tmp_path):
    with served(tmp_path) as (server, _):
        port = server.port
        for host in ("evil.example", f"evil.example:{port}", f"10.0.0.1:{port}", ""):
            assert _get(port, host) == 403, host
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "127.0.0.2"):
            assert _get(port, host) == 200, host


def test_a_server_on_every_address_serves_any_host_name(tmp_path):
    app, _ = make_app(tmp_path)
    server = HttpServer(app, "0.0.0.0", 0)
    server.start()
    try:
        assert _get(server.port, "gpumem-exporter.monitoring.svc:9445") == 200
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("LOCALHOST:9445", True),
        ("app.localhost", True),
        ("127.0.0.1", True),
        ("127.1.2.3:80", True),
        ("[::1]:9445", True),
        ("::1", True),
        ("0.0.0.0", False),
        ("localhost.evil.example", False),
        ("evil.example", False),
        ("", False),
    ],
)
def test_loopback_names(host, loopback):
    assert is_loopback(host) is loopback
