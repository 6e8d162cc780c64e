"""exporter.attribution: the kubelet's assignments and the processes' cgroups joined with NVML,
on samples built from the H200 NVML capture (tests/data/allocator_native.json)."""

from __future__ import annotations

import json

import pytest

from exporter.attribution import (
    Attribution,
    DraClaim,
    GpuPod,
    ProcessPod,
    UnattributedProcess,
)
from exporter.attribution import (
    attribute as attribute_or_none,
)
from exporter.kubernetes.device_ids import base_device_id, resolve_dra_gpu_uuid, resolve_gpu_uuid
from exporter.sample import (
    GpuReading,
    KubeletReading,
    PodDevice,
    ProcessContainerReading,
    ProcessGpuReading,
    Sample,
)
from tests.conftest import DATA_DIR

RAW = json.loads((DATA_DIR / "allocator_native.json").read_text())["nvml_raw"]
GPU0, GPU1 = (d["uuid"] for d in RAW["devices"])
USED0 = RAW["devices"][0]["memory_v2"]["used"]
PID = RAW["devices"][0]["processes"][0]["pid"]
PID_USED = RAW["devices"][0]["processes"][0]["usedGpuMemory"]
UID_A = "2c9f8a79-5391-454b-88cb-86190881cb96"
UID_B = "7922aa99-d4aa-4885-a953-82976860b23a"


def attribute(sample: Sample) -> Attribution:
    """exporter.attribution.attribute() of a sample that has something to attribute."""
    result = attribute_or_none(sample)
    assert result is not None
    return result


def gpus() -> list[GpuReading]:
    return [
        GpuReading(
            index=d["index"],
            uuid=d["uuid"],
            used_bytes=d["memory_v2"]["used"],
            minor_number=d["index"],
            mig_uuids=[f"MIG-{d['index']}-a", f"MIG-{d['index']}-b"],
        )
        for d in RAW["devices"]
    ]


# What the kubelet's container log links name (exporter.kubernetes.container_logs): pod UID
# -> (namespace, pod), container ID -> container.
LLAMA = {UID_A: ("serving", "llama-0")}
SERVER = {"c" * 64: "server"}


def sample(
    devices,
    processes,
    located,
    pods: dict[str, tuple[str, str]] | None = LLAMA,
    containers: dict[str, str] = SERVER,
) -> Sample:
    """`pods` None: the kubelet's links unread (off or unreadable) and no pod reader."""
    kubelet = KubeletReading(
        socket="/k.sock", up=True, devices=devices, asked_s=1.0, log_pods=pods,
        log_containers=containers, logs_folder="/var/log/containers",
    )  # fmt: skip
    return Sample(
        timestamp=0.0,
        gpus=gpus(),
        processes=processes,
        kubelet=kubelet,
        process_containers=located,
    )


def the_process(pid: int = PID, used: int = PID_USED, gpu: int = 0) -> ProcessGpuReading:
    return ProcessGpuReading(gpu, (GPU0, GPU1)[gpu], pid, used)


def in_pod(
    pid: int = PID, uid: str = UID_A, container_id: str = "c" * 64
) -> ProcessContainerReading:
    """A process in a pod's container, as its cgroup says."""
    return ProcessContainerReading(pid, "container", pod_uid=uid, container_id=container_id)


def llama(device_id: str = GPU0, pod: str = "llama-0") -> PodDevice:
    return PodDevice("serving", pod, "server", "nvidia.com/gpu", device_id)


@pytest.mark.parametrize(
    ("device_id", "expected"),
    [
        (GPU0, GPU0),
        (f"{GPU0}::3", GPU0),
        ("GPU-not-on-this-node", "GPU-not-on-this-node"),
        ("MIG-1-b", GPU1),
        ("MIG-1-b::2", GPU1),
        (f"MIG-{GPU1}/1/0", GPU1),
        ("nvidia1", GPU1),
        ("nvidia0/vgpu3", GPU0),
        ("nvidia1/gi2", GPU1),
        ("nvidia7", ""),
        ("MIG-unknown", ""),
        ("0000:3b:00.1", ""),
        # Past 9 digits no shape's number (Python's int() refuses 4,300 and more; issue 64)
        ("nvidia" + "1" * 5000, ""),
        ("nvidia1/gi" + "2" * 5000, ""),
        (f"MIG-{GPU1}/" + "1" * 5000 + "/0", ""),
    ],
)
def test_device_ids_resolve_to_the_nvml_gpu(device_id, expected):
    assert resolve_gpu_uuid(device_id, gpus()) == expected


def test_replica_suffix_is_dropped():
    assert base_device_id(f"{GPU0}::12") == GPU0


def test_exclusive_gpu_names_its_process_and_leaves_nothing_unattributed():
    result = attribute(
        sample([llama(f"{GPU0}::0"), llama(f"{GPU0}::1")], [the_process()], [in_pod()])
    )
    assert result.gpu_pods == [GpuPod(GPU0, GPU0, "nvidia.com/gpu", "serving", "llama-0", "server")]
    assert result.process_pods == [ProcessPod(PID, UID_A, "c" * 64, "serving", "llama-0", "server")]
    assert result.unattributed_processes == []
    assert result.unattributed_gpus == {GPU0: (0, 0), GPU1: (1, 0)}  # GPU1: no pod, 0 used


def test_a_pod_using_a_gpu_it_does_not_hold_is_never_named_as_the_holder():
    """Pod A holds GPU 0 and runs nothing on it; a process of pod B (which holds no GPU) uses
    it. Without the pod reader its memory used to be charged to pod A (issue 38), and then
    whenever B's container wrote "llama-0" into its own /etc/hostname (round 4). Its pod UID
    is the kernel's and the kubelet's links name that UID: it is B's, not named the holder,
    and its memory is held outside the pods that hold the GPU."""
    intruder = in_pod(uid=UID_B, container_id="d" * 64)
    names = {**LLAMA, UID_B: ("ml", "notebook-3")}
    result = attribute(sample([llama()], [the_process()], [intruder], names, {"d" * 64: "nb"}))
    assert result.process_pods == [ProcessPod(PID, UID_B, "d" * 64, "ml", "notebook-3", "nb")]
    assert result.container_memory == {(0, GPU0, "ml", "notebook-3", "nb"): PID_USED}
    assert result.unattributed_processes == [
        UnattributedProcess(0, GPU0, PID, "not_assigned", PID_USED)
    ]
    assert result.unattributed_gpus[GPU0] == (0, PID_USED)
    # A pod of the holder's name in another namespace: not the holder either.
    elsewhere = {**LLAMA, UID_B: ("batch", "llama-0")}
    result = attribute(sample([llama()], [the_process()], [intruder], elsewhere, {}))
    assert [p.pod for p in result.process_pods] == [""]  # no container name: no partial name
    assert result.unattributed_processes[0].reason == "not_assigned"


def test_a_pod_uid_the_kubelets_links_do_not_name_is_no_holders():
    """A process older than the kubelet's answer, in a pod UID its links (read after that
    answer) do not name: no pod the kubelet started, so not the holder's memory."""
    stranger = in_pod(uid=UID_B)
    result = attribute(sample([llama()], [the_process()], [stranger]))
    assert result.process_pods == [ProcessPod(PID, UID_B, "c" * 64)]
    assert result.unattributed_processes[0].reason == "not_assigned"
    # The pod reader's list alone may be older than the pod: not judged from it.
    s = sample([llama()], [the_process()], [stranger], pods=None)
    assert s.kubelet is not None
    s.kubelet.pods = dict(LLAMA)
    assert attribute(s).unattributed_processes == []


def test_without_the_kubelets_names_a_process_keeps_its_uid_and_is_not_judged():
    """The links unreadable and no pod reader: the pod UID alone; nothing is counted outside
    the pods (it may be the holder's). gpumem_exporter_kubelet_container_logs_error_info
    says why."""
    result = attribute(sample([llama()], [the_process()], [in_pod()], pods=None))
    assert [(p.pod_uid, p.pod) for p in result.process_pods] == [(UID_A, "")]
    assert result.unattributed_processes == []
    assert result.unattributed_gpus[GPU0] == (0, 0)


def test_a_process_in_no_container_is_held_outside_any_pod():
    located = [ProcessContainerReading(PID, "no_container")]
    result = attribute(sample([llama()], [the_process()], located))
    assert result.unattributed_processes == [UnattributedProcess(0, GPU0, PID, "no_pod", PID_USED)]
    assert result.unattributed_gpus[GPU0] == (0, PID_USED)
    assert result.process_pods == []


def test_a_container_of_no_pod_is_outside_any_pod():
    located = [ProcessContainerReading(PID, "container", container_id="d" * 64)]
    result = attribute(sample([llama()], [the_process()], located))
    assert result.unattributed_processes[0].reason == "no_pod"


def test_a_gpu_no_pod_holds_is_unattributed_whole():
    result = attribute(sample([llama("GPU-elsewhere")], [the_process()], [in_pod()]))
    assert result.unattributed_gpus[GPU0] == (0, USED0)
    assert result.unattributed_processes == [
        UnattributedProcess(0, GPU0, PID, "not_assigned", PID_USED)
    ]
    # The assignment is still published, though NVML does not see that GPU.
    assert result.gpu_pods[0].gpu_uuid == "GPU-elsewhere"
    # Its own pod is named all the same: by its UID, not by what holds the GPU.
    assert result.process_pods == [ProcessPod(PID, UID_A, "c" * 64, "serving", "llama-0", "server")]


def test_an_unreadable_process_is_listed_as_unknown_and_not_counted():
    located = [ProcessContainerReading(PID, "unknown", detail="process gone")]
    result = attribute(sample([llama()], [the_process()], located))
    assert result.unattributed_processes[0].reason == "unknown"
    assert result.unattributed_gpus[GPU0] == (0, 0)


def test_a_shared_gpu_names_each_process_by_its_own_pod():
    devices = [llama(f"{GPU0}::0"), llama(f"{GPU0}::1", pod="llama-1")]
    processes = [the_process(), the_process(pid=PID + 1, used=1 << 30)]
    located = [in_pod(), in_pod(PID + 1, UID_B, "d" * 64)]
    names = {**LLAMA, UID_B: ("serving", "llama-1")}
    result = attribute(sample(devices, processes, located, names, {**SERVER, "d" * 64: "server"}))
    assert {(p.pod_uid, p.pod) for p in result.process_pods} == {
        (UID_A, "llama-0"),
        (UID_B, "llama-1"),
    }
    assert result.unattributed_gpus[GPU0] == (0, 0)
    # Without names: pod UIDs only, nothing counted outside the pods.
    result = attribute(sample(devices, processes, located, pods=None))
    assert {p.pod for p in result.process_pods} == {""}
    assert {p.pod_uid for p in result.process_pods} == {UID_A, UID_B}
    assert result.unattributed_gpus[GPU0] == (0, 0)


def test_two_pods_on_an_exclusive_gpu_are_each_their_own():
    processes = [the_process(), the_process(pid=PID + 1, used=1 << 30)]
    located = [in_pod(), in_pod(PID + 1, UID_B, "d" * 64)]
    names = {**LLAMA, UID_B: ("ml", "notebook-3")}
    result = attribute(sample([llama()], processes, located, names, {**SERVER, "d" * 64: "nb"}))
    assert [p.pod for p in result.process_pods] == ["llama-0", "notebook-3"]
    assert [(p.pid, p.reason) for p in result.unattributed_processes] == [(PID + 1, "not_assigned")]


def test_no_assignment_known_yet_judges_nothing():
    s = sample(None, [the_process()], [ProcessContainerReading(PID, "no_container")])
    result = attribute(s)
    assert result.gpu_pods == [] and result.unattributed_gpus == {}
    assert result.unattributed_processes == []


def test_no_kubelet_view_is_no_attribution():
    assert attribute_or_none(Sample(timestamp=0.0, gpus=gpus())) is None


def test_a_lost_gpu_is_not_judged():
    s = sample([], [], [])
    s.gpus[1].up = False
    assert GPU1 not in attribute(s).unattributed_gpus


def test_a_process_newer_than_the_kubelets_answer_is_pending_never_named():
    """The GPU moved from llama-0 to another pod; the kubelet's latest answer (asked at 1.0)
    still says llama-0, and a process of the new pod appears at 2.0 (issue 38: it was named
    llama-0 for ~0.8 s, and for as long as the kubelet was down). Its pod is newer than the
    links read with that answer: it keeps its pod UID alone, is listed "pending" and not
    counted."""
    newcomer = in_pod(uid=UID_B)
    newcomer.first_seen_s = 2.0
    result = attribute(sample([llama()], [the_process()], [newcomer]))
    assert result.process_pods == [ProcessPod(PID, UID_B, "c" * 64)]
    assert result.container_memory == {}
    assert result.unattributed_processes == [UnattributedProcess(0, GPU0, PID, "pending", PID_USED)]
    assert result.unattributed_gpus[GPU0] == (0, 0)  # not counted: its pod may hold the GPU
    # Once a List asked after it answers, it is judged as any other (its links read then).
    s = sample([llama()], [the_process()], [newcomer], {**LLAMA, UID_B: ("serving", "llama-0")})
    assert s.kubelet is not None
    s.kubelet.asked_s = 2.5
    assert attribute(s).unattributed_processes == []
    # A StatefulSet's pod recreated under the same name (another UID), its links read but
    # the assignment older than it: named by its own UID, judged by no older answer.
    s.kubelet.asked_s = 1.0
    result = attribute(s)
    assert [p.pod for p in result.process_pods] == ["llama-0"]
    assert result.unattributed_processes[0].reason == "pending"


def test_a_pending_process_still_counts_where_no_pod_could_hold_it():
    """A host process is outside every pod whatever the kubelet says: never pending."""
    host = ProcessContainerReading(PID, "no_container", first_seen_s=2.0)
    result = attribute(sample([llama()], [the_process()], [host]))
    assert result.unattributed_processes[0].reason == "no_pod"


def claimed(device: str, pod: str = "notebook-1", share_id: str = "") -> PodDevice:
    """A device a ResourceClaim gave a container, as the kubelet reports DRA devices."""
    return PodDevice(
        "research", pod, "jupyter", "gpu.nvidia.com", device,
        claim=f"{pod}-gpu", claim_namespace="research", pool="gpu-node-1", share_id=share_id,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("driver", "device", "expected"),
    [
        ("gpu.nvidia.com", "gpu-0", GPU0),
        ("gpu.nvidia.com", "gpu-1", GPU1),
        # A MIG device of NVIDIA's driver: gpu-<parent minor>-mig-<profile>-<id>-<start>.
        ("gpu.nvidia.com", "gpu-1-mig-1g10gb-19-0", GPU1),
        ("gpu.nvidia.com", "gpu-7", ""),  # no GPU has that minor
        ("gpu.nvidia.com", "gpu0", ""),  # a shape NVIDIA's driver does not write
        ("gpu.example.com", "gpu-0", ""),  # another driver's names are never guessed
        ("gpu.nvidia.com", "gpu-" + "1" * 5000, ""),  # no minor has 5,000 digits (issue 64)
    ],
)
def test_dra_device_names_resolve_through_the_minor_number(driver, device, expected):
    assert resolve_dra_gpu_uuid(driver, device, gpus()) == expected


def test_a_dra_device_is_named_by_minor_not_index():
    """On this node GPU index 0 is /dev/nvidia1: NVIDIA's DRA driver calls it gpu-1."""
    swapped = gpus()
    swapped[0].minor_number, swapped[1].minor_number = 1, 0
    assert resolve_dra_gpu_uuid("gpu.nvidia.com", "gpu-1", swapped) == GPU0


def test_a_gpu_a_claim_gave_is_attributed_like_a_device_plugins():
    """The GPU's gpu_pod_info row is the same shape (resource: the driver, device_id: the
    DRA device), its process is named, nothing is unattributed; the claim is published."""
    notebook = {UID_A: ("research", "notebook-1")}
    result = attribute(sample([claimed("gpu-0")], [the_process()], [in_pod()], notebook))
    assert result.gpu_pods == [
        GpuPod(GPU0, "gpu-0", "gpu.nvidia.com", "research", "notebook-1", "jupyter")
    ]
    assert [p.pod for p in result.process_pods] == ["notebook-1"]
    assert result.unattributed_processes == [] and result.unattributed_gpus[GPU0] == (0, 0)
    assert result.dra_claims == [
        DraClaim(GPU0, "research", "notebook-1", "jupyter", "notebook-1-gpu", "research",
                 "gpu.nvidia.com", "gpu-node-1", "gpu-0", "")
    ]  # fmt: skip


def test_a_node_of_device_plugin_and_dra_gpus_and_a_gpu_in_no_claim():
    """GPU 0 by the device plugin, GPU 1 by a claim; then the claim goes: GPU 1 is held by no
    pod and its memory unattributed."""
    processes = [the_process(), the_process(pid=PID + 1, used=1 << 30, gpu=1)]
    located = [in_pod(), in_pod(PID + 1, UID_B)]
    names = {**LLAMA, UID_B: ("research", "notebook-1")}
    result = attribute(sample([llama(), claimed("gpu-1")], processes, located, names))
    assert {(p.gpu_uuid, p.pod) for p in result.gpu_pods} == {
        (GPU0, "llama-0"),
        (GPU1, "notebook-1"),
    }
    assert sorted(p.pod for p in result.process_pods) == ["llama-0", "notebook-1"]
    assert result.unattributed_gpus == {GPU0: (0, 0), GPU1: (1, 0)}
    result = attribute(sample([llama()], processes, located, names))
    assert result.unattributed_gpus[GPU1] == (1, gpus()[1].used_bytes)


def test_two_claims_sharing_one_gpu_keep_pod_uids_only_without_names():
    """Consumable capacity: two claims share GPU 0 (share_id each). Like time-slicing, a
    process is not named without names, and nothing is counted outside the pods."""
    devices = [claimed("gpu-0", "notebook-1", "a1"), claimed("gpu-0", "notebook-2", "b2")]
    processes = [the_process(), the_process(pid=PID + 1, used=1 << 30)]
    located = [in_pod(), in_pod(PID + 1, UID_B)]
    result = attribute(sample(devices, processes, located, pods=None))
    assert {p.pod for p in result.process_pods} == {""}
    assert result.unattributed_gpus[GPU0] == (0, 0)
    assert sorted(c.share_id for c in result.dra_claims) == ["a1", "b2"]


def test_a_dra_device_that_resolves_to_no_gpu_names_no_pod_and_says_so_once(caplog, monkeypatch):
    """Round 4, LOW 17: such a row carried its pod with gpu_uuid="" and nothing said why; issue
    51: it names no pod anywhere (no gpu_pod_info, no gpu_dra_claim_info row), one log line."""
    import exporter.attribution
    from exporter.ratelimit import RateLimitedLog

    fresh = RateLimitedLog(exporter.attribution.log, every_s=600.0)
    monkeypatch.setattr(exporter.attribution, "_unresolved", fresh)  # not another test's
    result = attribute(sample([claimed("gpu-9")], [], []))
    said = [r.getMessage() for r in caplog.records if "gpu-9" in r.getMessage()]
    assert len(said) == 1 and "research/notebook-1" in said[0]
    attribute(sample([claimed("gpu-9")], [], []))  # every render: said once
    assert len([r for r in caplog.records if "gpu-9" in r.getMessage()]) == 1
    assert result.gpu_pods == [] and result.dra_claims == []
