"""The pods of this node from the Kubernetes API: pod UID -> namespace and name, container ID ->
container name. Optional (the chart's `daemonset.kubelet.podReader`, GPUMEM_KUBELET_POD_READER):
with it, a GPU process is named exactly from its cgroup's pod UID and container ID, on shared
GPUs too, and a process of a pod that does not hold its GPU is found even where other pods do.

In-cluster only: the API server from KUBERNETES_SERVICE_HOST/PORT, the service account's token
and CA bundle, pods selected by `spec.nodeName` (NODE_NAME, from the Downward API). One GET per
kubelet refresh, with a deadline. The token is sent as a bearer header and never logged or put
in an error.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# A node runs at most a few hundred pods; a list of them is far below this.
MAX_RESPONSE_BYTES = 32 << 20


class PodsApiError(RuntimeError):
    """The pods could not be listed; str() is one line without secrets."""


@dataclass
class NodePods:
    """What the API says of the pods on this node."""

    pods: dict[str, tuple[str, str]] = field(default_factory=dict)  # uid -> (namespace, name)
    containers: dict[str, str] = field(default_factory=dict)  # container ID -> name


class PodsClient:
    def __init__(
        self,
        node_name: str,
        *,
        api_url: str,
        token_path: Path = SERVICE_ACCOUNT / "token",
        ca_path: Path | None = SERVICE_ACCOUNT / "ca.crt",
        timeout_s: float = 5.0,
    ) -> None:
        if not node_name:
            raise PodsApiError("NODE_NAME is not set: cannot select this node's pods")
        self.node_name = node_name
        self.api_url = api_url.rstrip("/")
        self._token_path = token_path
        self._timeout_s = timeout_s
        self._context = ssl.create_default_context(cafile=str(ca_path) if ca_path else None)

    @classmethod
    def in_cluster(cls, env: Mapping[str, str], *, timeout_s: float = 5.0) -> PodsClient:
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise PodsApiError("not in a cluster: KUBERNETES_SERVICE_HOST/PORT are not set")
        host = f"[{host}]" if ":" in host else host  # IPv6
        return cls(env.get("NODE_NAME", ""), api_url=f"https://{host}:{port}", timeout_s=timeout_s)

    def list(self) -> NodePods:
        selector = urllib.parse.quote(f"spec.nodeName={self.node_name}")
        try:
            token = self._token_path.read_text().strip()  # read each time: tokens rotate
        except OSError as exc:
            raise PodsApiError(f"service account token: {exc.strerror}") from None
        request = urllib.request.Request(
            f"{self.api_url}/api/v1/pods?fieldSelector={selector}",
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(
                request, timeout=self._timeout_s, context=self._context
            ) as response:
                body = response.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as exc:
            raise PodsApiError(f"listing pods: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise PodsApiError(f"listing pods: {reason}") from None
        if len(body) > MAX_RESPONSE_BYTES:
            raise PodsApiError("listing pods: answer too large")
        try:
            return parse_pods(json.loads(body))
        except (ValueError, TypeError, AttributeError) as exc:
            raise PodsApiError(f"listing pods: not a PodList ({type(exc).__name__})") from None


def parse_pods(data: dict) -> NodePods:
    """A v1 PodList's pod UIDs and container IDs (`containerd://<id>`, `cri-o://<id>`, ...)."""
    result = NodePods()
    for item in data["items"]:
        meta, status = item["metadata"], item.get("status") or {}
        result.pods[str(meta["uid"])] = (str(meta["namespace"]), str(meta["name"]))
        for key in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
            for container in status.get(key) or []:
                runtime_id = str(container.get("containerID") or "")
                if runtime_id:
                    result.containers[runtime_id.rpartition("://")[2]] = str(container["name"])
    return result
