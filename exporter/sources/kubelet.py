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
from typing import Any, TypeVar

from exporter.kubernetes.api import ApiError
from exporter.kubernetes.cgroup import UnknownCgroupShape, read_cgroup
from exporter.kubernetes.claims import ClaimsApiError
from exporter.kubernetes.container_logs import ContainerLogsError, read_container_logs
from exporter.kubernetes.device_ids import known_dra_name
from exporter.kubernetes.podresources import (
    DEFAULT_SOCKET,
    KubeletClientMissing,
    KubeletError,
    PodResourcesClient,
)
from exporter.kubernetes.pods import PodsApiError
from exporter.sample import KubeletReading, PodDevice, ProcessContainerReading, SourceReading
from exporter.sources import KUBERNETES

log = logging.getLogger(__name__)
T = TypeVar("T")

# Resources that are GPUs (device-plugin names); more with GPUMEM_KUBELET_RESOURCES.
# Device plugins' resource names, and DRA drivers' names (NVIDIA's DRA driver).
DEFAULT_RESOURCES = ("nvidia.com/gpu", "nvidia.com/mig-*", "gpu.nvidia.com")


class KubeletSource:
    name = "kubelet"
    provides = frozenset({KUBERNETES})

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
        logs_folder: str = "",
    ) -> None:
        self._pids = pids  # host PIDs with GPU memory (NvmlSource.last_pids)
        self.socket_path = socket_path
        self._refresh_s = refresh_s
        self._timeout_s = timeout_s
        self._resources = frozenset(resources)
        self._proc = proc
        self._client_factory = client_factory
        self._client: Any = None
        # The kubelet's container log links (exporter.kubernetes.container_logs): names from
        # the host's disk, never from a container's own files. "" reads none.
        self._logs_folder = logs_folder
        self._from_logs: dict[str, Any] = {"logs_folder": logs_folder}
        self._logged_logs = ""
        # Make the Kubernetes API's clients, where the pod reader (exporter.kubernetes.pods)
        # and the claim reader (exporter.kubernetes.claims) are on; one that cannot be made
        # raises, a state like the kubelet's. Each client is made at its first use.
        self._api_factories = {
            kind: factory for kind, factory in (("pods", pods), ("claims", claims)) if factory
        }
        self._api_clients: dict[str, Any] = {}
        # The API's latest answers as KubeletReading fields (pods, containers, claims, slices
        # and their errors): joined to every kubelet answer, and to the latest when they come.
        self._from_api: dict[str, Any] = {}
        self._logged_api: dict[str, str] = {}  # what was asked -> the reason last logged
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # One thread for each of the API's readers, woken with each kubelet refresh: a slow
        # claim list never holds up the pod names (round 4: a new pod was named 63 s late).
        self._api_wakes = {kind: threading.Event() for kind in self._api_factories}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._api_threads: dict[str, threading.Thread] = {}
        self._state = KubeletReading(socket=socket_path, up=False, error="not asked yet")
        self._logged_error = ""
        self._containers: dict[int, ProcessContainerReading] = {}
        self.refreshes = 0  # completed List attempts, for tests and the refresh thread's pace

    # -- the sampler's side: cheap, never blocks on the kubelet ---------------------------

    def read(self) -> SourceReading:
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
        # Started after the wake is set: a thread started before it could clear the wake,
        # begin the first List, and then List again for the same change (two calls for one).
        self._start()
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
        # Nothing under the process's root is read: its files are its tenant's (a FIFO there
        # blocked the tick for good, round 4). Names come from the kubelet (refresh).
        return ProcessContainerReading(
            pid,
            "container",
            pod_uid=container.pod_uid,
            container_id=container.container_id,
        )

    # -- the refresh thread ---------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpumem-kubelet", daemon=True)
            self._thread.start()
        for kind in self._api_factories:
            if kind not in self._api_threads:
                thread = threading.Thread(
                    target=self._run_api, args=(kind,), name=f"gpumem-kube-{kind}", daemon=True
                )
                self._api_threads[kind] = thread
                thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self.refresh()
            for wake in self._api_wakes.values():  # asked beside, never in the way of, the kubelet
                wake.set()
            self._wake.wait(self._refresh_s)

    def _run_api(self, kind: str) -> None:
        wake = self._api_wakes[kind]
        while not self._stop.is_set():
            wake.wait(self._refresh_s)
            wake.clear()
            if self._stop.is_set():
                return
            self.refresh_api(kind)

    def refresh_pods(self) -> None:
        """Both of the API's readers, one after the other (tests; the threads ask apart)."""
        for kind in self._api_factories:
            self.refresh_api(kind)

    def refresh_api(self, kind: str) -> None:
        """One reader's view from the Kubernetes API, joined to the kubelet's latest answer at
        once: "pods", the node's pods (pod reader); "claims", the ResourceClaims of its DRA
        devices and, where a device's name needs them, its ResourceSlices (claim reader)."""
        with self._lock:
            devices = self._state.devices or []
        found: dict[str, Any] = {}
        if kind == "pods":
            listed, found["pods_error"] = self._ask("pod names", lambda: self._api("pods").list())
            found["pods"] = listed.pods if listed is not None else None
            found["containers"] = listed.containers if listed is not None else {}
        if kind == "claims":
            namespaces = {d.claim_namespace for d in devices if d.claim}
            found["claims"], found["claims_error"] = self._ask(
                "ResourceClaims", lambda: self._api("claims").list(namespaces) if namespaces else {}
            )
            # Only where a DRA device's name cannot be read here (another driver named in the
            # resources, a naming NVIDIA's driver may adopt).
            if not all(known_dra_name(d.resource, d.device_id) for d in devices if d.dynamic):
                found["slices"], error = self._ask(
                    "ResourceSlices", lambda: self._api("claims").slices()
                )
                found["claims_error"] = found["claims_error"] or error
        with self._lock:
            self._from_api = {**self._from_api, **found}
            if self._state.devices is not None or self._state.up:
                self._state = dataclasses.replace(self._state, **found)

    def refresh(self) -> None:
        """One List call; its outcome becomes the state the next tick reads."""
        asked = time.time()  # before the call: what it answers is at least this fresh
        try:
            devices = self._list()
        except Exception as exc:  # any failure is a state: this thread must go on
            self._failed(_one_line(exc))
        else:
            # After the List: every container of a process it can judge had its link then.
            self._read_logs()
            with self._lock:
                self._state = KubeletReading(
                    socket=self.socket_path,
                    up=True,
                    last_success_s=time.time(),
                    asked_s=asked,
                    refresh_errors=self._state.refresh_errors,
                    devices=devices,
                    pods_api="pods" in self._api_factories,
                    claims_api="claims" in self._api_factories,
                    **self._from_api,
                    **self._from_logs,
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

    def _read_logs(self) -> None:
        """The kubelet's names of this node's pods and containers, or why there are none (a
        state on /metrics, logged once per reason)."""
        if not self._logs_folder:
            return
        try:
            names = read_container_logs(self._logs_folder)
        except ContainerLogsError as exc:
            error = _one_line(exc)
            self._from_logs = {"logs_folder": self._logs_folder, "logs_error": error}
            if error != self._logged_logs:
                log.warning("no pod names from the kubelet's container logs: %s", error)
                self._logged_logs = error
            return
        self._from_logs = {
            "logs_folder": self._logs_folder,
            "log_pods": names.pods,
            "log_containers": names.containers,
        }
        if self._logged_logs:
            log.info("the kubelet's container logs at %s are read again", self._logs_folder)
            self._logged_logs = ""

    def _api(self, kind: str) -> Any:
        """The client of the pod reader ("pods") or the claim reader ("claims")."""
        if kind not in self._api_clients:
            self._api_clients[kind] = self._api_factories[kind]()
        return self._api_clients[kind]

    def _ask(self, what: str, call: Callable[[], T]) -> tuple[T | None, str]:
        """One question to the Kubernetes API: (its answer, "") or (None, why), the why a
        state on /metrics and logged once per reason; the kubelet's answer counts either
        way."""
        try:
            answer = call()
        except Exception as exc:
            error = _one_line(exc)
            if error != self._logged_api.get(what):
                log.warning("no %s from the Kubernetes API: %s", what, error)
                self._logged_api[what] = error
            return None, error
        self._logged_api.pop(what, None)
        return answer, ""

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
        for wake in self._api_wakes.values():
            wake.set()
        for thread in (self._thread, *self._api_threads.values()):
            if thread is not None:
                thread.join(self._timeout_s + 1)
        self._thread = None
        self._api_threads = {}
        self._drop_client()


def _one_line(exc: BaseException) -> str:
    ours = (
        KubeletError,
        KubeletClientMissing,
        PodsApiError,
        ClaimsApiError,
        ApiError,
        ContainerLogsError,
    )
    text = str(exc) if isinstance(exc, ours) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:300]
