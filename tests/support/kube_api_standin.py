"""A stand-in Kubernetes API server: real HTTPS (a certificate made by `openssl` for
127.0.0.1) answering `GET /api/v1/pods?fieldSelector=spec.nodeName=NODE` with a v1 PodList,
the ResourceClaims of a namespace and this node's ResourceSlices (resource.k8s.io/v1), for a
bearer token it was given; 401 for any other token, 400 for any other query."""

from __future__ import annotations

import json
import re
import shutil
import ssl
import subprocess
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from exporter.kubernetes.api import ApiServer

TOKEN = "sa-token-not-for-logs"  # the service account's, as the tests write it
# The pod of tests/data/cgroup/v2-systemd-crio.txt and its container, and another pod.
UID_A = "2c9f8a79-5391-454b-88cb-86190881cb96"
CRIO_ID = "a09343ca97901516c25036e2b954421254f8c68b384b536064e8999f0c4ed18d"
UID_B = "7922aa99-d4aa-4885-a953-82976860b23a"


def make_certificate(folder: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not found")
    cert, key = folder / "api.crt", folder / "api.key"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def answer_redirect(handler: BaseHTTPRequestHandler, base: str) -> None:
    """307 to the same path on `base`: what an API server behind a hostile proxy answers."""
    handler.send_response(307)
    handler.send_header("Location", base + handler.path)
    handler.send_header("Content-Length", "0")
    handler.end_headers()


def answer_json(
    handler: BaseHTTPRequestHandler, code: int, body: dict[str, Any], trickle_s: float = 0.0
) -> None:
    """A JSON answer as the API server sends it; one byte every `trickle_s` where set."""
    data = json.dumps(body).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if not trickle_s:
        handler.wfile.write(data)
        return
    for i in range(len(data)):
        handler.wfile.write(data[i : i + 1])
        handler.wfile.flush()
        time.sleep(trickle_s)


def pod(namespace: str, name: str, uid: str, containers: dict[str, str]) -> dict[str, Any]:
    """A v1 Pod as the API serves it, with `containers` {name: containerd ID}."""
    statuses = [{"name": n, "containerID": f"containerd://{i}"} for n, i in containers.items()]
    return {
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "spec": {"nodeName": "gpu-node-1"},
        "status": {"containerStatuses": statuses},
    }


class StandInApi:
    def __init__(self, folder: Path, token: str, node: str = "gpu-node-1") -> None:
        self.cert, key = make_certificate(folder)
        self.pods: list[dict[str, Any]] = []
        # resource.k8s.io/v1 ResourceClaims by namespace (resource_claim() makes one).
        self.claims: dict[str, list[dict[str, Any]]] = {}
        self.forbid_claims = False  # answer 403 to resourceclaims (RBAC without the rule)
        self.slices: list[dict[str, Any]] = []  # this node's ResourceSlices (resource_slice())
        self.requests: list[str] = []
        self.trickle_s = 0.0  # seconds between the bytes of an answer
        self.redirect_to = ""  # answer 307 to this base URL instead
        self.claims_delay_s = 0.0  # each resourceclaims list answered this much later
        self.authorizations: list[str] = []  # the Authorization header of each request
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                api.requests.append(self.path)
                api.authorizations.append(self.headers.get("Authorization", ""))
                if api.redirect_to:
                    answer_redirect(self, api.redirect_to)
                    return
                url = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(url.query)
                claims = re.fullmatch(
                    r"/apis/resource\.k8s\.io/v1/namespaces/([^/]+)/resourceclaims", url.path
                )
                if self.headers.get("Authorization") != f"Bearer {token}":
                    self._answer(401, {"kind": "Status", "reason": "Unauthorized"})
                elif claims is not None and api.forbid_claims:
                    self._answer(403, {"kind": "Status", "reason": "Forbidden"})
                elif claims is not None:
                    time.sleep(api.claims_delay_s)
                    items = api.claims.get(urllib.parse.unquote(claims.group(1)), [])
                    body = {"kind": "ResourceClaimList", "apiVersion": "resource.k8s.io/v1"}
                    self._answer(200, {**body, "items": items})
                elif url.path == "/apis/resource.k8s.io/v1/resourceslices" and query == {
                    "fieldSelector": [f"spec.nodeName={node}"]
                }:
                    body = {"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1"}
                    self._answer(200, {**body, "items": api.slices})
                elif url.path != "/api/v1/pods" or query != {
                    "fieldSelector": [f"spec.nodeName={node}"]
                }:
                    self._answer(400, {"kind": "Status", "reason": "BadRequest"})
                else:
                    self._answer(200, {"kind": "PodList", "apiVersion": "v1", "items": api.pods})

            def _answer(self, code: int, body: dict[str, Any]) -> None:
                answer_json(self, code, body, api.trickle_s)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def client_api(self, token_path: Path, deadline_s: float = 5.0) -> ApiServer:
        """The exporter's API client for this stand-in, with the token at `token_path`."""
        return ApiServer(self.url, token_path=token_path, ca_path=self.cert, deadline_s=deadline_s)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def resource_claim(
    namespace: str, name: str, *devices: tuple[str, str, str | None], pool: str = "gpu-node-1"
) -> dict[str, Any]:
    """A resource.k8s.io/v1 ResourceClaim allocated `devices` of NVIDIA's driver, each
    (device, shareID or "", consumed memory quantity or None) as the scheduler writes
    status.allocation with consumable capacity (DRAConsumableCapacity)."""
    results = []
    for device, share_id, memory in devices:
        result: dict[str, Any] = {
            "request": "gpu",
            "driver": "gpu.nvidia.com",
            "pool": pool,
            "device": device,
        }
        if share_id:
            result["shareID"] = share_id
        if memory is not None:
            result["consumedCapacity"] = {"memory": memory}
        results.append(result)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [{"name": "gpu"}]}},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def resource_slice(driver: str, pool: str, devices: dict[str, str]) -> dict[str, Any]:
    """A resource.k8s.io/v1 ResourceSlice of this node: device name -> its `uuid` attribute."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{pool}-{driver}"},
        "spec": {
            "driver": driver,
            "nodeName": "gpu-node-1",
            "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {"name": name, "attributes": {"uuid": {"string": uuid}}}
                for name, uuid in devices.items()
            ],
        },
    }
