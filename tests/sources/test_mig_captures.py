"""The NVML double of MIG machines (tests/support/mig_nvml.py) against the real `nvidia-smi`
captures it is made from (tests/data/captures/nvidia-smi): every number it answers is the
capture's, read again here from other sections than the ones it was built from (the default
table, the per-process CSV), and the facts the captures show hold in it."""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from typing import Any

import pytest

from exporter.sample import Sample
from exporter.sources.nvml import NvmlSource, gpu_instance_profile
from tests.support.mig_nvml import NOT_AVAILABLE, CapturedNvml
from tests.support.nvidia_smi_capture import CAPTURES, FILES, MIB, read, sections

MACHINES = tuple(FILES)
STATES = ("idle", "load")
# The default table's rows: a MIG device (GPU, GI, CI, MIG dev, used / total) and a process
# (GPU, GI, CI, PID, type, name, usage).
_TABLE_MIG = re.compile(r"^\|\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\|\s+(\d+)MiB /\s+(\d+)MiB")
_TABLE_PROCESS = re.compile(
    r"^\|\s+(\d+)\s+(\d+|N/A)\s+(\d+|N/A)\s+(\d+)\s+C\s+\S.*?\s(\d+)MiB \|$"
)
_TABLE_GPU = re.compile(r"\|\s+(\d+)MiB /\s+(\d+)MiB \|")


def table(machine: str, state: str) -> dict[str, list[tuple[int, ...]]]:
    """The default `nvidia-smi` table of a capture: the GPU's used/total, the MIG devices,
    the processes (None for N/A instance IDs)."""
    lines = sections(CAPTURES / FILES[machine])[(state, "nvidia-smi (default table)")]
    found: dict[str, list[tuple[int, ...]]] = defaultdict(list)
    for line in lines:
        if (mig := _TABLE_MIG.match(line)) is not None:
            found["mig"].append(tuple(int(x) for x in mig.groups()))
        elif (process := _TABLE_PROCESS.match(line)) is not None:
            found["processes"].append(
                tuple(None if x == "N/A" else int(x) for x in process.groups())  # type: ignore[misc]
            )
        elif (gpu := _TABLE_GPU.search(line)) is not None and not found["gpu"]:
            found["gpu"].append((int(gpu.group(1)), int(gpu.group(2))))
    return found


def compute_apps(machine: str, state: str) -> list[tuple[str, int, int]]:
    """(GPU UUID, PID, MiB) of the `--query-compute-apps` CSV."""
    lines = sections(CAPTURES / FILES[machine])[(state, "query-compute-apps (per-process)")]
    rows = []
    for line in lines[1:]:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 8:
            rows.append((cells[4], int(cells[5]), int(cells[7].split()[0])))
    return rows


def mig_devices(nvml: CapturedNvml, parent: Any) -> list[Any]:
    found = []
    for index in range(nvml.nvmlDeviceGetMaxMigDeviceCount(parent)):
        try:
            found.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, index))
        except nvml.NVMLError_NotFound:
            continue
    return found


def test_the_captures_here_are_the_ones_recorded_unchanged():
    """SHA256SUMS was written beside the captures when they were checked equal, byte for
    byte, to the workplace's shared captures they were copied from: an edit to a capture (a
    number made to fit) fails here."""
    sums = {}
    for line in (CAPTURES / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        sums[name] = digest
    assert sorted(sums) == sorted([*FILES.values(), "LICENSE", "README.md"])
    for name, digest in sums.items():
        assert hashlib.sha256((CAPTURES / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("machine", MACHINES)
def test_every_number_the_double_answers_is_the_captures(machine, state):
    nvml = CapturedNvml(machine, state)
    rows = table(machine, state)
    parent = nvml.nvmlDeviceGetHandleByIndex(0)
    memory = nvml.nvmlDeviceGetMemoryInfo(parent, version=nvml.nvmlMemory_v2)
    assert (memory.used // MIB, memory.total // MIB) == rows["gpu"][0]
    # nvidia-smi rounds each to a MiB: they add up to within one
    assert abs(memory.total - (memory.reserved + memory.used + memory.free)) <= MIB
    v1 = nvml.nvmlDeviceGetMemoryInfo(parent)
    assert v1.used == memory.used + memory.reserved and v1.total == memory.total

    migs = mig_devices(nvml, parent)
    served = []
    for mig in migs:
        info = nvml.nvmlDeviceGetMemoryInfo(mig, version=nvml.nvmlMemory_v2)
        gpu_instance = nvml.nvmlDeviceGetGpuInstanceId(mig)
        compute_instance = nvml.nvmlDeviceGetComputeInstanceId(mig)
        served.append(
            (0, gpu_instance, compute_instance, mig.index, info.used // MIB, info.total // MIB)
        )
    assert served == rows["mig"]
    assert (nvml.nvmlDeviceGetMigMode(parent)[0] == 1) == bool(rows["mig"])

    processes = nvml.nvmlDeviceGetComputeRunningProcesses(parent)
    listed = [
        (0, *(None if i == NOT_AVAILABLE else i for i in (p.gpuInstanceId, p.computeInstanceId)),
         p.pid, p.usedGpuMemory // MIB)
        for p in processes
    ]  # fmt: skip
    assert listed == rows["processes"]
    uuid = nvml.nvmlDeviceGetUUID(parent)
    assert [(uuid, p.pid, p.usedGpuMemory // MIB) for p in processes] == compute_apps(
        machine, state
    )


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("machine", ["h100-mig", "h200-mig"])
def test_memory_belongs_to_the_gpu_instance_and_sums_to_the_whole_gpu(machine, state):
    """Compute instances of one GPU instance report its memory, each; summed per GPU
    instance the whole GPU's used is within 1 MiB under load (2 MiB idle: 61 against 59 on
    the H100, 57 against 55 on the H200), summed per MIG device it is not."""
    nvml = CapturedNvml(machine, state)
    parent = nvml.nvmlDeviceGetHandleByIndex(0)
    whole = nvml.nvmlDeviceGetMemoryInfo(parent, version=nvml.nvmlMemory_v2).used
    by_instance: dict[int, set[int]] = defaultdict(set)
    per_device = 0
    for mig in mig_devices(nvml, parent):
        used = nvml.nvmlDeviceGetMemoryInfo(mig, version=nvml.nvmlMemory_v2).used
        by_instance[nvml.nvmlDeviceGetGpuInstanceId(mig)].add(used)
        per_device += used
    assert all(len(values) == 1 for values in by_instance.values()), by_instance
    per_instance = sum(next(iter(values)) for values in by_instance.values())
    assert abs(per_instance - whole) <= (MIB if state == "load" else 2 * MIB)
    shared = [gi for gi, values in by_instance.items() if len(values) == 1]
    if machine == "h200-mig":  # two compute instances in GPU instance 2
        assert per_device - per_instance == next(iter(by_instance[2]))
        assert gpu_instance_profile("1c.3g.71gb") == gpu_instance_profile("2c.3g.71gb")
    # GPU instance IDs come from placement, not 0..n.
    assert sorted(by_instance) != list(range(len(by_instance))), shared


def test_each_gpu_instance_holds_memory_no_process_owns():
    nvml = CapturedNvml("h100-mig", "load")
    parent = nvml.nvmlDeviceGetHandleByIndex(0)
    owned: dict[int, int] = defaultdict(int)
    for p in nvml.nvmlDeviceGetComputeRunningProcesses(parent):
        owned[p.gpuInstanceId] += p.usedGpuMemory
    for mig in mig_devices(nvml, parent):
        instance = nvml.nvmlDeviceGetGpuInstanceId(mig)
        used = nvml.nvmlDeviceGetMemoryInfo(mig, version=nvml.nvmlMemory_v2).used
        assert used > owned[instance]  # a context's and the instance's own memory


@pytest.mark.parametrize("machine", ["h100-mig", "h200-mig"])
def test_a_mig_devices_processes_are_those_of_its_instances(machine):
    """As the default table places them: on the H200 all three run in compute instance 1 of
    GPU instance 2, so MIG device 0 (compute instance 0 of the same GPU instance) has none."""
    nvml = CapturedNvml(machine, "load")
    parent = nvml.nvmlDeviceGetHandleByIndex(0)
    rows = table(machine, "load")["processes"]
    for mig in mig_devices(nvml, parent):
        where = (nvml.nvmlDeviceGetGpuInstanceId(mig), nvml.nvmlDeviceGetComputeInstanceId(mig))
        listed = [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(mig)]
        assert listed == [pid for _, gi, ci, pid, _ in rows if (gi, ci) == where], where


def test_profiles_and_sizes_come_from_the_capture_not_the_names():
    """A 1g.10gb instance is 9984 MiB, a 3g.40gb 40448: below what the names say."""
    nvml = CapturedNvml("h100-mig", "idle")
    parent = nvml.nvmlDeviceGetHandleByIndex(0)
    for mig in mig_devices(nvml, parent):
        name = nvml.nvmlDeviceGetName(mig)
        profile = name.rpartition(" MIG ")[2]
        nominal_gb = int(profile.split(".")[-1].removesuffix("gb"))
        total = nvml.nvmlDeviceGetMemoryInfo(mig).total
        assert total < nominal_gb * 1024 * MIB, (profile, total // MIB)


def test_in_a_slice_the_parent_refuses_its_memory_and_only_the_slice_answers():
    nvml = CapturedNvml("h100-mig", "load", in_slice=1)
    parent = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(nvml.NVMLError_NoPermission):
        nvml.nvmlDeviceGetMemoryInfo(parent, version=nvml.nvmlMemory_v2)
    [mig] = mig_devices(nvml, parent)
    assert nvml.nvmlDeviceGetGpuInstanceId(mig) == 3
    info = nvml.nvmlDeviceGetMemoryInfo(mig, version=nvml.nvmlMemory_v2)
    assert (info.used, info.total) == (17 * MIB, 20096 * MIB)  # -q's MIG device 1


def test_empty_slots_are_not_found_as_nvml_answers_them():
    nvml = CapturedNvml("h200-mig", "idle", empty_slots=2)
    parent = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(parent) == 7
    assert len(mig_devices(nvml, parent)) == 5
    with pytest.raises(nvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 6)


@pytest.mark.parametrize("machine", ["h100-mig", "h200-mig"])
def test_the_whole_gpus_series_stay_exact_on_a_mig_node(machine):
    """What the NVML source reads today on a MIG node: the whole GPU's memory as the capture
    has it, its processes, and the MIG devices' UUIDs that device plugins name."""
    nvml = CapturedNvml(machine, "load")
    [gpu] = read(machine, "load")
    reading = NvmlSource(nvml).read()
    [served] = reading.gpus
    assert served.used_bytes == gpu.memory.used * MIB
    assert served.total_bytes == gpu.memory.total * MIB
    assert served.free_bytes == gpu.memory.free * MIB
    assert served.driver_reserved_bytes == gpu.memory.reserved * MIB
    assert served.mig_uuids == [m.uuid for m in gpu.mig_devices]
    assert [(p.pid, p.used_bytes) for p in reading.processes] == [
        (p.pid, p.used_mib * MIB) for p in gpu.processes
    ]


def _served(
    machine: str, state: str, in_slice: int | None = None
) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The node daemon's /metrics over a capture: family -> [(labels, value)]."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tests.helpers import catalog_collector, mig_node_sample

    registry = CollectorRegistry()
    registry.register(
        catalog_collector(mig_node_sample(machine, state, in_slice), "node", {}, False)
    )
    text = generate_latest(registry).decode()
    found: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for row in family.samples:
            found[row.name].append((row.labels, row.value))
    return found


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("machine", ["h100-mig", "h200-mig"])
def test_the_node_daemon_serves_each_gpu_instance_once_as_the_capture_has_it(machine, state):
    served = _served(machine, state)
    [gpu] = read(machine, state)
    instances = {m.gpu_instance_id: m for m in gpu.mig_devices}  # one per GPU instance
    for name, field_ in (("used", "used"), ("total", "total"), ("free", "free")):
        rows = {
            int(labels["gpu_instance"]): (labels["profile"], value)
            for labels, value in served[f"gpu_mig_memory_{name}_bytes"]
        }
        assert len(served[f"gpu_mig_memory_{name}_bytes"]) == len(instances)
        assert rows == {
            gi: (gpu_instance_profile(f"x MIG {m.profile}"), getattr(m.memory, field_) * MIB)
            for gi, m in instances.items()
        }
    # Counted once, the instances add up to the whole GPU (within nvidia-smi's rounding).
    whole = {v for labels, v in served["gpu_memory_used_bytes"]}
    used = sum(v for _, v in served["gpu_mig_memory_used_bytes"])
    assert abs(used - whole.pop()) <= 2 * MIB
    # Memory no process owns, per instance: its used minus its processes'.
    owned: dict[int, int] = defaultdict(int)
    for p in gpu.processes:
        assert p.gpu_instance_id is not None
        owned[p.gpu_instance_id] += p.used_mib * MIB
    non_process = {
        int(labels["gpu_instance"]): value
        for labels, value in served["gpu_mig_non_process_memory_bytes"]
    }
    assert non_process == {gi: m.memory.used * MIB - owned[gi] for gi, m in instances.items()}
    if (machine, state) == ("h100-mig", "load"):
        assert non_process[2] == 39 * MIB  # 11091 MiB used, 11052 by its three processes
    # Every MIG device is named with the GPU instance whose memory it shares.
    info = served["gpu_mig_device_info"]
    devices = {labels["mig_uuid"]: int(labels["gpu_instance"]) for labels, _ in info}
    assert devices == {m.uuid: m.gpu_instance_id for m in gpu.mig_devices}


def test_without_mig_no_instance_series():
    served = _served("h100", "load")
    assert not [name for name in served if name.startswith("gpu_mig_")]
    assert served["gpu_memory_used_bytes"]


def test_inside_a_slice_the_whole_gpus_memory_is_absent_with_its_reason_never_zero(caplog):
    """A container given MIG device 1 of the H100 (GPU instance 3, 2g.20gb): NVML refuses
    the whole GPU's memory. Its series are absent, the GPU is not "down", the reason is on
    /metrics and in one log line, and the slice's own instance is served exactly."""
    import logging

    with caplog.at_level(logging.INFO, logger="exporter.sources.nvml"):
        served = _served("h100-mig", "load", in_slice=1)
    for name in ("used", "total", "free"):
        assert served[f"gpu_memory_{name}_bytes"] == []
    assert [v for _, v in served["gpu_up"]] == [1.0]
    [(labels, _)] = served["gpu_memory_unavailable_info"]
    assert "refused" in labels["reason"] and "MIG-00000001" in labels["reason"]
    assert [(r.levelname, "refused" in r.getMessage()) for r in caplog.records] == [("INFO", True)]
    [(labels, used)] = served["gpu_mig_memory_used_bytes"]
    assert (labels["gpu_instance"], labels["profile"], used) == ("3", "2g.20gb", 17 * MIB)
    [(labels, total)] = served["gpu_mig_memory_total_bytes"]
    assert total == 20096 * MIB


def test_a_mig_device_the_kubelet_assigned_names_its_pod_with_its_gpu_instance():
    """By the device plugin's MIG-<uuid> and by the form before R470 (MIG-GPU-<uuid>/gi/ci):
    each pod is joined to its own GPU instance's memory, not the whole GPU's."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tests.helpers import catalog_collector, mig_node_shaped

    registry = CollectorRegistry()
    registry.register(catalog_collector(mig_node_shaped(), "node", {}, False))
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
    }
    rows = {
        s.labels["pod"]: (s.labels["gpu_instance"], s.labels["device_id"])
        for s in families["gpu_pod_mig_instance_info"].samples
    }
    [gpu] = read("h100-mig", "load")
    assert rows == {
        "llama-0": ("2", gpu.mig_devices[0].uuid),
        "embed-0": ("3", f"MIG-{gpu.uuid}/3/0"),
    }
    used = {
        s.labels["gpu_instance"]: s.value for s in families["gpu_mig_memory_used_bytes"].samples
    }
    assert used["2"] == 11091 * MIB and used["3"] == 17 * MIB  # what each pod's instance holds


def test_a_gpu_instance_that_vanishes_is_read_again_never_served_stale(caplog):
    """MIG reconfigured while the daemon runs: the destroyed instance's handle answers
    NOT_FOUND. That tick serves no number for it (and says so once); the next reads the GPU's
    MIG devices again and serves what is there."""
    import logging

    nvml = CapturedNvml("h100-mig", "load")
    source = NvmlSource(nvml)
    assert [i.gpu_instance_id for i in source.read().mig_instances] == [2, 3, 9, 10]
    gpu = nvml.gpus[0]
    [gone] = [m.uuid for m in gpu.mig_devices if m.gpu_instance_id == 9]
    gpu.mig_devices = [m for m in gpu.mig_devices if m.gpu_instance_id != 9]
    with caplog.at_level(logging.INFO, logger="exporter.sources.nvml"):
        during = {i.gpu_instance_id: i.used_bytes for i in source.read().mig_instances}
    assert during[9] is None and during[2] == 11091 * MIB
    assert len([r for r in caplog.records if "instance 9" in r.getMessage()]) == 1
    after = source.read()
    assert [i.gpu_instance_id for i in after.mig_instances] == [2, 3, 10]
    assert gone not in [u for i in after.mig_instances for u in i.mig_uuids]
    assert len(after.gpus[0].mig_uuids) == 3


def test_empty_slots_and_a_pending_mig_mode_are_states_not_errors(caplog):
    import logging

    nvml = CapturedNvml("h200-mig", "load", empty_slots=2)  # NVML's NOT_FOUND slots
    assert len(NvmlSource(nvml).read().mig_instances) == 4
    off = CapturedNvml("h100", "idle")
    off.gpus[0].mig_pending = True  # `nvidia-smi -mig 1` before the reset
    with caplog.at_level(logging.INFO, logger="exporter.sources.nvml"):
        reading = NvmlSource(off).read()
    [gpu] = reading.gpus
    assert (gpu.mig_mode, gpu.mig_mode_pending, reading.mig_instances) == (
        "disabled",
        "enabled",
        [],
    )
    assert len([r for r in caplog.records if "pending" in r.getMessage()]) == 1
    from prometheus_client import CollectorRegistry, generate_latest

    from tests.helpers import catalog_collector

    registry = CollectorRegistry()
    sample = Sample(timestamp=1.0, **reading.parts())
    registry.register(catalog_collector(sample, "node", {}, False))
    text = generate_latest(registry).decode()
    assert 'gpu_mig_mode_info{current="disabled",gpu="0"' in text
    assert 'pending="enabled"' in text


def test_memory_no_pod_owns_is_judged_per_gpu_instance():
    """The H100 under load: MIG device 0 (instance 2, its three processes in the pod) and
    device 1 (instance 3) given to pods; instances 9 and 10 to none."""
    from exporter.attribution import attribute
    from exporter.sample import PodDevice
    from tests.helpers import mig_node_shaped

    sample = mig_node_shaped()
    result = attribute(sample)
    assert result is not None
    uuid = sample.gpus[0].uuid
    assert result.unattributed_instances == {
        (uuid, 2): (0, 0),
        (uuid, 3): (0, 0),
        (uuid, 9): (0, 9 * MIB),
        (uuid, 10): (0, 9 * MIB),
    }
    # Instance 2 given to no pod: all of it, its processes' pod holds nothing there.
    assert sample.kubelet is not None and sample.kubelet.devices is not None
    sample.kubelet.devices = sample.kubelet.devices[1:]
    result = attribute(sample)
    assert result is not None and result.unattributed_instances[(uuid, 2)] == (0, 11091 * MIB)
    # An assignment that names the GPU, not an instance (GKE's nvidia0/gi0): not judged.
    sample.kubelet.devices.append(
        PodDevice("ml", "other", "app", "nvidia.com/mig-1g.10gb", "nvidia0/gi9")
    )
    result = attribute(sample)
    assert result is not None and result.unattributed_instances == {}


def test_each_process_is_named_with_its_gpu_instance():
    served = _served("h100-mig", "load")
    rows = {
        labels["pid"]: labels["gpu_instance"]
        for labels, _ in served["gpu_process_mig_instance_info"]
    }
    [gpu] = read("h100-mig", "load")
    assert rows == {str(p.pid): str(p.gpu_instance_id) for p in gpu.processes}
    assert not _served("h100", "load").get("gpu_process_mig_instance_info")


def test_a_dra_mig_name_is_its_gpu_instance_where_the_profile_says_which():
    """NVIDIA's DRA names (kubernetes-sigs/dra-driver-nvidia-gpu PR 852): the profile without
    dots, `+me` as `-me`, then the profile ID and the placement start, which is not the GPU
    instance ID. On the H100 capture 3g.40gb is one instance (GI 2); 1g.10gb is two (GI 9 and
    10): which one a name means is not guessed."""
    from exporter.kubernetes.device_ids import dra_profile, resolve_dra_mig_instance
    from tests.helpers import mig_node_sample

    sample = mig_node_sample("h100-mig", "load")
    sample.gpus[0].minor_number = 0  # the capture's "Minor Number : 0"
    found = resolve_dra_mig_instance(
        "gpu.nvidia.com", "gpu-0-mig-3g40gb-9-0", sample.gpus, sample.mig_instances
    )
    assert found is not None and found.gpu_instance_id == 2
    assert (
        resolve_dra_mig_instance(
            "gpu.nvidia.com", "gpu-0-mig-1g10gb-19-6", sample.gpus, sample.mig_instances
        )
        is None
    )
    assert (
        resolve_dra_mig_instance("gpu.nvidia.com", "gpu-0", sample.gpus, sample.mig_instances)
        is None
    )
    assert dra_profile("1g.24gb+me") == "1g24gb-me"
    assert dra_profile("3g.40gb") == "3g40gb"


def test_a_claims_mig_device_is_attributed_to_its_gpu_instance():
    from exporter.attribution import attribute
    from exporter.sample import PodDevice
    from tests.helpers import mig_node_shaped

    sample = mig_node_shaped()
    sample.gpus[0].minor_number = 0
    assert sample.kubelet is not None and sample.kubelet.devices is not None
    sample.kubelet.devices = [
        PodDevice(
            "batch", "job-0", "main", "gpu.nvidia.com", "gpu-0-mig-2g20gb-14-4",
            claim="job-0-gpu", claim_namespace="batch", pool="gpu-node-1",
        )
    ]  # fmt: skip
    result = attribute(sample)
    assert result is not None
    assert [(p.pod, p.gpu_instance) for p in result.gpu_pod_instances] == [("job-0", 3)]
