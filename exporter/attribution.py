"""Whose GPU memory it is: the kubelet's device assignments and each GPU process's cgroup,
joined with NVML's readings of one sample. Pure: reads a Sample, returns plain values that
exporter.metrics renders.

- Every assignment becomes a row of gpu_pod_info, whether or not NVML sees that GPU: a device
  plugin's device and a device a ResourceClaim gave (DRA) alike, so that everything built on
  gpu_pod_info (the unattributed memory, the rules, the alerts) counts both; a DRA device also
  gets a gpu_dra_claim_info row with its claim and the driver's names.
- A process is named (namespace, pod, container) from its cgroup's pod UID and container ID
  (the kernel's) joined with what the kubelet or the API server calls them: the kubelet's
  container log links (exporter.kubernetes.container_logs) and the Kubernetes API's pods of
  the node (the pod reader); exact, on shared GPUs too. Never from anything a container holds
  (its /etc/hostname, its service-account namespace file): those are its tenant's to write
  (round 4: a pod could be charged to another, or make another be charged). Without either
  source of names a process keeps its pod UID alone, and is not judged against the holders.
- Memory that no pod owns is certain in three cases: a process in no pod (a host process,
  a container of no pod: orphaned workers of a killed server, `docker run`), a pod's process
  on a GPU that no pod holds (with names: that its own pod does not hold, though others
  may), and the GPU memory of a GPU that no pod holds. A process whose
  cgroup could not be read is listed with reason "unknown" and not counted.
- Never from a reading older than the process (issue 38): a pod's process first seen after
  the kubelet's latest List was asked may be of a pod that List did not know (a GPU that
  moved pods; a kubelet that is down). It is not named from the assignment nor judged
  against it: listed with reason "pending", not counted, until a List asked after it
  answers. Its pod UID (its own cgroup) and, with the pod reader, the names the API gives
  that UID stay exact.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

from exporter.kubernetes.device_ids import (
    base_device_id,
    device_gpu_uuid,
    resolve_dra_mig_instance,
    resolve_mig_instance,
)
from exporter.ratelimit import RateLimitedLog
from exporter.sample import KubeletReading, ProcessContainerReading, Sample

log = logging.getLogger(__name__)
# Once per device and ten minutes: attribute() runs on every render.
_unresolved = RateLimitedLog(log, every_s=600.0)

# Reasons a process's GPU memory belongs to no pod that holds its GPU.
NO_POD = "no_pod"  # a host process or a container of no pod
NOT_ASSIGNED = "not_assigned"  # a pod's process on a GPU no pod holds
UNKNOWN = "unknown"  # its cgroup could not be read: listed, not counted
PENDING = "pending"  # a pod's process newer than the kubelet's answer: listed, not counted
COUNTED_REASONS = (NO_POD, NOT_ASSIGNED)


@dataclass(frozen=True)
class GpuPod:
    gpu_uuid: str  # "" where the device ID names no GPU NVML reported
    device_id: str  # without a time-slicing replica suffix
    resource: str
    namespace: str
    pod: str
    container: str


@dataclass(frozen=True)
class DraClaim:
    """A GPU (or MIG device) a ResourceClaim gave a pod's container, as the kubelet reports
    it: the claim and the DRA driver's own names, beside its gpu_pod_info row."""

    gpu_uuid: str  # "" where the device resolves to no GPU NVML reported
    namespace: str
    pod: str
    container: str
    claim: str
    claim_namespace: str
    driver: str
    pool: str
    device: str
    share_id: str  # "" unless several claims share the device (consumable capacity)


@dataclass(frozen=True)
class ClaimMemory:
    """GPU memory a claim consumed of a shared GPU (its allocation's consumedCapacity), and
    what its container's processes use there: None where they cannot be named exactly
    (without the pod reader, the processes on a shared GPU keep their pod UIDs)."""

    gpu_index: int
    gpu_uuid: str
    claim_namespace: str
    claim: str
    share_id: str
    claimed_bytes: int
    used_bytes: int | None


@dataclass(frozen=True)
class ProcessPod:
    pid: int
    pod_uid: str
    container_id: str
    namespace: str = ""  # with pod and container: only where certain (see module doc)
    pod: str = ""
    container: str = ""


@dataclass(frozen=True)
class UnattributedProcess:
    gpu_index: int
    gpu_uuid: str
    pid: int
    reason: str
    used_bytes: int


@dataclass(frozen=True)
class GpuPodInstance:
    """A container's MIG device and the GPU instance it is in: the memory that is the pod's
    on a MIG GPU (the whole GPU's is shared by every instance's pods)."""

    gpu_uuid: str
    gpu_instance: int
    device_id: str
    namespace: str
    pod: str
    container: str


@dataclass
class Attribution:
    gpu_pods: list[GpuPod] = field(default_factory=list)
    gpu_pod_instances: list[GpuPodInstance] = field(default_factory=list)
    dra_claims: list[DraClaim] = field(default_factory=list)
    claim_memory: list[ClaimMemory] = field(default_factory=list)
    process_pods: list[ProcessPod] = field(default_factory=list)
    # By GPU UUID: (NVML index, bytes no pod owns). Only once the kubelet has answered.
    unattributed_gpus: dict[str, tuple[int, int]] = field(default_factory=dict)
    # By (GPU UUID, MIG GPU instance): (NVML index, bytes no pod owns), on MIG GPUs whose
    # every assignment names its instance (the device plugin's MIG-<uuid>).
    unattributed_instances: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    unattributed_processes: list[UnattributedProcess] = field(default_factory=list)
    # (NVML index, GPU UUID, namespace, pod, container) -> bytes its named processes use there:
    # per-process memory keyed by what a restart keeps.
    container_memory: dict[tuple[int, str, str, str, str], int] = field(default_factory=dict)


def attribute(sample: Sample) -> Attribution | None:
    """None where the sample has no Kubernetes view (not the node daemon in a cluster)."""
    kubelet = sample.kubelet
    if kubelet is None:
        return None
    result = Attribution()
    if kubelet.devices is None:  # never answered: no assignment known, nothing to judge
        return result
    _assignments(sample, kubelet, result)
    holders: dict[str, set[tuple[str, str, str]]] = defaultdict(set)
    for row in result.gpu_pods:
        if row.gpu_uuid:
            holders[row.gpu_uuid].add((row.namespace, row.pod, row.container))
    located = {c.pid: c for c in sample.process_containers}
    result.process_pods = _process_pods(sample, located)
    named = {p.pid: p for p in result.process_pods if p.pod}
    for entry in sample.processes:
        if (owner := named.get(entry.pid)) is not None:
            key = (entry.gpu_index, entry.gpu_uuid, owner.namespace, owner.pod, owner.container)
            result.container_memory[key] = result.container_memory.get(key, 0) + entry.used_bytes
    for entry in sample.processes:
        where = located.get(entry.pid)
        reason = _unattributed_reason(
            where, _holds(kubelet, where, holders.get(entry.gpu_uuid)), _fresh(kubelet, where)
        )
        if reason is not None:
            result.unattributed_processes.append(
                UnattributedProcess(
                    entry.gpu_index, entry.gpu_uuid, entry.pid, reason, entry.used_bytes
                )
            )
    result.claim_memory = _claim_memory(sample, result)
    for gpu in sample.gpus:
        if not gpu.up:
            continue
        if gpu.uuid in holders:
            counted = sum(
                p.used_bytes
                for p in result.unattributed_processes
                if p.gpu_uuid == gpu.uuid and p.reason in COUNTED_REASONS
            )
        elif gpu.used_bytes is not None:
            counted = gpu.used_bytes  # no pod holds this GPU: all of its memory
        else:
            continue
        result.unattributed_gpus[gpu.uuid] = (gpu.index, counted)
    result.unattributed_instances = _unattributed_instances(sample, result, located)
    return result


def _assignments(sample: Sample, kubelet: KubeletReading, result: Attribution) -> None:
    """The kubelet's assignments as rows: gpu_pods (and each MIG device's GPU instance where
    it is known) and the DRA devices' claims."""
    assert kubelet.devices is not None
    seen = set()
    for device in kubelet.devices:
        row = GpuPod(
            device_gpu_uuid(device, sample.gpus, kubelet.slices),
            base_device_id(device.device_id),
            device.resource,
            device.namespace,
            device.pod,
            device.container,
        )
        if device.dynamic and not row.gpu_uuid and sample.gpus:
            # A DRA name that resolves to nothing here (`gpu-99`, another driver's device)
            # names no pod anywhere: a claim's row would carry its pod beside a GPU of no
            # one. Said once, with the claim, so that an on-call knows why.
            _unresolved.warning(
                f"{device.resource}/{device.device_id}",
                f"{device.resource} device {device.device_id!r} of claim "
                f"{device.claim_namespace}/{device.claim} (pod {device.namespace}/{device.pod}) "
                "is no GPU NVML reports on this node: not attributed",
            )
            continue
        if row not in seen:  # time-slicing gives one container several replicas
            seen.add(row)
            result.gpu_pods.append(row)
            if device.dynamic:
                instance = resolve_dra_mig_instance(
                    device.resource, row.device_id, sample.gpus, sample.mig_instances
                )
            else:
                instance = resolve_mig_instance(row.device_id, sample.mig_instances)
            if instance is not None:
                result.gpu_pod_instances.append(
                    GpuPodInstance(
                        instance.gpu_uuid,
                        instance.gpu_instance_id,
                        row.device_id,
                        row.namespace,
                        row.pod,
                        row.container,
                    )
                )
            if not row.gpu_uuid and sample.gpus:
                # Still listed (the assignment is the kubelet's), with gpu_uuid="": said, so
                # that an on-call knows why that pod's GPU memory is joined to nothing.
                _unresolved.warning(
                    f"{device.resource}/{device.device_id}",
                    f"{device.resource} device {device.device_id!r} of pod "
                    f"{device.namespace}/{device.pod} is no GPU NVML reports on this node: "
                    "its memory cannot be attributed",
                )
        if device.dynamic:
            result.dra_claims.append(
                DraClaim(
                    row.gpu_uuid,
                    device.namespace,
                    device.pod,
                    device.container,
                    device.claim,
                    device.claim_namespace,
                    device.resource,
                    device.pool,
                    device.device_id,
                    device.share_id,
                )
            )


def _unattributed_instances(
    sample: Sample, result: Attribution, located: dict[int, ProcessContainerReading]
) -> dict[tuple[str, int], tuple[int, int]]:
    """Memory no pod owns per MIG GPU instance: all of an instance no pod holds, else its
    processes' that their pod does not hold (as per GPU). Only on GPUs whose every assignment
    names its GPU instance: an assignment by GKE's or DRA's names says the GPU, not which of
    its instances, and judging instances without it would blame the wrong ones."""
    kubelet = sample.kubelet
    assert kubelet is not None
    placed: dict[tuple[str, int], set[tuple[str, str, str]]] = defaultdict(set)
    for row in result.gpu_pod_instances:
        placed[(row.gpu_uuid, row.gpu_instance)].add((row.namespace, row.pod, row.container))
    by_instance = {(row.gpu_uuid, row.device_id) for row in result.gpu_pod_instances}
    unjudged = {
        row.gpu_uuid
        for row in result.gpu_pods
        if row.gpu_uuid and (row.gpu_uuid, row.device_id) not in by_instance
    }
    found = {}
    for instance in sample.mig_instances:
        uuid, gpu_instance = instance.gpu_uuid, instance.gpu_instance_id
        if instance.used_bytes is None or uuid in unjudged:
            continue
        holders = placed.get((uuid, gpu_instance))
        if not holders:
            found[(uuid, gpu_instance)] = (instance.gpu_index, instance.used_bytes)
            continue
        counted = 0
        for entry in sample.processes:
            if (entry.gpu_uuid, entry.gpu_instance_id) != (uuid, gpu_instance):
                continue
            where = located.get(entry.pid)
            reason = _unattributed_reason(
                where, _holds(kubelet, where, holders), _fresh(kubelet, where)
            )
            if reason in COUNTED_REASONS:
                counted += entry.used_bytes
        found[(uuid, gpu_instance)] = (instance.gpu_index, counted)
    return found


def _claim_memory(sample: Sample, result: Attribution) -> list[ClaimMemory]:
    """Claimed against used, for each DRA device whose claim consumed a share of its GPU's
    memory (the claim reader's allocations)."""
    kubelet = sample.kubelet
    if kubelet is None or kubelet.claims is None:
        return []
    index = {g.uuid: g.index for g in sample.gpus}
    found = []
    for claim in result.dra_claims:
        if claim.gpu_uuid not in index:
            continue
        allocated = kubelet.claims.get((claim.claim_namespace, claim.claim), [])
        memory = next(
            (
                d.memory_bytes
                for d in allocated
                if (d.driver, d.pool, d.device, d.share_id)
                == (claim.driver, claim.pool, claim.device, claim.share_id)
            ),
            None,
        )
        if memory is None:
            continue  # not allocated (yet), or the whole device: nothing claimed to hold against
        used = None
        if _names(kubelet) is not None:  # names exact: the container's processes on this GPU
            key = (index[claim.gpu_uuid], claim.gpu_uuid, claim.namespace, claim.pod)
            used = result.container_memory.get((*key, claim.container), 0)
        found.append(
            ClaimMemory(
                index[claim.gpu_uuid],
                claim.gpu_uuid,
                claim.claim_namespace,
                claim.claim,
                claim.share_id,
                memory,
                used,
            )
        )
    return found


def _names(kubelet: KubeletReading) -> tuple[dict[str, tuple[str, str]], dict[str, str]] | None:
    """(pod UID -> (namespace, pod), container ID -> container) as the kubelet's links and the
    pod reader name them, or None where neither answered. The API's answer wins where both
    name one UID (the two agree; the API may be newer)."""
    if kubelet.log_pods is None and kubelet.pods is None:
        return None
    pods = {**(kubelet.log_pods or {}), **(kubelet.pods or {})}
    return pods, {**kubelet.log_containers, **kubelet.containers}


def _holds(
    kubelet: KubeletReading,
    where: ProcessContainerReading | None,
    holders: set[tuple[str, str, str]] | None,
) -> bool:
    """Whether a pod holds the GPU a process is on: with names, the process's own pod (by its
    pod UID); without, any pod (nothing the process says of itself is taken)."""
    if not holders:
        return False
    names = _names(kubelet)
    if names is None or where is None:
        return True
    pod = names[0].get(where.pod_uid)
    if pod is None:
        # The kubelet's links name every container it started before its List was asked
        # (a judged process is older than that): a UID they lack is no pod of this kubelet.
        # The API's list alone may simply be older than the pod: no judgement then.
        return kubelet.log_pods is None
    return pod in {(ns, name) for ns, name, _ in holders}


def _fresh(kubelet: KubeletReading, where: ProcessContainerReading | None) -> bool:
    """Whether the kubelet's assignment was asked after the process was first seen: only
    then does it know the process's pod (a running container's devices never change)."""
    if where is None:
        return False
    return kubelet.asked_s is not None and where.first_seen_s <= kubelet.asked_s


def _unattributed_reason(
    where: ProcessContainerReading | None, assigned: bool, fresh: bool
) -> str | None:
    if where is None or where.state == "unknown":
        return UNKNOWN
    if where.state == "no_container" or not where.pod_uid:
        return NO_POD
    if not fresh:
        return PENDING
    return None if assigned else NOT_ASSIGNED


def _process_pods(sample: Sample, located: dict[int, ProcessContainerReading]) -> list[ProcessPod]:
    kubelet = sample.kubelet
    names = _names(kubelet) if kubelet is not None else None
    pids = sorted({e.pid for e in sample.processes})
    result = []
    for pid in pids:
        where = located.get(pid)
        if where is None or not where.pod_uid:
            continue
        owner = _owner(names, where) if names is not None else None
        if owner is None:
            result.append(ProcessPod(pid, where.pod_uid, where.container_id))
        else:
            result.append(ProcessPod(pid, where.pod_uid, where.container_id, *owner))
    return result


def _owner(
    names: tuple[dict[str, tuple[str, str]], dict[str, str]], where: ProcessContainerReading
) -> tuple[str, str, str] | None:
    """(namespace, pod, container) as the kubelet or the API names the process's pod UID and
    container ID. Never a partial name: an empty `container` label would take the scraping
    target's own under honor_labels."""
    pods, containers = names
    pod = pods.get(where.pod_uid)
    container = containers.get(where.container_id)
    return None if pod is None or not container else (*pod, container)
