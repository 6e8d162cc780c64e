"""Device IDs as device plugins write them, resolved to the NVML GPU they are on.

The NVIDIA device plugin writes `GPU-<uuid>` for a whole GPU, `MIG-<uuid>` for a MIG device
(`MIG-GPU-<uuid>/<gi>/<ci>` before driver R470), and appends `::<n>` for each time-slicing
replica. GKE's plugin writes `nvidia<minor>` (the /dev/nvidia<minor> node), `nvidia<minor>/vgpu<n>`
for time-sharing and `nvidia<minor>/gi<n>` for MIG. Every form is matched through what NVML
says about the GPU (UUID, MIG device UUIDs, minor number), never through an index: NVML's order
is PCI order and CUDA_VISIBLE_DEVICES renumbers.

Dynamic Resource Allocation names devices per driver. NVIDIA's DRA driver (`gpu.nvidia.com`)
names a whole GPU `gpu-<minor>` and a MIG device `gpu-<parent minor>-mig-<profile without
dots>-<profile ID>-<placement start>` (its MigSpecTuple.ToCanonicalName); both resolve
through the minor number, a MIG device to the GPU it is on. Another driver's names, or a
shape this module does not know, resolve to nothing: listed with their raw names, never
guessed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from exporter.sample import GpuReading, MigInstanceReading, PodDevice

# A number in a device's name (a device minor, a GPU instance) has at most 9 digits: longer,
# the name is not one of these shapes. (5,000 digits once passed Python's 4,300-digit limit
# of int() in the render, and every scrape of the node daemon answered 500; issue 64.)
_N = r"\d{1,9}"
_GKE = re.compile(rf"nvidia({_N})(?:/(?:gi|vgpu){_N})*")
NVIDIA_DRA_DRIVER = "gpu.nvidia.com"
_NVIDIA_DRA = re.compile(rf"gpu-({_N})(?:-mig-[0-9a-z-]+-{_N}-{_N})?")
_NVIDIA_DRA_MIG = re.compile(rf"gpu-({_N})-mig-([0-9a-z-]+)-{_N}-{_N}")
_OLD_MIG = re.compile(rf"MIG-(GPU-[0-9a-fA-F-]+)/{_N}/{_N}")
_OLD_MIG_PARTS = re.compile(rf"MIG-(GPU-[0-9a-fA-F-]+)/({_N})/{_N}")


def base_device_id(device_id: str) -> str:
    """The device without its time-slicing replica suffix (`GPU-x::3` -> `GPU-x`)."""
    return device_id.partition("::")[0]


def device_gpu_uuid(
    device: PodDevice,
    gpus: Iterable[GpuReading],
    slices: Mapping[tuple[str, str, str], str] | None = None,
) -> str:
    """The NVML UUID of the GPU an assigned device is on, by device plugin or by DRA; ""
    where nothing NVML reported matches. A DRA device whose name does not resolve here is
    looked up in this node's ResourceSlices (`slices`: (driver, pool, device) -> UUID, from
    the claim reader), and taken only where NVML reports that UUID: NVML is the truth, a
    slice that disagrees with it names nothing."""
    gpus = list(gpus)
    if not device.dynamic:
        return resolve_gpu_uuid(device.device_id, gpus)
    found = resolve_dra_gpu_uuid(device.resource, device.device_id, gpus)
    if not found and slices:
        uuid = slices.get((device.resource, device.pool, device.device_id), "")
        found = next((g.uuid for g in gpus if uuid and g.uuid == uuid), "")
    return found


def known_dra_name(driver: str, device: str) -> bool:
    """Whether resolve_dra_gpu_uuid can read this DRA device's name (else the slices may)."""
    return driver == NVIDIA_DRA_DRIVER and _NVIDIA_DRA.fullmatch(device) is not None


def resolve_dra_gpu_uuid(driver: str, device: str, gpus: Iterable[GpuReading]) -> str:
    """A DRA device's GPU, for the drivers whose names this module knows (NVIDIA's)."""
    if driver != NVIDIA_DRA_DRIVER or (named := _NVIDIA_DRA.fullmatch(device)) is None:
        return ""
    minor = int(named.group(1))
    return next((g.uuid for g in gpus if g.minor_number == minor), "")


def resolve_mig_instance(
    device_id: str, instances: Iterable[MigInstanceReading]
) -> MigInstanceReading | None:
    """The MIG GPU instance a device plugin's MIG device is in (`MIG-<uuid>`, or the form
    before R470, `MIG-GPU-<uuid>/<gi>/<ci>`), as NVML reports it; None for anything else
    (a whole GPU, GKE's and DRA's names: not guessed)."""
    base = base_device_id(device_id)
    instances = list(instances)
    if (old := _OLD_MIG_PARTS.fullmatch(base)) is not None:
        uuid, gpu_instance = old.group(1), int(old.group(2))
        return next(
            (i for i in instances if (i.gpu_uuid, i.gpu_instance_id) == (uuid, gpu_instance)),
            None,
        )
    if base.startswith("MIG-"):
        return next((i for i in instances if base in i.mig_uuids), None)
    return None


def resolve_dra_mig_instance(
    driver: str, device: str, gpus: Iterable[GpuReading], instances: Iterable[MigInstanceReading]
) -> MigInstanceReading | None:
    """The GPU instance a DRA MIG device name (`gpu-<minor>-mig-<profile>-<profile ID>-
    <placement start>`, the profile without dots and `+me` as `-me`) is, where its GPU has
    exactly one GPU instance of that profile. The placement start is not the GPU instance ID
    and NVML's placements are not read here: with two instances of one profile, None (the
    device is still attributed to its GPU)."""
    if driver != NVIDIA_DRA_DRIVER or (named := _NVIDIA_DRA_MIG.fullmatch(device)) is None:
        return None
    minor, profile = int(named.group(1)), named.group(2)
    uuid = next((g.uuid for g in gpus if g.minor_number == minor), "")
    found = [i for i in instances if i.gpu_uuid == uuid and dra_profile(i.profile) == profile]
    return found[0] if uuid and len(found) == 1 else None


def dra_profile(profile: str) -> str:
    """A MIG profile as NVIDIA's DRA driver writes it in a device name: `1g.10gb+me` ->
    `1g10gb-me`."""
    return profile.replace(".", "").replace("+", "-")


def resolve_gpu_uuid(device_id: str, gpus: Iterable[GpuReading]) -> str:
    """The NVML UUID of the GPU `device_id` is on, or "" where nothing NVML reported matches.
    A `GPU-<uuid>` ID is its own answer even where NVML cannot see that GPU: the kubelet
    assigned it, and that is worth seeing."""
    base = base_device_id(device_id)
    if base.startswith("GPU-"):
        return base
    if (old := _OLD_MIG.fullmatch(base)) is not None:
        return old.group(1)
    gpus = list(gpus)
    if base.startswith("MIG-"):
        return next((g.uuid for g in gpus if base in g.mig_uuids), "")
    if (gke := _GKE.fullmatch(base)) is not None:
        minor = int(gke.group(1))
        return next((g.uuid for g in gpus if g.minor_number == minor), "")
    return ""
