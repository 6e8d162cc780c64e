"""A stand-in Kubernetes API server for admin identities: real HTTPS answering
`POST /apis/authentication.k8s.io/v1/tokenreviews` and
`POST /apis/authorization.k8s.io/v1/subjectaccessreviews` as the API defines them (only for the
exporter's own service-account token), from a table of tokens and RBAC-like grants. It can be
made slow (trickling its answer), or made to redirect."""

from __future__ import annotations

import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.support.kube_api_standin import answer_json, answer_redirect, make_certificate


class StandInAuthApi:
    def __init__(self, folder: Path, caller_token: str) -> None:
        self.cert, key = make_certificate(folder)
        # bearer token -> user info; (user, verb, group, resource, namespace) allowed
        self.tokens: dict[str, dict[str, Any]] = {}
        self.grants: set[tuple[str, str, str, str, str]] = set()
        self.reviews: list[dict[str, Any]] = []
        self.trickle_s = 0.0  # seconds between the bytes of an answer
        self.redirect_to = ""
        self.account: Path | None = None  # the service account's folder a test made for it
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.headers.get("Authorization") != f"Bearer {caller_token}":
                    self._answer(401, {"kind": "Status", "reason": "Unauthorized"})
                    return
                if api.redirect_to:
                    answer_redirect(self, api.redirect_to)
                    return
                api.reviews.append(body)
                if self.path == "/apis/authentication.k8s.io/v1/tokenreviews":
                    user = api.tokens.get(body["spec"]["token"])
                    status: dict[str, Any] = (
                        {"authenticated": True, "user": user}
                        if user
                        else {"authenticated": False, "error": "token not found"}
                    )
                    self._answer(201, {**body, "status": status})
                elif self.path == "/apis/authorization.k8s.io/v1/subjectaccessreviews":
                    spec = body["spec"]
                    a = spec["resourceAttributes"]
                    key = (
                        spec["user"],
                        a["verb"],
                        a.get("group", ""),
                        a["resource"] + (f"/{a['subresource']}" if a.get("subresource") else ""),
                        a.get("namespace", a.get("name", "")),
                    )
                    allowed = key in api.grants
                    reason = "RBAC: allowed by test grant" if allowed else ""
                    self._answer(201, {**body, "status": {"allowed": allowed, "reason": reason}})
                else:
                    self._answer(404, {"kind": "Status", "reason": "NotFound"})

            def _answer(self, code: int, body: dict[str, Any]) -> None:
                answer_json(self, code, body, api.trickle_s)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def user(self, token: str, name: str, groups: tuple[str, ...] = ()) -> None:
        self.tokens[token] = {"username": name, "uid": f"uid-{name}", "groups": list(groups)}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
