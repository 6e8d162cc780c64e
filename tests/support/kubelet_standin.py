"""A stand-in kubelet: a real gRPC server on a unix socket serving v1.PodResourcesLister/List.

Its messages and service stubs are generated here, at start, by grpcio-tools' protoc from the
vendored published schema (exporter/kubernetes/podresources_v1/api.proto): independent of
the exporter's own descriptor loading, so a mistake there cannot hide here.

What List answers is read from a JSON file on every call, so a test moves a GPU to another pod
by rewriting it:

    {"pods": [{"namespace": "serving", "name": "llama-0", "containers": [
        {"name": "server", "devices": [{"resource": "nvidia.com/gpu", "ids": ["GPU-..."]}]}]}],
     "delay_s": 0,          # answer this much later (a slow kubelet)
     "abort": ""}           # or fail with this gRPC status code name (UNAVAILABLE, ...)

Run as a program (GPU tests start it beside `gpumem-exporter serve`):
    python -m tests.support.kubelet_standin SOCKET STATE_JSON
"""

from __future__ import annotations

import importlib
import json
import signal
import sys
import tempfile
import threading
import time
from concurrent import futures
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

PROTO = Path(__file__).resolve().parents[2] / "exporter/kubernetes/podresources_v1/api.proto"


@cache
def generated() -> tuple[ModuleType, ModuleType]:
    """api_pb2 and api_pb2_grpc, generated from the vendored api.proto into a temp folder."""
    from grpc_tools import protoc

    out = Path(tempfile.mkdtemp(prefix="podresources-"))
    status = protoc.main(
        [
            "protoc",
            f"-I{PROTO.parent}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(PROTO),
        ]
    )
    if status != 0:
        raise RuntimeError(f"protoc failed with {status}")
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module("api_pb2"), importlib.import_module("api_pb2_grpc")
    finally:
        sys.path.remove(str(out))


def write_state(path: Path, pods: list[dict[str, Any]], **extra: Any) -> None:
    """Replace the stand-in's answer at once (write, then rename)."""
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps({"pods": pods, **extra}))
    temp.replace(path)


def pod(namespace: str, name: str, container: str, *ids: str, resource: str = "nvidia.com/gpu"):
    """One pod with one container holding `ids` of `resource` (a helper for tests)."""
    devices = [{"resource": resource, "ids": list(ids)}]
    return {
        "namespace": namespace,
        "name": name,
        "containers": [{"name": container, "devices": devices}],
    }


def claim_pod(
    namespace: str, name: str, container: str, claim: str, *devices: dict[str, str]
) -> dict[str, Any]:
    """One pod with one container holding DRA `devices` of one ResourceClaim, as a 1.34
    kubelet reports them in ContainerResources.dynamic_resources (see dra_device)."""
    return {
        "namespace": namespace,
        "name": name,
        "containers": [
            {"name": container, "claims": [{"name": claim, "namespace": namespace,
                                            "devices": list(devices)}]}
        ],
    }  # fmt: skip


def dra_device(
    device: str,
    *,
    driver: str = "gpu.nvidia.com",
    pool: str = "gpu-node-1",
    share_id: str | None = None,
    claim_uid: str = "5e4c0f4e-1d2b-4b41-9b43-d0a0c3d2a7b1",
) -> dict[str, str]:
    """One device of a claim: NVIDIA's DRA driver's pool is the node's name, its CDI device
    `k8s.gpu.nvidia.com/claim=<claim UID>-<device>`."""
    entry = {"driver": driver, "pool": pool, "device": device,
             "cdi": f"k8s.{driver}/claim={claim_uid}-{device}"}  # fmt: skip
    if share_id is not None:
        entry["share_id"] = share_id
    return entry


def _dynamic_resource(pb2: Any, claim: dict[str, Any]) -> Any:
    resources = []
    for d in claim["devices"]:
        resource = pb2.ClaimResource(
            cdi_devices=[pb2.CDIDevice(name=d["cdi"])],
            driver_name=d["driver"],
            pool_name=d["pool"],
            device_name=d["device"],
        )
        if "share_id" in d:
            resource.share_id = d["share_id"]
        resources.append(resource)
    return pb2.DynamicResource(
        claim_name=claim["name"], claim_namespace=claim["namespace"], claim_resources=resources
    )


def link_container_log(
    folder: Path, namespace: str, pod: str, uid: str, container: str, container_id: str
) -> Path:
    """The link the kubelet makes in /var/log/containers when it starts a container (its
    legacyLogSymlink), pointing where its podLogsDir keeps the log; a link of the same
    container made earlier goes first."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob(f"*-{container_id}.log"):
        old.unlink()
    link = folder / f"{pod}_{namespace}_{container}-{container_id}.log"
    link.symlink_to(f"/var/log/pods/{namespace}_{pod}_{uid}/{container}/0.log")
    return link


class StandInKubelet:
    def __init__(self, socket_path: Path, state_path: Path) -> None:
        pb2, pb2_grpc = generated()
        self.socket_path = socket_path
        self.state_path = state_path
        self.calls = 0
        standin = self

        servicer: Any = pb2_grpc.PodResourcesListerServicer  # generated at run time

        class Lister(servicer):
            def List(self, request: Any, context: grpc.ServicerContext) -> Any:
                standin.calls += 1
                state = json.loads(standin.state_path.read_text())
                if state.get("delay_s"):
                    time.sleep(float(state["delay_s"]))
                if state.get("abort"):
                    context.abort(getattr(grpc.StatusCode, state["abort"]), "stand-in refuses")
                return pb2.ListPodResourcesResponse(
                    pod_resources=[
                        pb2.PodResources(
                            name=p["name"],
                            namespace=p["namespace"],
                            containers=[
                                pb2.ContainerResources(
                                    name=c["name"],
                                    devices=[
                                        pb2.ContainerDevices(
                                            resource_name=d["resource"], device_ids=d["ids"]
                                        )
                                        for d in c.get("devices", [])
                                    ],
                                    dynamic_resources=[
                                        _dynamic_resource(pb2, claim)
                                        for claim in c.get("claims", [])
                                    ],
                                )
                                for c in p["containers"]
                            ],
                        )
                        for p in state["pods"]
                    ]
                )

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb2_grpc.add_PodResourcesListerServicer_to_server(Lister(), self.server)
        self.server.add_insecure_port(f"unix://{socket_path}")

    def start(self) -> StandInKubelet:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=None).wait()


def main() -> None:
    kubelet = StandInKubelet(Path(sys.argv[1]), Path(sys.argv[2])).start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    print("ready", flush=True)
    done.wait()
    kubelet.stop()


if __name__ == "__main__":
    main()
