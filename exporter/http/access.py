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
4. The web config's rules (exporter.webconfig.security.WebSecurity.admit): the rate limit,
   then basic auth, except for the probes and for admin routes where the admin API has
   credentials of its own. A password not seen before is checked by bcrypt in a thread, a
   bounded number at once. The web config's headers go on every answer, refusals included.

5. An admin route's caller (AdminCallers): the shared bearer token or a Kubernetes identity
   the API server reviews, never sent in cleartext from another host. Decided here with the
   rest, but run as a dependency of each admin route, because exporter.attach() mounts the
   same routes on a host's app that AccessCheck does not wrap.

Admin routes are known by declaration (exporter.http.admin.add_admin_routes returns them),
never found by scanning the app's routes. The connection's client certificate
(client_allowed_sans) is decided per connection, before any request is read
(exporter.http.guard), from the same web config.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import json
import logging
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import anyio.to_thread
from starlette.requests import Request
from starlette.routing import BaseRoute

from exporter.config import Config, ConfigError
from exporter.kubernetes.identities import (
    RESOURCES,
    VERBS,
    IdentityUnavailable,
    KubernetesIdentities,
)
from exporter.ratelimit import RateLimitedLog
from exporter.traits import Traits
from exporter.webconfig.security import DEFER, TOO_MANY_CHECKS, Refusal, WebSecurity

log = logging.getLogger("exporter.admin")

SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
# The admin API's refusals of its callers (AdminCallers).
DISABLED = (
    "admin actions are disabled: set GPUMEM_ADMIN_TOKEN or GPUMEM_ADMIN_TOKEN_FILE "
    "(admin_token= / admin_token_file=) to enable them"
)
CLEARTEXT = (
    "admin credentials over plain HTTP from another host are refused (anyone on the path can "
    "read them): serve TLS (web_config_file), use kubectl port-forward, or set "
    "allow_cleartext_admin"
)

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


class AdminError(Exception):
    """An admin request refused or failed: its status, what to tell the client, how it ended
    (the admin request counter's outcome) and any headers (WWW-Authenticate, Retry-After)."""

    def __init__(
        self, status: int, detail: str, outcome: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(detail)
        self.status, self.detail, self.outcome, self.headers = status, detail, outcome, headers


class AdminCallers:
    """Who may call an admin route: the shared bearer token, or a Kubernetes identity the API
    server reviews (admin_auth); neither over plain HTTP from another host. A dependency of
    every admin route (exporter.http.admin.add_admin_routes), so that a host's app that
    attach() mounts them on, which AccessCheck does not wrap, decides them the same way. It
    runs in a worker thread: a slow API server holds no event loop."""

    def __init__(
        self, config: Config, traits: Traits, identities: KubernetesIdentities | None
    ) -> None:
        self.config, self.traits, self.identities = config, traits, identities
        self._token_log = RateLimitedLog(log)

    def authorize(self, request: Request) -> None:
        """Refuse the caller (AdminError) or leave their name in request.state.admin_user
        for the audit line."""
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        bearer = given.strip() if scheme.lower() == "bearer" else ""
        if request.headers.get("authorization") and self._cleartext_from_afar(request):
            raise AdminError(403, CLEARTEXT, "cleartext")
        methods = self.config.admin_auth
        try:
            expected = self.config.resolved_admin_token() if "token" in methods else None
        except ConfigError as exc:
            # Logged at most once a minute: every request (even one without a token) meets
            # it, and a scanner must not flood the host's logs.
            self._token_log.log(logging.ERROR, "token", f"admin token unavailable: {exc}")
            expected = None
            if self.identities is None:
                raise AdminError(403, DISABLED, "disabled") from None
        if (
            not expected
            and self.identities is None
            and self.traits.admin_open
            and not self.config.admin_token_file
        ):
            # The demo's actions answer from its recording and change nothing: open without a
            # configured token, so that the demo shows every feature with no set-up.
            return
        # Constant-time comparison; the token itself is never logged or echoed.
        if expected and bearer and hmac.compare_digest(bearer.encode(), expected.encode()):
            request.state.admin_user = "admin-token"
            return
        if self.identities is not None and bearer:
            self._kubernetes(request, bearer)
            return
        if not expected and self.identities is None:
            if self.config.admin_token_file:
                self._token_log.log(
                    logging.ERROR,
                    "token",
                    f"admin token file {self.config.admin_token_file} is empty: "
                    "admin actions are off",
                )
            raise AdminError(403, DISABLED, "disabled")
        raise AdminError(
            401,
            "missing or invalid bearer token",
            "unauthorized",
            {"WWW-Authenticate": "Bearer"},
        )

    def _kubernetes(self, request: Request, bearer: str) -> None:
        assert self.identities is not None
        route = request.scope.get("route")
        label = getattr(route, "name", "")
        verb = VERBS.get(request.method, "get")
        if label == "list":
            verb = "list"
        resource = RESOURCES.get(label, label)
        try:
            decision = self.identities.decide(bearer, verb, resource)
        except IdentityUnavailable as exc:
            raise AdminError(503, str(exc), "unavailable", {"Retry-After": "5"}) from None
        if decision.user is None:
            raise AdminError(
                401,
                f"the Kubernetes API did not authenticate this token: {decision.reason}",
                "unauthorized",
                {"WWW-Authenticate": "Bearer"},
            )
        request.state.admin_user = decision.user.name
        if not decision.allowed:
            what = self.identities.attributes(verb, resource)
            detail = f"{decision.user.name} may not {verb} {_describe(what)}"
            raise AdminError(
                403, detail + (f": {decision.reason}" if decision.reason else ""), "forbidden"
            )

    def _cleartext_from_afar(self, request: Request) -> bool:
        """A credential that crossed the network unencrypted: plain HTTP from a client that is
        not this machine's loopback (kubectl port-forward arrives on loopback)."""
        if request.url.scheme == "https" or self.config.allow_cleartext_admin:
            return False
        client = request.client.host if request.client else ""
        return not is_loopback(client)


def _describe(attributes: dict[str, str]) -> str:
    """RBAC's words for a SubjectAccessReview's resourceAttributes."""
    a = attributes
    if a.get("subresource"):
        return f"{a['resource']}/{a['subresource']} {a.get('name', '')}".strip()
    return f"{a['group']}/{a['resource']} in namespace {a['namespace'] or '-'}"
