"""No route of the exporter's own server is reachable without passing the one access check
(exporter.http.access): every route the app declares, every method it takes, the open routes
and their shortcut included, is asked on a real server in ways the check alone refuses."""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator

import bcrypt
import pytest
from starlette.routing import Mount

from exporter.http.access import CROSS_SITE, NO_HOST, REBOUND, AdminPaths
from exporter.http.server import HttpServer, around
from tests.helpers import make_app
from tests.support.pki import web_config

PROBES = ("/healthz", "/readyz")


def every_route(app) -> Iterator[tuple[str, str]]:
    """(method, path) of each route the app serves, parameters filled in."""
    for route in app.routes:
        path = re.sub(r"\{[^}]*\}", "x", route.path)
        if isinstance(route, Mount):
            yield "GET", path + "/x"
            continue
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            yield method, path


def detail(method: str, body: bytes) -> str | None:
    """The JSON answer's detail (None for HEAD: no body comes back)."""
    return None if method == "HEAD" else json.loads(body)["detail"]


def ask(port: int, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes, str]:
    """Status, body and WWW-Authenticate of one request on a new connection."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
    for name, value in headers.items():
        connection.putheader(name, value)
    connection.putheader("Content-Length", "0")
    connection.endheaders()
    response = connection.getresponse()
    answer = response.status, response.read(), response.getheader("WWW-Authenticate", "")
    connection.close()
    return answer


@pytest.fixture
def server(tmp_path, request):
    app, _ = make_app(tmp_path, **getattr(request, "param", {}))
    serving = HttpServer(app, "127.0.0.1", 0)
    serving.start()
    try:
        yield app, serving
    finally:
        serving.stop()


def test_the_routes_are_many_and_the_admin_ones_are_declared(server):
    app, _ = server
    routes = list(every_route(app))
    assert len(routes) > 20 and ("GET", "/metrics") in routes and ("POST", "/snapshot") in routes
    admin = around(app).admin
    assert isinstance(admin, AdminPaths)
    assert "/snapshot" in admin and "/snapshots/x" in admin and "/stats" in admin
    assert "/metrics" not in admin and "/" not in admin and "/healthz" not in admin


def test_no_route_answers_a_rebound_host_name(server):
    """On a loopback server every route, every method, refuses another Host name before it
    runs: the check's own answer, never the route's."""
    app, serving = server
    for method, path in every_route(app):
        status, body, _ = ask(serving.port, method, path, {"Host": "evil.example"})
        expected = (403, None if method == "HEAD" else REBOUND.reason)
        assert (status, detail(method, body)) == expected, (method, path)


def test_no_route_answers_without_a_host_or_with_two(server):
    app, serving = server
    for method, path in every_route(app):
        for headers in ({}, {"Host": "localhost", "host": "localhost"}):
            status, body, _ = ask(serving.port, method, path, headers)
            expected = (400, None if method == "HEAD" else NO_HOST.reason)
            assert (status, detail(method, body)) == expected, (method, path)


def test_no_route_changes_state_for_a_cross_site_page(server):
    app, serving = server
    unsafe = [(m, p) for m, p in every_route(app) if m not in ("GET", "HEAD", "OPTIONS")]
    assert len(unsafe) >= 6
    for method, path in unsafe:
        status, body, _ = ask(
            serving.port, method, path, {"Host": "localhost", "Origin": "http://evil.example"}
        )
        assert (status, json.loads(body)["detail"]) == (403, CROSS_SITE.reason), (method, path)


@pytest.fixture
def basic_auth(tmp_path):
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()
    path = web_config(tmp_path, f"basic_auth_users:\n  prometheus: {hashed}\n")
    return {"web_config_file": str(path)}


@pytest.mark.parametrize("admin_token", [None, "s3cret-token"])
def test_with_basic_auth_only_the_probes_and_self_authenticating_admin_routes_pass(
    tmp_path, basic_auth, admin_token
):
    """With users in the web config, every route but the probes asks for the password; admin
    routes where the admin API has a token of its own answer the token's 401 instead."""
    app, _ = make_app(tmp_path, admin_token=admin_token, **basic_auth)
    serving = HttpServer(app, "127.0.0.1", 0)
    serving.start()
    try:
        for method, path in every_route(app):
            status, _, asks = ask(serving.port, method, path, {"Host": "localhost"})
            if path in PROBES:
                assert status in (200, 503, 405), (method, path, status)
            elif admin_token and path in around(app).admin:
                assert (status, asks) == (401, "Bearer"), (method, path)  # the token's
            else:
                assert (status, asks) == (401, "Basic"), (method, path)
    finally:
        serving.stop()
