"""The GPUs as NVML reads them: each one's memory, state and identity, the processes using
it, and its MIG instances."""

from __future__ import annotations

from collections.abc import Iterator

from exporter import catalog
from exporter.fill.render import Render
from exporter.fill.rows import FamilyRows, Filled, Labels, Plans
from exporter.sample import Sample

_GPU_MEMORY = catalog.group("gpu_memory")
_MIG_MEMORY = catalog.group("gpu_mig_memory")


def families(render: Render, sample: Sample) -> Filled:
    if not sample.gpus:
        return []
    found = [(family, False) for family in _gpus(render.plans, sample)]
    if sample.mig_instances:
        found += [(family, False) for family in _mig(render.plans, sample)]
    return found


def _gpus(plans: Plans, sample: Sample) -> list[FamilyRows]:
    new = plans.new
    memory = {entry.key: new(entry) for entry in _GPU_MEMORY}
    up = new(catalog.family("gpu_up"))
    info = new(catalog.family("gpu"))
    refused = new(catalog.family("gpu_memory_unavailable"))
    mig_mode = new(catalog.family("gpu_mig_mode"))
    for gpu in sample.gpus:
        ids = Labels(gpu=gpu.index, gpu_uuid=gpu.uuid)
        up.add(ids, 1.0 if gpu.up else 0.0)
        if gpu.memory_unavailable:
            refused.add_info(ids, {"reason": gpu.memory_unavailable})
        if "enabled" in (gpu.mig_mode, gpu.mig_mode_pending):
            mig_mode.add_info(ids, {"current": gpu.mig_mode, "pending": gpu.mig_mode_pending})
        info.add_info(
            ids,
            {
                "name": gpu.name,
                "driver_version": gpu.driver_version,
                "pci_bus_id": gpu.pci_bus_id,
            },
        )
        for key, family in memory.items():
            value = getattr(gpu, key)
            if value is not None:
                family.add(ids, value)
    process = new(catalog.family("gpu_process_memory_used_bytes"))
    in_instance = new(catalog.family("gpu_process_mig_instance"))
    for entry in sample.processes:
        labels = {"gpu": entry.gpu_index, "gpu_uuid": entry.gpu_uuid, "pid": entry.pid}
        process.add(labels, entry.used_bytes)
        if entry.gpu_instance_id is not None:
            in_instance.add_info({**labels, "gpu_instance": entry.gpu_instance_id}, {})
    return [*memory.values(), process, up, info, refused, mig_mode, in_instance]


def _mig(plans: Plans, sample: Sample) -> Iterator[FamilyRows]:
    new = plans.new
    memory = {entry.key: new(entry) for entry in _MIG_MEMORY}
    non_process = new(catalog.family("gpu_mig_non_process_memory_bytes"))
    devices = new(catalog.family("gpu_mig_device"))
    for instance in sample.mig_instances:
        ids = Labels(
            gpu=instance.gpu_index,
            gpu_uuid=instance.gpu_uuid,
            gpu_instance=instance.gpu_instance_id,
        )
        labels = Labels(ids, profile=instance.profile)
        for key, family in memory.items():
            value = getattr(instance, key)
            if value is not None:
                family.add(labels, value)
        if instance.used_bytes is not None and instance.process_bytes is not None:
            non_process.add(labels, max(instance.used_bytes - instance.process_bytes, 0))
        for uuid in instance.mig_uuids:
            devices.add_info(Labels(ids, mig_uuid=uuid), {"profile": instance.profile})
    yield from (*memory.values(), non_process, devices)
