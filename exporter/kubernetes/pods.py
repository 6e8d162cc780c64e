"""The pods of this node from the Kubernetes API: pod UID -> namespace and name, container ID ->
container name. Optional (the chart's `daemonset.kubelet.podReader`, GPUMEM_KUBELET_POD_READER):
with it, a GPU process is named exactly from its cgroup's pod UID and container ID, on shared
GPUs too, and a process of a pod that does not hold its GPU is found even where other pods do.

In-cluster only: the API server from KUBERNETES_SERVICE_HOST/PORT, the service account's token
and CA bundle, pods selected by `spec.nodeName` (NODE_NAME, from the Downward API). One GET per
kubelet refresh, with one deadline for the whole call (exporter.kubernetes.api: a trickling
answer cannot hold it), no redirect followed, the CA re-read when it rotates. The token is sent
as a bearer header and never logged or put in an error.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from exporter.kubernetes.api import ApiError, ApiServer

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
        api_url: str = "",
        token_path: Path = SERVICE_ACCOUNT / "token",
        ca_path: Path | None = SERVICE_ACCOUNT / "ca.crt",
        timeout_s: float = 5.0,
        api: ApiServer | None = None,
    ) -> None:
        """The API server at `api_url` with these credentials, or `api` as given."""
        if not node_name:
            raise PodsApiError("NODE_NAME is not set: cannot select this node's pods")
        self.node_name = node_name
        try:
            # One deadline for the whole call, no redirect followed, the CA re-read when it
            # rotates (exporter.kubernetes.api).
            self._api = api or ApiServer(
                api_url, token_path=token_path, ca_path=ca_path, deadline_s=timeout_s
            )
        except ApiError as exc:
            raise PodsApiError(str(exc)) from None

    @classmethod
    def in_cluster(
        cls,
        env: Mapping[str, str],
        *,
        timeout_s: float = 5.0,
        credentials: Path = SERVICE_ACCOUNT,
    ) -> PodsClient:
        try:
            api = ApiServer.in_cluster(env, credentials=credentials, deadline_s=timeout_s)
        except ApiError as exc:
            raise PodsApiError(str(exc)) from None
        return cls(env.get("NODE_NAME", ""), api=api)

    def list(self) -> NodePods:
        selector = urllib.parse.quote(f"spec.nodeName={self.node_name}")
        path = f"/api/v1/pods?fieldSelector={selector}"
        try:
            return self._api.get_list(path, "PodList", parse_pods, max_bytes=MAX_RESPONSE_BYTES)
        except ApiError as exc:
            raise PodsApiError(f"listing pods: {exc}") from None


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
