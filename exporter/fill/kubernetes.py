"""The node daemon's view of Kubernetes (exporter.attribution): the kubelet's and the API
readers' state, then info series joined to the device and process series by gpu_uuid or pid,
which keep their identity when a GPU changes hands, and the memory no pod owns."""

from __future__ import annotations

from collections.abc import Iterator

from exporter import catalog
from exporter.attribution import Attribution, attribute
from exporter.fill.render import Render
from exporter.fill.rows import FamilyRows, Filled, Plans
from exporter.sample import Sample


def families(render: Render, sample: Sample) -> Filled:
    return list(_families(render.plans, sample))


def _families(plans: Plans, sample: Sample) -> Iterator[tuple[FamilyRows, bool]]:
    kubelet = sample.kubelet
    if kubelet is None:
        return
    new = plans.new
    up = new(catalog.family("gpumem_exporter_kubelet_up"))
    up.add({}, 1.0 if kubelet.up else 0.0)
    yield up, True
    errors = new(catalog.family("gpumem_exporter_kubelet_refresh_errors"))
    errors.add({}, kubelet.refresh_errors)
    yield errors, True
    if kubelet.last_success_s is not None:
        last = new(catalog.family("gpumem_exporter_kubelet_last_success_timestamp_seconds"))
        last.add({}, kubelet.last_success_s)
        yield last, True
    if kubelet.error:
        error = new(catalog.family("gpumem_exporter_kubelet_error"))
        error.add_info({}, {"error": kubelet.error, "socket": kubelet.socket})
        yield error, True
    if kubelet.logs_folder and kubelet.logs_error:  # as the kubelet's own error: no series
        # while all is well (the node's series budget, docs/performance.md)
        info = new(catalog.family("gpumem_exporter_kubelet_container_logs_error"))
        info.add_info({}, {"error": kubelet.logs_error, "folder": kubelet.logs_folder})
        yield info, True
    if kubelet.pods_api:
        yield from _reader_state(plans, "pods", kubelet.pods is not None, kubelet.pods_error)
    if kubelet.claims_api:
        yield from _reader_state(plans, "claims", kubelet.claims is not None, kubelet.claims_error)
    attribution = attribute(sample)
    if attribution is not None:
        yield from ((family, False) for family in _attribution(plans, attribution))


def _reader_state(
    plans: Plans, reader: str, answered: bool, error: str
) -> Iterator[tuple[FamilyRows, bool]]:
    """gpumem_exporter_<reader>_api_up, and _error_info where it failed: the pod reader's and
    the claim reader's state."""
    up = plans.new(catalog.family(f"gpumem_exporter_{reader}_api_up"))
    up.add({}, 1.0 if answered else 0.0)
    yield up, True
    if error:
        info = plans.new(catalog.family(f"gpumem_exporter_{reader}_api_error"))
        info.add_info({}, {"error": error})
        yield info, True


def _attribution(plans: Plans, attribution: Attribution) -> list[FamilyRows]:
    """Which pod holds each GPU and process, and the memory no pod owns."""
    new = plans.new
    gpu_pods = new(catalog.family("gpu_pod_info"))
    for row in attribution.gpu_pods:
        gpu_pods.add(vars(row), 1.0)
    instances = new(catalog.family("gpu_pod_mig_instance"))
    for placed in attribution.gpu_pod_instances:
        instances.add_info(vars(placed), {})
    claims = new(catalog.family("gpu_dra_claim_info"))
    for claim in attribution.dra_claims:
        claims.add(vars(claim), 1.0)
    claimed = new(catalog.family("gpu_dra_claim_memory_claimed_bytes"))
    claim_used = new(catalog.family("gpu_dra_claim_memory_used_bytes"))
    for share in attribution.claim_memory:
        labels = {
            "gpu": share.gpu_index,
            "gpu_uuid": share.gpu_uuid,
            "claim_namespace": share.claim_namespace,
            "claim": share.claim,
            "share_id": share.share_id,
        }
        claimed.add(labels, share.claimed_bytes)
        if share.used_bytes is not None:
            claim_used.add(labels, share.used_bytes)
    containers = new(catalog.family("gpu_process_container_info"))
    named = new(catalog.family("gpu_process_pod_info"))
    for process in attribution.process_pods:
        containers.add(vars(process), 1.0)
        if process.pod:
            named.add(vars(process), 1.0)
    by_container = new(catalog.family("gpu_container_memory_used_bytes"))
    for (index, uuid, namespace, pod, container), used in sorted(
        attribution.container_memory.items()
    ):
        labels = {"gpu": index, "gpu_uuid": uuid, "namespace": namespace, "pod": pod}
        by_container.add({**labels, "container": container}, used)
    return [
        gpu_pods,
        instances,
        claims,
        claimed,
        claim_used,
        containers,
        named,
        by_container,
        *_unattributed(plans, attribution),
    ]


def _unattributed(plans: Plans, attribution: Attribution) -> list[FamilyRows]:
    """The memory no pod owns: per GPU, per MIG instance, per process (with why)."""
    per_gpu = plans.new(catalog.family("gpu_memory_unattributed_bytes"))
    for uuid, (index, value) in sorted(attribution.unattributed_gpus.items()):
        per_gpu.add({"gpu": index, "gpu_uuid": uuid}, value)
    per_instance = plans.new(catalog.family("gpu_mig_memory_unattributed_bytes"))
    for (uuid, instance), (index, value) in sorted(attribution.unattributed_instances.items()):
        per_instance.add({"gpu": index, "gpu_uuid": uuid, "gpu_instance": instance}, value)
    per_process = plans.new(catalog.family("gpu_process_memory_unattributed_bytes"))
    for entry in attribution.unattributed_processes:
        labels = {
            "gpu": entry.gpu_index,
            "gpu_uuid": entry.gpu_uuid,
            "pid": entry.pid,
            "reason": entry.reason,
        }
        per_process.add(labels, entry.used_bytes)
    return [per_gpu, per_instance, per_process]
