"""Who may reach which route: one check that every request to the exporter's own server
passes before any route (the open routes' shortcut included), in this order.

1. The Host header as HTTP/1.1 asks (RFC 9112, 3.2): exactly one; 400 without one or with
   several (h11 answered so; llhttp leaves it to the server). HTTP/1.0 may send none.
2. While the server listens on a loopback address only, the Host must name this machine's
   loopback (localhost, 127.0.0.0/8, [::1]): another name is a web page that rebound its own
   name to 127.0.0.1 to read the endpoint as its own origin (403).
3. A state-changing request (not GET, HEAD, OPTIONS) that a browser marks as coming from
   another origin (an Origin that is not this Host, "null", or Sec-Fetch-Site: cross-site) is
   refused (403): a page on any site can send simple cross-site requests (a form, a text/plain
   POST) to http://127.0.0.1:9445, and the demo's admin actions need no token. curl, the CLI
   and Prometheus send no Origin and pass.
4. The web config's rules (exporter.http.web.WebSecurity.admit): the rate limit, then basic
   auth, except for the probes and for admin routes where the admin API has credentials of
   its own. A password not seen before is checked by bcrypt in a thread, a bounded number at
   once. The web config's headers go on every answer, refusals included.

Admin routes are known by declaration (exporter.http.admin.add_admin_routes returns them),
never found by scanning the app's routes. Their callers (bearer token, Kubernetes identities)
are decided by Admin.authorize, a dependency of each admin route, because exporter.attach()
mounts the same routes on a host's app that this check does not wrap. The connection's client
certificate (client_allowed_sans) is decided per connection, before any request is read
(exporter.http.guard).
"""

from __future__ import annotations

import functools
import ipaddress
import json
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import anyio.to_thread
from starlette.routing import BaseRoute

from exporter.http.web import DEFER, TOO_MANY_CHECKS, Refusal, WebSecurity

SAFE_METHODS = ("GET", "HEAD", "OPTIONS")

Scope = dict[str, Any]


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _hostname(host: str) -> str:
    """The name of a Host header value, without the port ("[::1]:9445" -> "::1")."""
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


@functools.lru_cache(maxsize=64)  # a server sees a handful of Host values, on every request
def is_loopback(host: str) -> bool:
    """Whether an address or host name is this machine's loopback."""
    name = _hostname(host).strip().lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def cross_origin(scope: Scope) -> bool:
    """Whether a browser says this request comes from a page of another origin."""
    if _header(scope, b"sec-fetch-site") == "cross-site":
        return True
    origin = _header(scope, b"origin")
    if origin is None:
        return False  # not sent by a browser's page (curl, the CLI, Prometheus)
    host = (_header(scope, b"host") or "").lower()
    return origin == "null" or urlsplit(origin).netloc.lower() != host


class AdminPaths:
    """The admin routes' paths, from their declaration: a set for the fixed ones, patterns
    for those with parameters (/snapshots/{id})."""

    def __init__(self, routes: Iterable[BaseRoute]) -> None:
        self.fixed: set[str] = set()
        self.patterns: list[re.Pattern[str]] = []
        for route in routes:
            path: str = getattr(route, "path", "")
            if "{" in path:
                self.patterns.append(getattr(route, "path_regex"))  # noqa: B009
            else:
                self.fixed.add(path)

    def __contains__(self, path: str) -> bool:
        return path in self.fixed or any(p.match(path) for p in self.patterns)


NO_ADMIN = AdminPaths(())


_JSON = (("Content-Type", "application/json"),)


def _refusal(status: int, detail: str) -> Refusal:
    """A refusal of this module: JSON with its detail, as the app's own errors are."""
    return Refusal(status, detail, _JSON)


NO_HOST = _refusal(400, "a request needs exactly one Host header (RFC 9112)")
REBOUND = _refusal(
    403,
    "this exporter listens on loopback only: address it as localhost or 127.0.0.1 "
    "(another Host name is how a web page rebinds to it)",
)
CROSS_SITE = _refusal(403, "cross-origin request refused: use the exporter's own page")


class AccessCheck:
    """ASGI: the module's checks, before `app`. `loopback_only`: the server listens on a
    loopback address only; `web`: the web config in force (None: no file); `admin`: the admin
    routes' paths."""

    def __init__(
        self,
        app: Any,
        *,
        loopback_only: bool,
        web: WebSecurity | None = None,
        admin: AdminPaths = NO_ADMIN,
    ) -> None:
        self.app, self.loopback_only, self.web, self.admin = app, loopback_only, web, admin

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is None and self.web is not None:
            refusal = await self._admit(scope, self.web)
        extra = self._extra_headers()
        if refusal is not None:
            await _answer(send, refusal, extra)
        elif not extra:
            await self.app(scope, receive, send)
        else:

            async def send_with_headers(message: Any) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", ()), *extra]}
                await send(message)

            await self.app(scope, receive, send_with_headers)

    def _refusal(self, scope: Scope) -> Refusal | None:
        """Host, rebinding and cross-site: decided from the request's head alone."""
        hosts = [bytes(v) for k, v in scope["headers"] if k == b"host"]
        if len(hosts) > 1 or (not hosts and scope.get("http_version") != "1.0"):
            return NO_HOST
        # No Host at all is an HTTP/1.0 client, never a browser, which always names the host
        # it thinks it talks to.
        if self.loopback_only and hosts and not is_loopback(hosts[0].decode("latin-1")):
            return REBOUND
        if scope["method"] not in SAFE_METHODS and cross_origin(scope):
            return CROSS_SITE
        return None

    async def _admit(self, scope: Scope, web: WebSecurity) -> Refusal | None:
        client = scope.get("client")
        admit = functools.partial(
            web.admit,
            scope["path"],
            _header(scope, b"authorization") or "",
            client=client[0] if client else "",
            admin=scope["path"] in self.admin,
        )
        refusal = admit(may_block=False)
        if refusal is not DEFER:
            return refusal
        # bcrypt off the event loop, a bounded number waiting for it
        if not web.pending_checks.acquire(blocking=False):
            return TOO_MANY_CHECKS
        try:
            return await anyio.to_thread.run_sync(admit)
        finally:
            web.pending_checks.release()

    def _extra_headers(self) -> list[tuple[bytes, bytes]]:
        if self.web is None:
            return []
        return [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.web.headers.items()
        ]


async def _answer(send: Any, refusal: Refusal, extra: list[tuple[bytes, bytes]]) -> None:
    if refusal.headers[:1] == _JSON:
        body = json.dumps({"detail": refusal.reason}).encode()
        headers = [(b"content-type", b"application/json")]
    else:  # the web config's refusals: plain text, with their own headers
        body = (refusal.reason + "\n").encode()
        headers = [(b"content-type", b"text/plain; charset=utf-8")]
        headers += [(k.lower().encode(), v.encode()) for k, v in refusal.headers]
    headers += [(b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
