"""The node daemon's Kubernetes view: which container each GPU is assigned to (the kubelet's
pod-resources API) and which container each GPU process runs in (/proc/<pid>/cgroup).

The kubelet is asked from a thread of this source's own, never from the sampler's tick: a slow
or hung kubelet costs its call's deadline (seconds) on that thread, and every tick reads the
latest answer. The Kubernetes API (the pod reader) is asked from a second thread, woken with
each kubelet refresh: an API server that is slow or trickles its answer never holds up the
kubelet's (issue 38), and its latest answer is joined to the kubelet's when it comes. The
kubelet is asked every `refresh_s`, and at once when the set of GPU processes changes (a pod
that starts or stops changes both), so a GPU that moves to another pod is re-attributed within
one refresh. A missing socket, a kubelet that times out, answers garbage or restarts,
or a missing grpcio, is a state on the reading (exporter.metrics: gpumem_exporter_kubelet_*)
and one log line per change of reason, never an exception into the tick.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from exporter.kubernetes.cgroup import UnknownCgroupShape, pod_hints, read_cgroup
from exporter.kubernetes.claims import ClaimsApiError
from exporter.kubernetes.device_ids import known_dra_name
from exporter.kubernetes.podresources import (
    DEFAULT_SOCKET,
    KubeletClientMissing,
    KubeletError,
    PodResourcesClient,
)
from exporter.kubernetes.pods import PodsApiError
from exporter.sample import KubeletReading, PodDevice, ProcessContainerReading, SourceReading

log = logging.getLogger(__name__)

# Resources that are GPUs (device-plugin names); more with GPUMEM_KUBELET_RESOURCES.
# Device plugins' resource names, and DRA drivers' names (NVIDIA's DRA driver).
DEFAULT_RESOURCES = ("nvidia.com/gpu", "nvidia.com/mig-*", "gpu.nvidia.com")


class KubeletSource:
    name = "kubelet"

    def __init__(
        self,
        pids: Callable[[], Collection[int]],
        *,
        socket_path: str = DEFAULT_SOCKET,
        refresh_s: float = 10.0,
        timeout_s: float = 5.0,
        resources: Collection[str] = DEFAULT_RESOURCES,
        proc: str = "/proc",
        client_factory: Callable[..., Any] = PodResourcesClient,
        pods: Callable[[], Any] | None = None,
        claims: Callable[[], Any] | None = None,
    ) -> None:
        self._pids = pids  # host PIDs with GPU memory (NvmlSource.last_pids)
        self.socket_path = socket_path
        self._refresh_s = refresh_s
        self._timeout_s = timeout_s
        self._resources = frozenset(resources)
        self._proc = proc
        self._client_factory = client_factory
        self._client: Any = None
        # Makes the Kubernetes API client (exporter.kubernetes.pods), where the pod reader is
        # on; raises PodsApiError where it cannot be made (then a state, like the kubelet's).
        self._pods_factory = pods
        self._pods_client: Any = None
        # Makes the ResourceClaims client (exporter.kubernetes.claims), where the claim reader
        # is on: asked beside the pods, for the namespaces of this node's DRA devices.
        self._claims_factory = claims
        self._claims_client: Any = None
        self._claims: tuple[dict[tuple[str, str], list[Any]] | None, str] = (None, "")
        self._logged_claims_error = ""
        self._slices: dict[tuple[str, str, str], str] | None = None
        self._logged_slices_error = ""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pods_wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pods_thread: threading.Thread | None = None
        # The pod reader's latest answer: (pods by UID, container names by ID, error).
        self._pods: tuple[dict[str, tuple[str, str]] | None, dict[str, str], str] = (None, {}, "")
        self._state = KubeletReading(socket=socket_path, up=False, error="not asked yet")
        self._logged_error = ""
        self._logged_pods_error = ""
        self._containers: dict[int, ProcessContainerReading] = {}
        self.refreshes = 0  # completed List attempts, for tests and the refresh thread's pace
        # The node's own names: the hostname of a hostNetwork pod's container, not a pod's.
        host_hostname, _ = pod_hints(1, proc)
        self._node_names = {os.environ.get("NODE_NAME", ""), host_hostname} - {""}

    # -- the sampler's side: cheap, never blocks on the kubelet ---------------------------

    def read(self) -> SourceReading:
        self._start()
        pids = frozenset(self._pids())
        if pids != self._containers.keys():
            # Processes came or went: who holds the GPUs may have changed pods too.
            known = self._containers
            now = time.time()
            self._containers = {
                pid: known[pid]
                if pid in known and known[pid].state != "unknown"
                else dataclasses.replace(self._locate(pid), first_seen_s=now)
                for pid in sorted(pids)
            }
            self._wake.set()
        with self._lock:
            state = self._state
        return SourceReading(kubelet=state, process_containers=list(self._containers.values()))

    def _locate(self, pid: int) -> ProcessContainerReading:
        try:
            container = read_cgroup(pid, self._proc)
        except FileNotFoundError:
            return ProcessContainerReading(pid, "unknown", detail="process gone")
        except OSError as exc:
            return ProcessContainerReading(pid, "unknown", detail=f"cgroup: {exc.strerror}")
        except UnknownCgroupShape as exc:
            return ProcessContainerReading(pid, "unknown", detail=str(exc)[:200])
        if container is None:
            return ProcessContainerReading(pid, "no_container")
        hostname, namespace = pod_hints(pid, self._proc) if container.pod_uid else ("", "")
        if hostname in self._node_names:
            hostname = ""  # a hostNetwork pod has the node's hostname: it names no pod
        return ProcessContainerReading(
            pid,
            "container",
            pod_uid=container.pod_uid,
            container_id=container.container_id,
            hostname=hostname,
            namespace=namespace,
        )

    # -- the refresh thread ---------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpumem-kubelet", daemon=True)
            self._thread.start()
        readers = self._pods_factory is not None or self._claims_factory is not None
        if readers and self._pods_thread is None:
            self._pods_thread = threading.Thread(
                target=self._run_pods, name="gpumem-kube-pods", daemon=True
            )
            self._pods_thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self.refresh()
            self._pods_wake.set()  # the pods, asked beside (never in the way of) the kubelet
            self._wake.wait(self._refresh_s)

    def _run_pods(self) -> None:
        while not self._stop.is_set():
            self._pods_wake.wait(self._refresh_s)
            self._pods_wake.clear()
            if self._stop.is_set():
                return
            self.refresh_pods()

    def refresh_pods(self) -> None:
        """One List of the node's pods from the Kubernetes API, and of the ResourceClaims of
        its DRA devices; joined to the kubelet's latest answer at once."""
        pods, containers, error = self._list_pods()
        with self._lock:
            devices = self._state.devices or []
        claims, claims_error = self._list_claims({d.claim_namespace for d in devices if d.claim})
        slices, slices_error = self._list_slices(devices)
        claims_error = claims_error or slices_error
        with self._lock:
            self._pods = (pods, containers, error)
            self._claims = (claims, claims_error)
            self._slices = slices
            if self._state.devices is not None or self._state.up:
                self._state = dataclasses.replace(
                    self._state,
                    pods=pods,
                    containers=containers,
                    pods_error=error,
                    claims=claims,
                    claims_error=claims_error,
                    slices=slices,
                )

    def refresh(self) -> None:
        """One List call; its outcome becomes the state the next tick reads."""
        asked = time.time()  # before the call: what it answers is at least this fresh
        try:
            devices = self._list()
        except Exception as exc:  # any failure is a state: this thread must go on
            self._failed(_one_line(exc))
        else:
            with self._lock:
                pods, containers, pods_error = self._pods
                claims, claims_error = self._claims
                slices = self._slices
                self._state = KubeletReading(
                    socket=self.socket_path,
                    up=True,
                    last_success_s=time.time(),
                    asked_s=asked,
                    refresh_errors=self._state.refresh_errors,
                    devices=devices,
                    pods=pods,
                    containers=containers,
                    pods_api=self._pods_factory is not None,
                    pods_error=pods_error,
                    claims=claims,
                    claims_api=self._claims_factory is not None,
                    claims_error=claims_error,
                    slices=slices,
                )
            if self._logged_error:
                log.info("kubelet pod-resources at %s answers again", self.socket_path)
                self._logged_error = ""
        self.refreshes += 1

    def _list(self) -> list[PodDevice]:
        if not os.path.exists(self.socket_path):
            raise KubeletError(f"kubelet pod-resources socket {self.socket_path} not found")
        if self._client is None:
            self._client = self._client_factory(self.socket_path, timeout_s=self._timeout_s)
        try:
            return list(self._client.list(self._resources))
        except Exception:
            self._drop_client()  # a restarted kubelet's new socket: connect afresh next time
            raise

    def _list_pods(self) -> tuple[dict[str, tuple[str, str]] | None, dict[str, str], str]:
        """(pods by UID, container names by ID, error) from the Kubernetes API, if on."""
        if self._pods_factory is None:
            return None, {}, ""
        try:
            if self._pods_client is None:
                self._pods_client = self._pods_factory()
            listed = self._pods_client.list()
        except Exception as exc:  # a state on /metrics; the kubelet's answer still counts
            error = _one_line(exc)
            if error != self._logged_pods_error:
                log.warning("no pod names from the Kubernetes API: %s", error)
                self._logged_pods_error = error
            return None, {}, error
        self._logged_pods_error = ""
        return listed.pods, listed.containers, ""

    def _list_claims(
        self, namespaces: set[str]
    ) -> tuple[dict[tuple[str, str], list[Any]] | None, str]:
        """(claims, error) from the Kubernetes API, if the claim reader is on."""
        if self._claims_factory is None:
            return None, ""
        if not namespaces:
            return {}, ""
        try:
            if self._claims_client is None:
                self._claims_client = self._claims_factory()
            claims = self._claims_client.list(namespaces)
        except Exception as exc:  # a state on /metrics; attribution goes on without it
            error = _one_line(exc)
            if error != self._logged_claims_error:
                log.warning("no ResourceClaims from the Kubernetes API: %s", error)
                self._logged_claims_error = error
            return None, error
        self._logged_claims_error = ""
        return claims, ""

    def _list_slices(
        self, devices: list[PodDevice]
    ) -> tuple[dict[tuple[str, str, str], str] | None, str]:
        """This node's ResourceSlices, only where a DRA device's name cannot be read here
        (another driver named in the resources, a naming NVIDIA's driver may adopt)."""
        if self._claims_factory is None or all(
            known_dra_name(d.resource, d.device_id) for d in devices if d.dynamic
        ):
            return None, ""
        try:
            if self._claims_client is None:
                self._claims_client = self._claims_factory()
            slices = self._claims_client.slices()
        except Exception as exc:  # a state on /metrics, with the claims'
            error = _one_line(exc)
            if error != self._logged_slices_error:
                log.warning("no ResourceSlices from the Kubernetes API: %s", error)
                self._logged_slices_error = error
            return None, error
        self._logged_slices_error = ""
        return slices, ""

    def _failed(self, error: str) -> None:
        with self._lock:
            # The last known assignment (and pods) stay, aged on /metrics by last_success_s.
            self._state = dataclasses.replace(
                self._state,
                up=False,
                error=error,
                refresh_errors=self._state.refresh_errors + 1,
            )
        if error != self._logged_error:  # one line per reason, not one per refresh
            log.warning("no pod attribution from the kubelet: %s", error)
            self._logged_error = error

    def _drop_client(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(Exception):  # a broken channel: nothing to save
                client.close()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._pods_wake.set()
        for thread in (self._thread, self._pods_thread):
            if thread is not None:
                thread.join(self._timeout_s + 1)
        self._thread = self._pods_thread = None
        self._drop_client()


def _one_line(exc: BaseException) -> str:
    ours = (KubeletError, KubeletClientMissing, PodsApiError, ClaimsApiError)
    text = str(exc) if isinstance(exc, ours) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:300]
