"""The kubelet's pod-resources API (v1.PodResourcesLister/List): which container of which pod
each device is assigned to.

Messages come from the published v1 schema (podresources_v1/api.proto), loaded from its
descriptor set into a private pool: generated `_pb2` modules pin the protobuf runtime they were
made with, and a private pool cannot clash with another `v1` package in the host's default
pool. grpcio and protobuf are the optional extra `kubernetes`; without them the node daemon
reports that state (KubeletClientMissing) instead of attribution.

dcgm-exporter calls List on a new connection per collection with a 10 s timeout; here one
channel is kept and every call has its own deadline (seconds), made off the sampler's thread
(exporter.sources.kubelet).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import cache
from importlib import resources
from typing import Any

from exporter.sample import PodDevice

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
LIST_METHOD = "/v1.PodResourcesLister/List"
# A List answer on a node with hundreds of pods is a few hundred KiB; anything near this is
# not a kubelet.
MAX_RESPONSE_BYTES = 16 << 20
# GPU device assignments one node can have: 500 pods (5x the kubelet's default maxPods) each
# holding 8 GPUs, time-slicing replicas and MIG slices included, is 4,000. An answer with more
# is refused whole (issue 38: 100k rows became 100k series and ~260 MB kept in the daemon).
MAX_ASSIGNMENTS = 8192


class KubeletClientMissing(RuntimeError):
    """grpcio or protobuf is not installed (pip install 'gpumem-exporter[kubernetes]')."""


@cache
def messages() -> dict[str, Any]:
    """The v1 message classes by short name, from the shipped descriptor set."""
    try:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    except ImportError as exc:
        raise KubeletClientMissing(
            "protobuf is not installed (pip install 'gpumem-exporter[kubernetes]')"
        ) from exc
    data = resources.files(__package__).joinpath("podresources_v1/api.descriptor.binpb")
    files = descriptor_pb2.FileDescriptorSet.FromString(data.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for file in files.file:
        pool.Add(file)
    package = pool.FindFileByName("api.proto")
    return {
        name: message_factory.GetMessageClass(descriptor)
        for name, descriptor in package.message_types_by_name.items()
    }


def assignments(response: Any, resources: frozenset[str] | None = None) -> list[PodDevice]:
    """The device assignments in a ListPodResourcesResponse: device plugins' devices whose
    resource, and DRA devices whose driver, is in `resources` (exact names, or prefixes
    ending in '*') when given. KubeletError for more than MAX_ASSIGNMENTS, counted before any
    row is built."""

    def wanted(name: str) -> bool:
        return resources is None or resource_matches(name, resources)

    def containers() -> Iterator[tuple[Any, Any]]:  # walked, never held: 100k rows are MBs
        for pod in response.pod_resources:
            for container in pod.containers:
                yield pod, container

    rows = sum(
        len(devices.device_ids)
        for _, container in containers()
        for devices in container.devices
        if wanted(devices.resource_name)
    ) + sum(
        1
        for _, container in containers()
        for claim in container.dynamic_resources
        for device in claim.claim_resources
        if wanted(device.driver_name)
    )
    if rows > MAX_ASSIGNMENTS:
        raise KubeletError(
            f"the kubelet answered {rows} GPU assignments, more than one node can have "
            f"({MAX_ASSIGNMENTS}): answer ignored, the last one kept"
        )
    result = []
    for pod, container in containers():
        names = (pod.namespace, pod.name, container.name)
        for devices in container.devices:
            if wanted(devices.resource_name):
                for device_id in devices.device_ids:
                    result.append(PodDevice(*names, devices.resource_name, device_id))
        for claim in container.dynamic_resources:  # DRA (pod-resources v1, Kubernetes 1.34+)
            for device in claim.claim_resources:
                if wanted(device.driver_name):
                    result.append(
                        PodDevice(
                            *names,
                            device.driver_name,
                            device.device_name,
                            claim=claim.claim_name,
                            claim_namespace=claim.claim_namespace or pod.namespace,
                            pool=device.pool_name,
                            share_id=device.share_id if device.HasField("share_id") else "",
                        )
                    )
    return result


def resource_matches(name: str, patterns: frozenset[str]) -> bool:
    return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in patterns)


class PodResourcesClient:
    """List over one gRPC channel to the kubelet's unix socket; every call has a deadline."""

    def __init__(self, socket_path: str, *, timeout_s: float = 5.0) -> None:
        # gRPC's C core logs connection events (a kubelet restart's GOAWAY) at INFO to
        # stderr; the daemon reports them as states instead.
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
        try:
            import grpc
        except ImportError as exc:
            raise KubeletClientMissing(
                "grpcio is not installed (pip install 'gpumem-exporter[kubernetes]')"
            ) from exc
        self._grpc = grpc
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        classes = messages()
        self._request = classes["ListPodResourcesRequest"]
        self._response = classes["ListPodResourcesResponse"]
        self._channel = grpc.insecure_channel(
            f"unix://{socket_path}",
            options=[("grpc.max_receive_message_length", MAX_RESPONSE_BYTES)],
        )
        # The answer comes as bytes and is parsed here: grpc's own deserializing logs an
        # ERROR with a traceback for every malformed answer (every refresh, issue 38).
        self._list = self._channel.unary_unary(
            LIST_METHOD,
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=None,
        )

    def list(self, resources: frozenset[str] | None = None) -> list[PodDevice]:
        """Every device assignment; raises KubeletError with a one-line reason."""
        try:
            raw = self._list(self._request(), timeout=self.timeout_s, wait_for_ready=False)
        except self._grpc.RpcError as exc:
            raise KubeletError(_describe(exc, self.socket_path)) from None
        try:
            response = self._response.FromString(raw)
        except Exception:  # protobuf's DecodeError, or bytes that are no message at all
            raise KubeletError(
                f"kubelet pod-resources at {self.socket_path}: the answer is not a "
                "ListPodResourcesResponse (malformed protobuf)"
            ) from None
        return assignments(response, resources)

    def close(self) -> None:
        self._channel.close()


class KubeletError(RuntimeError):
    """The kubelet did not answer List; str() says why in one line."""


def _describe(error: Any, socket_path: str) -> str:
    code = getattr(error, "code", lambda: None)()
    details = getattr(error, "details", lambda: "")() or ""
    name = getattr(code, "name", "UNKNOWN")
    text = " ".join(f"{name}: {details}".split())
    return f"kubelet pod-resources at {socket_path}: {text}"[:300]
