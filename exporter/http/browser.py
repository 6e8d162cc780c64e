"""What a web page in the user's browser must not be able to make the exporter do.

A page on any site can send simple cross-site requests (a form, a text/plain POST) to
http://127.0.0.1:9445: the demo's admin actions need no token, so such a page could take
snapshots or empty the cache. And by DNS rebinding (its own name re-pointed at 127.0.0.1) a
page can read the endpoint as if it were its own origin. Two checks close both:

- CrossOriginGuard (every app this package serves): a state-changing request (not GET, HEAD,
  OPTIONS) that a browser marks as coming from another origin (an Origin header that is not
  this Host, "null", or Sec-Fetch-Site: cross-site) is refused with 403. The live page's own
  requests are same-origin; curl, the CLI and Prometheus send no Origin and pass.
- HostGuard (the exporter's own server), while it listens on a loopback address only:
  the Host header must name this machine's loopback (localhost, 127.0.0.0/8, [::1]); another
  name is a rebinding page and gets 403. Listening on other addresses, the admin token guards
  state changes and the metrics are meant to be read.
"""

from __future__ import annotations

import functools
import ipaddress
import json
from typing import Any
from urllib.parse import urlsplit

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


async def _answer(send: Any, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def cross_origin(scope: Scope) -> bool:
    """Whether a browser says this request comes from a page of another origin."""
    if _header(scope, b"sec-fetch-site") == "cross-site":
        return True
    origin = _header(scope, b"origin")
    if origin is None:
        return False  # not sent by a browser's page (curl, the CLI, Prometheus)
    host = (_header(scope, b"host") or "").lower()
    return origin == "null" or urlsplit(origin).netloc.lower() != host


class CrossOriginGuard:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] not in SAFE_METHODS and cross_origin(scope):
            await _answer(send, 403, "cross-origin request refused: use the exporter's own page")
            return
        await self.app(scope, receive, send)


class HostGuard:
    """The Host header as HTTP/1.1 asks (RFC 9112, 3.2: exactly one; 400 without one or with
    several, which h11 answered and llhttp leaves to the server), and, with `loopback_only`,
    a loopback name (the module's docstring says why)."""

    def __init__(self, app: Any, *, loopback_only: bool) -> None:
        self.app, self.loopback_only = app, loopback_only

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hosts = [bytes(v) for k, v in scope["headers"] if k == b"host"]
        if len(hosts) > 1 or (not hosts and scope["http_version"] != "1.0"):
            await _answer(send, 400, "a request needs exactly one Host header (RFC 9112)")
            return
        # No Host at all is an HTTP/1.0 client, never a browser, which always names the host
        # it thinks it talks to.
        if self.loopback_only and hosts and not is_loopback(hosts[0].decode("latin-1")):
            await _answer(
                send,
                403,
                "this exporter listens on loopback only: address it as localhost or "
                "127.0.0.1 (another Host name is how a web page rebinds to it)",
            )
            return
        await self.app(scope, receive, send)
