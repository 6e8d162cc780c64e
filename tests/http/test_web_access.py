"""Basic auth, response headers and the rate limit of the web config, on the real server (the
one access check, exporter.http.access: tests/http/test_access.py asks every route), and
admin credentials refused over cleartext from afar."""

from __future__ import annotations

import base64
import http.client
import logging

import bcrypt
import httpx
import pytest

import exporter.webconfig.basic_auth as basic_auth
from tests.helpers import AUTH, TOKEN, make_app, served
from tests.support.pki import web_config

# Low cost: the tests check many passwords.
HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def _request(
    server, method: str, path: str, headers=None, body: bytes | None = None, source: str = ""
):
    """One request on a new connection; `source`: the client's loopback address (127.0.0.2,
    ...: Linux routes all of 127/8 to lo), so that tests can be several clients."""
    source_address = (source, 0) if source else None
    connection = http.client.HTTPConnection(
        "127.0.0.1", server.port, timeout=5, source_address=source_address
    )
    try:
        connection.request(
            method, path, body=body, headers={"Host": "localhost", **(headers or {})}
        )
        response = connection.getresponse()
        return response.status, response.msg, response.read()
    finally:
        connection.close()


@pytest.fixture
def users_file(tmp_path):
    return web_config(
        tmp_path,
        f"basic_auth_users:\n  prometheus: {HASH}\n"
        "http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n",
    )


@pytest.mark.slow
def test_basic_auth_guards_metrics_and_the_page_not_the_probes(tmp_path, users_file):
    extra: dict[str, str] = {}
    with served(tmp_path, web_config_file=str(users_file)) as (server, _):
        status, headers, _ = _request(server, "GET", "/metrics", extra)
        assert status == 401 and headers.get("WWW-Authenticate") == "Basic"
        assert headers.get("X-Content-Type-Options") == "nosniff"
        for wrong in (
            _basic("prometheus", "nope"),
            _basic("nobody", "s3cret"),
            {"Authorization": "Basic !!"},
        ):
            assert _request(server, "GET", "/metrics", {**extra, **wrong})[0] == 401
        status, headers, body = _request(
            server, "GET", "/metrics", {**extra, **_basic("prometheus", "s3cret")}
        )
        assert status == 200 and b"gpumem_exporter_web_info" in body and b'basic_auth="on"' in body
        assert headers.get("X-Content-Type-Options") == "nosniff"
        assert _request(server, "GET", "/healthz", extra)[0] == 200
        assert _request(server, "GET", "/readyz", extra)[0] == 200
        assert _request(server, "GET", "/")[0] == 401
        assert _request(server, "GET", "/api/window")[0] == 401
        assert _request(server, "GET", "/api/window", _basic("prometheus", "s3cret"))[0] == 200


@pytest.fixture
def bcrypt_calls(monkeypatch) -> list[str]:
    """The passwords bcrypt-checked, in order (the real check still runs)."""
    calls: list[str] = []
    real = basic_auth._bcrypt_ok

    def counting(password: str, hashed: str) -> bool:
        calls.append(password)
        return real(password, hashed)

    monkeypatch.setattr(basic_auth, "_bcrypt_ok", counting)
    return calls


def test_a_password_is_bcrypt_checked_once_then_remembered(tmp_path, users_file, bcrypt_calls):
    with served(tmp_path, web_config_file=str(users_file)) as (server, _):
        for _ in range(5):
            assert _request(server, "GET", "/metrics", _basic("prometheus", "s3cret"))[0] == 200
        for _ in range(3):
            assert _request(server, "GET", "/metrics", _basic("prometheus", "wrong"))[0] == 401
    assert bcrypt_calls == ["s3cret", "wrong"]


def test_admin_routes_use_their_own_credentials_where_the_admin_api_has_some(tmp_path, users_file):
    with served(tmp_path, web_config_file=str(users_file)) as (server, _):
        # The bearer token authenticates the admin route; basic auth is not asked there.
        assert _request(server, "GET", "/stats", AUTH)[0] == 200
        assert _request(server, "GET", "/stats")[0] == 401
        assert _request(server, "GET", "/stats", _basic("prometheus", "s3cret"))[0] == 401


def test_the_demos_open_admin_api_stays_behind_basic_auth(tmp_path, users_file):
    """Without admin credentials the demo's admin API is open: basic auth then guards it."""
    with served(tmp_path, web_config_file=str(users_file), admin_token=None) as (server, _):
        assert _request(server, "GET", "/stats")[0] == 401
        assert _request(server, "GET", "/stats", {"Authorization": f"Bearer {TOKEN}"})[0] == 401
        assert _request(server, "GET", "/stats", _basic("prometheus", "s3cret"))[0] == 200


def test_the_rate_limit_answers_429_past_its_burst(tmp_path):
    extra: dict[str, str] = {}
    path = web_config(tmp_path, "rate_limit:\n  interval: 1h\n  burst: 3\n")
    with served(tmp_path, web_config_file=str(path)) as (server, _):
        statuses = [_request(server, "GET", "/metrics", extra)[0] for _ in range(5)]
    assert statuses == [200, 200, 200, 429, 429]


def test_one_client_past_its_limit_takes_no_scrape_or_probe_from_another(tmp_path):
    """Round 4, MED 7: one bucket for every client and path, /healthz included: one client
    polling /healthz made Prometheus's scrapes and the kubelet's probes 429. Now the probes
    are never limited, and each client has its own buckets, /metrics apart from the rest."""
    path = web_config(tmp_path, "rate_limit:\n  interval: 1h\n  burst: 3\n")
    poller, prometheus = "127.0.0.2", "127.0.0.3"
    with served(tmp_path, web_config_file=str(path)) as (server, _):
        for probe in ("/healthz", "/readyz"):
            assert {_request(server, "GET", probe, source=poller)[0] for _ in range(20)} == {200}
        polled = [_request(server, "GET", "/api/window", source=poller)[0] for _ in range(5)]
        assert polled == [200, 200, 200, 429, 429]
        # The poller's own scrapes have their bucket; another client's are untouched.
        assert _request(server, "GET", "/metrics", source=poller)[0] == 200
        scrapes = [_request(server, "GET", "/metrics", source=prometheus)[0] for _ in range(3)]
        assert scrapes == [200, 200, 200]
        assert _request(server, "GET", "/healthz", source=prometheus)[0] == 200


def test_a_client_past_its_limit_is_refused_before_its_password_is_checked(tmp_path, bcrypt_calls):
    """Round 4, MED 7: a password was bcrypt-checked before the bucket was asked, so a flood
    of new passwords cost 70 ms of CPU each however limited the client was."""
    path = web_config(
        tmp_path,
        f"basic_auth_users:\n  prometheus: {HASH}\nrate_limit:\n  interval: 1h\n  burst: 2\n",
    )
    with served(tmp_path, web_config_file=str(path)) as (server, _):
        statuses = [
            _request(server, "GET", "/metrics", _basic("prometheus", f"guess{n}"))[0]
            for n in range(10)
        ]
    assert statuses == [401, 401] + [429] * 8
    assert bcrypt_calls == ["guess0", "guess1"]  # the rest never reached bcrypt


def test_a_changed_users_list_applies_without_a_restart(tmp_path, users_file, monkeypatch):
    monkeypatch.setattr("exporter.webconfig.security.RECHECK_S", 0.0)
    with served(tmp_path, web_config_file=str(users_file)) as (server, _):
        assert _request(server, "GET", "/metrics", _basic("prometheus", "s3cret"))[0] == 200
        other = bcrypt.hashpw(b"rotated", bcrypt.gensalt(4)).decode()
        web_config(tmp_path, f"basic_auth_users:\n  prometheus: {other}\n")
        assert _request(server, "GET", "/metrics", _basic("prometheus", "s3cret"))[0] == 401
        assert _request(server, "GET", "/metrics", _basic("prometheus", "rotated"))[0] == 200


@pytest.mark.parametrize(
    ("client", "scheme", "allow", "expected"),
    [
        ("10.1.2.3", "http", False, 403),  # a credential in clear from another host
        ("10.1.2.3", "http", True, 200),  # the operator said so
        ("10.1.2.3", "https", False, 200),  # encrypted
        ("127.0.0.1", "http", False, 200),  # loopback: kubectl port-forward, a sidecar
    ],
)
def test_admin_credentials_over_cleartext_from_another_host_are_refused(
    tmp_path, client, scheme, allow, expected, caplog
):
    app, _ = make_app(tmp_path, allow_cleartext_admin=allow)
    transport = httpx.ASGITransport(app=app, client=(client, 40000))
    caplog.set_level(logging.WARNING, logger="exporter.audit")

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url=f"{scheme}://exporter") as c:
            return await c.post("/snapshot", headers=AUTH, json={})

    import asyncio

    response = asyncio.run(call())
    assert response.status_code in ((expected,) if expected == 403 else (200, 201, 202)), (
        response.text
    )
    if expected == 403:
        assert "plain HTTP" in response.json()["detail"]
        assert TOKEN not in caplog.text
        assert any(
            "cleartext" in r.getMessage() and client in r.getMessage() for r in caplog.records
        )


@pytest.mark.slow
def test_metrics_say_whether_admin_credentials_are_taken_in_clear(tmp_path):
    with served(tmp_path) as (server, _):
        body = _request(server, "GET", "/metrics")[2]
    assert b'admin_cleartext="loopback-only"' in body and b'tls="off"' in body
    with served(tmp_path, allow_cleartext_admin=True) as (server, _runtime):
        body = _request(server, "GET", "/metrics")[2]
    assert b'admin_cleartext="allowed"' in body


@pytest.mark.parametrize("path", ["/metrics", "/healthz", "/readyz"])
def test_head_answers_as_get_without_a_body(tmp_path, path):
    """Round 4, LOW 16: HEAD /metrics and /healthz answered 405 (node_exporter answers 200)."""
    with served(tmp_path) as (server, _):
        get_status, get_headers, _ = _request(server, "GET", path)
        status, headers, body = _request(server, "HEAD", path)
    assert (status, body) == (get_status, b"")
    assert headers.get("Content-Type") == get_headers.get("Content-Type")


def test_an_unknown_user_costs_what_a_known_one_does():
    """Round 4, LOW 9: an unknown user was checked against a fixed cost-10 hash, so a user
    whose hash has cost 12 answered in 249 ms against 64 ms: the time told who exists."""
    import time

    costly = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(12)).decode()
    auth = basic_auth.BasicAuth()
    users = {"prometheus": costly}

    def took(user: str, password: str) -> float:
        # The thread's CPU, not the wall clock: bcrypt works on this thread, and a busy
        # machine (CI runs tests 4 at once) stretched one wall-clock sample to 1.8x.
        started = time.thread_time()
        assert auth.check(users, _basic(user, password)["Authorization"]) is False
        return time.thread_time() - started

    took("nobody", "first")  # the cost-12 hash of nobody's password is made once
    known = min(took("prometheus", f"wrong{n}") for n in range(2))
    unknown = min(took("nobody", f"guess{n}") for n in range(2))
    assert unknown > 0.7 * known, (unknown, known)


def test_a_read_refused_because_admin_is_off_is_not_logged_a_write_is(
    tmp_path, caplog, monkeypatch
):
    """The live page asks /snapshots whenever it is open: with admin actions off (no token)
    that is no incident, and the server's log is the host's (issue 54). A write still is."""
    from fastapi.testclient import TestClient

    from exporter.http import admin
    from exporter.ratelimit import RateLimitedLog

    # Once a minute per kind: this test's own first.
    monkeypatch.setattr(admin, "_refused_log", RateLimitedLog(admin.audit))
    app, _ = make_app(tmp_path, mode="embedded", admin_token=None)
    caplog.set_level(logging.INFO, logger="exporter.audit")
    client = TestClient(app)
    assert client.get("/snapshots").status_code == 403
    assert [r for r in caplog.records if r.name == "exporter.audit"] == []
    assert client.post("/snapshot", json={}).status_code == 403
    [line] = [r.getMessage() for r in caplog.records if r.name == "exporter.audit"]
    assert "POST" in line and "disabled (403)" in line


def test_a_client_cannot_name_its_own_address_with_x_forwarded_for(tmp_path, caplog, monkeypatch):
    """uvicorn trusts X-Forwarded-For from 127.0.0.1 unless told not to: any local process
    could then put any address in the audit trail and take another's rate-limit bucket. No
    proxy stands before this server, so the peer's address is the client's."""
    from exporter.http import admin
    from exporter.ratelimit import RateLimitedLog

    monkeypatch.setattr(admin, "_refused_log", RateLimitedLog(admin.audit))
    caplog.set_level(logging.INFO, logger="exporter.audit")
    with served(tmp_path) as (server, _):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request(
            "POST",
            "/snapshot",
            body=b"{}",
            headers={"X-Forwarded-For": "10.9.9.9", "Authorization": "Bearer wrong"},
        )
        assert conn.getresponse().status == 401
        conn.close()
    [line] = [r.getMessage() for r in caplog.records if r.name == "exporter.audit"]
    assert "from 127.0.0.1" in line and "10.9.9.9" not in line, line


@pytest.mark.parametrize(
    ("mode", "settings", "said"),
    [
        ("node", {}, "none"),  # no token: every admin request is refused
        ("node", {"admin_token": "t0ken"}, "token"),
        ("demo", {}, "open"),  # the demo's actions answer from its recording
        ("demo", {"admin_token": "t0ken"}, "token"),
    ],
)
def test_web_info_says_how_admin_callers_are_identified_as_configured(
    tmp_path, mode, settings, said
):
    """Round 5 (the front door): admin_auth="token" was shown with no token configured, when
    every admin request was refused. Read from /metrics of the real server."""
    import time
    import urllib.request

    from exporter.http.server import HttpServer, create_app
    from exporter.sources.replay import ReplaySource
    from tests.helpers import runtime_of

    sources = [ReplaySource()] if mode == "demo" else []
    runtime = runtime_of(tmp_path, mode, sources, **settings)
    runtime.sampler.tick()
    server = HttpServer(create_app(runtime), "127.0.0.1", 0)
    server.start()
    try:
        deadline = time.monotonic() + 10
        while not server._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as answer:
            body = answer.read().decode()
    finally:
        server.stop()
    (line,) = [x for x in body.splitlines() if x.startswith("gpumem_exporter_web_info{")]
    assert f'admin_auth="{said}"' in line, line
