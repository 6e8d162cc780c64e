"""The endpoint's transport and access rules, from the web config file, kept current.

`WebSecurity` holds the last good reading of the file (exporter.webconfig.file) and its TLS
context. The file, and the certificate, key and client CA it names, are looked at again before
every TLS handshake (a stat of each: a certificate that cert-manager rotates is served on the
next handshake) and at most once a second between requests (users, headers, rate limit). A new
reading that cannot be used keeps the last good one: it is logged once and shown on /metrics
(gpumem_exporter_web_config_last_reload_successful), as Prometheus does with its own config.

Every request meets `admit()` (exporter.http.access, before any route): the rate limit, then basic
auth, except for the probes (/healthz, /readyz: a kubelet probe cannot log in without the
password in the pod spec, and is never rate limited) and for admin routes where the admin API
has credentials of its own (exporter.http.access.AdminCallers decides those).

The rate limit (`rate_limit`, golang.org/x/time/rate's token bucket) is kept per client address
and per kind of request, `/metrics` apart from everything else: exporter-toolkit keeps one bucket
for the whole server, where one client polling any route made Prometheus's scrapes and the
kubelet's probes 429 (round 4). A client past its bucket is answered 429 before its password
is looked at, so a flood of passwords costs no bcrypt.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from exporter.config import Config, ConfigError
from exporter.ratelimit import TokenBucket
from exporter.webconfig.basic_auth import BasicAuth
from exporter.webconfig.file import (
    WebConfig,
    WebConfigError,
    certificate_not_after,
    load_served,
    san_allowed,
)

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset(("/healthz", "/readyz"))
# Between requests the file is looked at no more often than this (a stat or four).
RECHECK_S = 1.0
# Rate-limit buckets kept (client, kind): the least recently used go first past this.
MAX_BUCKETS = 4096
# Requests whose password waits for a bcrypt check (~70 ms each, one at a time): past this,
# 503 at once (round 4: 80 clients with never-seen passwords held every connection slot, the
# reserve included, while their checks queued; scrapes and probes got 503).
MAX_PENDING_CHECKS = 8


@dataclass(frozen=True)
class Refusal:
    """An answer instead of the route's: status, reason (the body), extra headers."""

    status: int
    reason: str
    headers: tuple[tuple[str, str], ...] = ()


# admit()'s answer where it may not block and a password needs a bcrypt check.
DEFER = Refusal(0, "")
TOO_MANY_CHECKS = Refusal(
    503,
    "Service Unavailable: too many password checks in progress; retry shortly",
    (("Retry-After", "1"), ("Connection", "close")),
)


class WebSecurity:
    """The web config in force (`config`), its TLS context, and the checks of each request.

    `path` None or "" is no file: plain HTTP, no basic auth. A file that cannot be used at
    start raises WebConfigError (the commands exit 2 with it)."""

    def __init__(
        self, path: str | None = None, *, admin_has_credentials: Callable[[], bool] = lambda: False
    ) -> None:
        self.path = path or ""
        self.admin_has_credentials = admin_has_credentials
        self._lock = threading.Lock()
        self._lock_buckets = threading.Lock()  # the event loop and admit()'s threads share them
        self._basic = BasicAuth()
        self.pending_checks = threading.BoundedSemaphore(MAX_PENDING_CHECKS)
        self.config, self.context = load_served(self.path) if self.path else (WebConfig(), None)
        self.tls = self.context is not None
        self.not_after = self._not_after()
        self._buckets: OrderedDict[tuple[str, str], TokenBucket] = OrderedDict()
        self._signature = self._signature_now()
        self._checked_at = time.monotonic()
        self.reload_ok = True
        self.reload_ok_at = time.time()
        self.last_error = ""
        # Counts every change of what /metrics says of the endpoint (a reload or a failed
        # one): what is built from it is built again only then (exporter.runtime).
        self.changes = 0

    # -- keeping current ---------------------------------------------------------------------

    def refresh(self, *, now: bool = False) -> None:
        """Read the file again if it, or a file it names, changed (checked at most once per
        RECHECK_S unless `now`)."""
        if not self.path:
            return
        with self._lock:
            if not now and time.monotonic() - self._checked_at < RECHECK_S:
                return
            self._checked_at = time.monotonic()
            signature = self._signature_now()
            if signature == self._signature:
                return
            self._signature = signature
            try:
                config, context = load_served(self.path)
                if (config.tls is not None) != self.tls:
                    raise WebConfigError(
                        f"web config {self.path}: TLS cannot be turned "
                        f"{'on' if config.tls else 'off'} without a restart"
                    )
            except Exception as exc:  # never into a handshake or a request
                problem = str(exc) if isinstance(exc, WebConfigError) else type(exc).__name__
                if problem != self.last_error:  # one line per new problem, not per handshake
                    log.error("web config not reloaded, the last good one stays: %s", problem)
                self.reload_ok, self.last_error = False, problem
                self.changes += 1
                return
            rate_changed = (config.rate_interval_s, config.rate_burst) != (
                self.config.rate_interval_s,
                self.config.rate_burst,
            )
            self.config, self.context = config, context
            self.not_after = self._not_after()
            if rate_changed:
                with self._lock_buckets:
                    self._buckets.clear()
            if not self.reload_ok:
                log.info("web config %s reloaded", self.path)
            self.reload_ok, self.reload_ok_at, self.last_error = True, time.time(), ""
            self.changes += 1

    def _signature_now(self) -> tuple[tuple[str, int, int, int, int] | tuple[str, str], ...]:
        files = [self.path, *(self.config.tls.files() if self.config.tls else ())]
        signature: list[tuple[str, int, int, int, int] | tuple[str, str]] = []
        for name in files:
            try:
                info = os.stat(name)  # follows symlinks: a Secret's ..data swap changes these
                # ctime too: a chmod that fixes a refused key changes nothing else (round 4)
                signature.append(
                    (name, info.st_ino, info.st_mtime_ns, info.st_ctime_ns, info.st_size)
                )
            except OSError as exc:
                signature.append((name, str(exc.errno)))
        return tuple(signature)

    def _not_after(self) -> float | None:
        tls = self.config.tls
        if tls is None:
            return None
        if tls.cert_file:
            return certificate_not_after(tls.cert_file)
        return None

    def _bucket(self, client: str, path: str) -> TokenBucket | None:
        """The bucket of this client and kind of request; None where no limit applies."""
        interval = self.config.rate_interval_s
        if interval <= 0 or path in OPEN_PATHS:  # the probes: never limited
            return None
        key = (client, "/metrics" if path == "/metrics" else "other")
        with self._lock_buckets:
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = TokenBucket(interval, self.config.rate_burst)
                if len(self._buckets) > MAX_BUCKETS:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(key)
            return bucket

    # -- per connection and per request ------------------------------------------------------

    def context_for_connection(self) -> ssl.SSLContext | None:
        """The TLS context a new connection's handshake uses (the files looked at first)."""
        if self.context is None:
            return None
        self.refresh(now=True)
        return self.context

    def peer_refused(self, peercert: dict | None) -> str | None:
        """Why a connection's client certificate is refused (client_allowed_sans), or None."""
        tls = self.config.tls
        if tls is None or tls.client_allowed_sans is None:
            return None
        if san_allowed(peercert, tls.client_allowed_sans):
            return None
        return "the client certificate has no subject alternative name allowed here"

    def admit(
        self,
        path: str,
        authorization: str,
        *,
        client: str = "",
        admin: bool = False,
        may_block: bool = True,
    ) -> Refusal | None:
        """None if the request may go on; else what to answer. Called once per request, or
        DEFER where `may_block` is False and a password needs a bcrypt check (the caller
        hands the request to a thread that calls again). `client`: the peer's address."""
        self.refresh()
        bucket = self._bucket(client, path)
        too_many = Refusal(429, "Too Many Requests")
        if bucket is not None and not bucket.allow(take=False):
            return too_many  # before any password is checked
        users = self.config.users
        authenticated: bool | None = True
        if users and path not in OPEN_PATHS and not (admin and self.admin_has_credentials()):
            authenticated = self._basic.check(users, authorization, may_block=may_block)
            if authenticated is None:
                return DEFER
        if bucket is not None and not bucket.allow():
            return too_many
        if not authenticated:
            return Refusal(401, "Unauthorized", (("WWW-Authenticate", "Basic"),))
        return None

    @property
    def headers(self) -> dict[str, str]:
        return dict(self.config.headers)


def web_security(config: Config) -> WebSecurity:
    """The endpoint's web config, read and checked now (ConfigError in one line)."""
    try:
        return WebSecurity(
            config.web_config_file,
            admin_has_credentials=lambda: bool(config.admin_methods_ready()),
        )
    except WebConfigError as exc:
        raise ConfigError(str(exc)) from None
