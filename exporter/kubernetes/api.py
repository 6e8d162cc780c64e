"""Calls to the Kubernetes API server with this pod's service account, bounded in time.

Each call has one deadline for the whole exchange (connect, TLS, request, every byte of the
answer): an API server that trickles its answer cannot hold the caller past it. Redirects are
never followed (the bearer token would go where the redirect points), and the token is read
from its file at each call (kubelet rotates it) and never put in an error or a log.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MAX_ANSWER_BYTES = 1 << 20  # a TokenReview or SubjectAccessReview is a few KiB


class ApiError(RuntimeError):
    """The API server could not be asked or answered badly; str() is one line, no secrets."""


class ApiServer:
    def __init__(
        self,
        url: str,
        *,
        token_path: Path = SERVICE_ACCOUNT / "token",
        ca_path: Path | None = SERVICE_ACCOUNT / "ca.crt",
        deadline_s: float = 5.0,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "https" or not parts.hostname:
            raise ApiError(f"the Kubernetes API must be an https:// URL, got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 443
        self.url = url.rstrip("/")
        self._token_path = token_path
        self._ca_path = ca_path
        self.deadline_s = deadline_s
        self._context: ssl.SSLContext | None = None
        self._ca_signature: tuple[int, int] | None = None

    @classmethod
    def in_cluster(
        cls, env: Mapping[str, str], *, credentials: Path = SERVICE_ACCOUNT, deadline_s: float = 5.0
    ) -> ApiServer:
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise ApiError("not in a cluster: KUBERNETES_SERVICE_HOST/PORT are not set")
        host = f"[{host}]" if ":" in host else host  # IPv6
        return cls(
            f"https://{host}:{port}",
            token_path=credentials / "token",
            ca_path=credentials / "ca.crt",
            deadline_s=deadline_s,
        )

    def namespace(self) -> str:
        """This pod's namespace, from the service account's folder ("" where unknown)."""
        try:
            return (self._token_path.parent / "namespace").read_text().strip()
        except OSError:
            return ""

    def post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST a JSON object; the answer's JSON object (ApiError otherwise)."""
        return self._call("POST", path, json.dumps(body).encode(), MAX_ANSWER_BYTES)

    def get(self, path: str, *, max_bytes: int = MAX_ANSWER_BYTES) -> dict[str, Any]:
        """GET a JSON object (ApiError otherwise)."""
        return self._call("GET", path, None, max_bytes)

    def get_list(
        self, path: str, kind: str, parse: Callable[[dict[str, Any]], T], *, max_bytes: int
    ) -> T:
        """GET a list and parse it; ApiError (one line) where `parse` cannot read the answer
        as a `kind` (a PodList, a ResourceClaimList)."""
        data = self.get(path, max_bytes=max_bytes)
        try:
            return parse(data)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            why = (
                f"{type(exc).__name__}: {exc}"
                if isinstance(exc, ValueError)
                else (type(exc).__name__)
            )
            raise ApiError(f"not a {kind} ({why})") from None

    def _call(
        self, method: str, path: str, payload: bytes | None, max_bytes: int
    ) -> dict[str, Any]:
        try:
            token = self._token_path.read_text().strip()  # read each time: tokens rotate
        except OSError as exc:
            raise ApiError(f"service account token: {exc.strerror}") from None
        connection = http.client.HTTPSConnection(
            self.host, self.port, timeout=self.deadline_s, context=self._tls()
        )
        # One deadline for the whole exchange: at its end the socket is shut, whatever the
        # call is waiting for (a timeout per read would let a trickle of bytes go on forever).
        expired = threading.Event()
        held: list[socket.socket] = []  # the socket, kept: http.client lets go of it early
        watchdog = threading.Timer(self.deadline_s, _cut, (held, expired))
        watchdog.daemon = True
        watchdog.start()
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        try:
            connection.connect()  # bounded by the socket timeout (the deadline)
            if connection.sock is not None:
                held.append(connection.sock)
            if expired.is_set():
                raise TimeoutError
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            data = response.read(max_bytes + 1)
        except (OSError, http.client.HTTPException) as exc:
            if expired.is_set() or isinstance(exc, TimeoutError):
                raise ApiError(
                    f"the API server did not answer within {self.deadline_s:g} s"
                ) from None
            if isinstance(exc, ssl.SSLError):
                raise ApiError(f"TLS with the API server: {exc.reason or exc}") from None
            why = getattr(exc, "strerror", None) or type(exc).__name__
            raise ApiError(f"the API server: {why}") from None
        finally:
            watchdog.cancel()
            connection.close()
        if expired.is_set():
            raise ApiError(f"the API server did not answer within {self.deadline_s:g} s")
        if len(data) > max_bytes:
            raise ApiError("the API server's answer is too large")
        if not 200 <= response.status < 300:
            # 3xx too: a redirect is not followed with the token.
            raise ApiError(f"the API server answered HTTP {response.status} {response.reason}")
        try:
            answer = json.loads(data)
        except ValueError:
            raise ApiError("the API server's answer is not JSON") from None
        if not isinstance(answer, dict):
            raise ApiError("the API server's answer is not an object")
        return answer

    def _tls(self) -> ssl.SSLContext:
        """The CA bundle read again when it changes (the cluster CA rotates)."""
        try:
            info = self._ca_path.stat() if self._ca_path is not None else None
            signature = (info.st_ino, info.st_mtime_ns) if info is not None else None
        except OSError:
            signature = None
        if self._context is None or signature != self._ca_signature:
            cafile = str(self._ca_path) if signature is not None else None
            try:
                self._context = ssl.create_default_context(cafile=cafile)
            except (OSError, ssl.SSLError) as exc:
                raise ApiError(
                    f"the cluster CA {self._ca_path}: {getattr(exc, 'strerror', None) or exc}"
                ) from None
            self._ca_signature = signature
        return self._context


def _cut(held: list[socket.socket], expired: threading.Event) -> None:
    expired.set()
    for sock in held:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
