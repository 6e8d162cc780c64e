"""The plain values a sample carries from the sources to metrics, detectors and traces.

Sources fill these; nothing here reads hardware or writes metrics. Every value is optional in
the sense that a field which is not defined on a backend is left out (None or absent from a
dict) rather than reported as 0: "no fragmentation" and "fragmentation unknown" must not look
the same on a dashboard.
"""

from __future__ import annotations

import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

from exporter import catalog
from exporter.oom_verdict import OomVerdict

# The keys of the allocator's dicts below, each a metric's suffix (`torch_cuda_<key>`; counters
# without `_total`): declared with their families in exporter.catalog.
ALLOCATOR_GAUGES = catalog.keys("allocator_gauge")
ALLOCATOR_COUNTERS = catalog.keys("allocator_counter")
POOL_GAUGES = catalog.keys("pool")
# From the allocator's layout (a segments-only snapshot).
LAYOUT_GAUGES = catalog.keys("layout")
PRIVATE_POOL_GAUGES = catalog.keys("private_pool")


@dataclass
class AllocatorReading:
    """One CUDA device's caching-allocator state inside this process."""

    device: int
    gpu_uuid: str
    backend: str  # "native" or "cudaMallocAsync"
    expandable_segments: bool
    gauges: dict[str, int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    pools: dict[str, dict[str, int]] = field(default_factory=dict)  # pool -> gauges
    max_split_size_bytes: int | None = None
    # Under `gpumem-exporter run`: which process of the server this is (catalog.PROCESS_LABELS).
    process: dict[str, str] = field(default_factory=dict)
    # From the latest allocator snapshot (exporter/sources/allocator_layout.py), read at its
    # own slower cadence: LAYOUT_GAUGES by key. Empty where no snapshot exists (the
    # cudaMallocAsync backend) or it was skipped (layout_skipped says why).
    layout: dict[str, int] = field(default_factory=dict)
    layout_age_s: float | None = None  # how old `layout` is at this tick
    layout_skipped: str = ""
    # Private pools (CUDA graphs, MemPools) by pool id ("1_0"): PRIVATE_POOL_GAUGES by key.
    private_pools: dict[str, dict[str, int]] = field(default_factory=dict)
    # The allocator's live settings where torch reports them (name -> value as text).
    settings: dict[str, str] = field(default_factory=dict)
    # This process's GPU memory outside the allocator (NVML used - reserved), taken by the
    # process itself from readings that agree (exporter/sources/non_allocator.py), and how old
    # that value is at this reading. None where NVML does not list the process.
    non_allocator_bytes: int | None = None
    non_allocator_age_s: float | None = None
    # This device's latest OOM with its verdict, and OOMs counted by verdict, as the process's
    # OOM observer decided them (exporter/oom_verdict.py). None / empty before an OOM.
    last_oom: OomVerdict | None = None
    ooms_by_verdict: dict[str, int] = field(default_factory=dict)
    # What the server named its memory (exporter.components): bytes by component name, in
    # the order named; the ledger (exporter.ledger) lays them over allocated.
    components: dict[str, int] = field(default_factory=dict)
    # Each private pool's kind ("graph", "mempool") and the name the server gave it, by pool
    # id as in private_pools (exporter.pools).
    private_pool_info: dict[str, dict[str, str]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AllocatorReading:
        last_oom = data.get("last_oom")
        return cls(**{**data, "last_oom": OomVerdict.from_dict(last_oom) if last_oom else None})

    @property
    def fragmentation_ratio(self) -> float | None:
        """inactive_split / reserved, only where the allocator defines inactive_split."""
        inactive = self.gauges.get("inactive_split_bytes")
        reserved = self.gauges.get("reserved_bytes", 0)
        if inactive is None or reserved <= 0:
            return None
        return inactive / reserved

    @property
    def largest_free_block_share(self) -> float | None:
        """largest free block / free bytes of the default pool: near 1 when the free cache
        is one piece, near 0 when it is shattered (a big request will need a new cudaMalloc
        or fail although the cache holds enough in total). None without a layout."""
        largest = self.layout.get("largest_free_block_bytes")
        free = self.layout.get("default_pool_free_bytes", 0)
        if largest is None or free <= 0:
            return None
        return largest / free

    @property
    def cached_free_bytes(self) -> int | None:
        """reserved - allocated: cache held but not used by tensors, on every backend."""
        reserved = self.gauges.get("reserved_bytes")
        allocated = self.gauges.get("allocated_bytes")
        if allocated is None or reserved is None:
            return None
        return max(reserved - allocated, 0)

    @property
    def cached_free_ratio(self) -> float | None:
        """(reserved - allocated) / reserved: defined on every backend."""
        reserved = self.gauges.get("reserved_bytes", 0)
        cached_free = self.cached_free_bytes
        if cached_free is None or reserved <= 0:
            return None
        return cached_free / reserved


@dataclass
class GpuReading:
    """One GPU as NVML sees it."""

    index: int
    uuid: str
    name: str = ""
    driver_version: str = ""
    pci_bus_id: str = ""
    up: bool = True
    total_bytes: int | None = None
    used_bytes: int | None = None
    free_bytes: int | None = None
    driver_reserved_bytes: int | None = None
    # What device plugins name the GPU by (exporter.kubernetes.device_ids): the minor number
    # of /dev/nvidia<N> (GKE) and the UUIDs of its MIG devices.
    minor_number: int | None = None
    mig_uuids: list[str] = field(default_factory=list)
    # MIG mode as NVML reports it, "enabled" or "disabled" ("" where the GPU has no MIG): a
    # pending mode other than the current one takes effect only after a GPU reset.
    mig_mode: str = ""
    mig_mode_pending: str = ""
    # Why the whole GPU's memory is not read while NVML still answers for its MIG devices
    # (inside a container given a MIG slice, NVML refuses the parent's memory): "" when read.
    memory_unavailable: str = ""


@dataclass
class MigInstanceReading:
    """One MIG GPU instance of a GPU, as NVML sees it: the memory its compute instances
    share (each MIG device of it reports the same numbers), counted once."""

    gpu_index: int
    gpu_uuid: str  # the whole GPU's: joins gpu_memory_* and the GPU's pods
    gpu_instance_id: int  # NVML's, from placement (2, 3, 9, 10 on an H100), not 0..n
    profile: str  # the GPU instance's profile as NVML names it (3g.40gb), "" if it names none
    mig_uuids: list[str] = field(default_factory=list)  # its compute instances' MIG devices
    total_bytes: int | None = None
    used_bytes: int | None = None
    free_bytes: int | None = None
    # What NVML's process list says its processes hold (None until that list is read).
    process_bytes: int | None = None


@dataclass
class ProcessGpuReading:
    """One process's memory on one GPU, as NVML reports it (host PIDs)."""

    gpu_index: int
    gpu_uuid: str
    pid: int
    used_bytes: int
    # On a MIG GPU: the GPU instance the process runs in (NVML's process record); else None.
    gpu_instance_id: int | None = None


@dataclass(frozen=True)
class PodDevice:
    """One device the kubelet assigned to one container (pod-resources API, List): by a
    device plugin, or by Dynamic Resource Allocation through a ResourceClaim."""

    namespace: str
    pod: str
    container: str
    # A device plugin's resource (nvidia.com/gpu, nvidia.com/mig-1g.10gb, ...), or a DRA
    # driver's name (gpu.nvidia.com).
    resource: str
    # As the device plugin wrote it, or the DRA device's name in its pool (gpu-0,
    # gpu-0-mig-1g.10gb-19-0): exporter.kubernetes.device_ids resolves both.
    device_id: str
    # DRA only ("" for a device plugin's device): the ResourceClaim, the driver's pool (the
    # node's name for NVIDIA's driver) and the share of a device several claims consume.
    claim: str = ""
    claim_namespace: str = ""
    pool: str = ""
    share_id: str = ""

    @property
    def dynamic(self) -> bool:
        return bool(self.claim)


@dataclass
class KubeletReading:
    """What the node daemon knows from the kubelet, and how fresh it is."""

    socket: str
    up: bool  # the latest List succeeded
    error: str = ""  # why the latest List failed, in one line
    last_success_s: float | None = None  # Unix time of the latest successful List
    # Unix time that List was asked: a process first seen after it may hold a GPU the List
    # gave another pod (exporter.attribution never names it from this reading).
    asked_s: float | None = None
    refresh_errors: int = 0
    # From the latest successful List (kept while the kubelet is down); None before one.
    devices: list[PodDevice] | None = None
    # From the Kubernetes API where the daemon may read this node's pods (pod reader on):
    # pod UID -> (namespace, name) and container ID -> container name; None without.
    pods: dict[str, tuple[str, str]] | None = None
    containers: dict[str, str] = field(default_factory=dict)
    pods_api: bool = False  # the pod reader is on
    pods_error: str = ""  # why the latest pod list failed
    # From the kubelet's container log links (exporter.kubernetes.container_logs), read with
    # each List, after it: the same two maps, None where the folder is off or unreadable.
    log_pods: dict[str, tuple[str, str]] | None = None
    log_containers: dict[str, str] = field(default_factory=dict)
    logs_folder: str = ""  # the folder read; "" where reading it is off
    logs_error: str = ""  # why the latest read of it failed
    # With the claim reader (exporter.kubernetes.claims): (namespace, claim) -> its allocated
    # devices (ClaimedDevice), for the claims of this node's DRA devices; None without.
    claims: dict[tuple[str, str], list[Any]] | None = None
    claims_api: bool = False  # the claim reader is on
    claims_error: str = ""  # why the latest claims list failed
    # With the claim reader, where a DRA device's name does not resolve through NVML: this
    # node's ResourceSlices' (driver, pool, device) -> GPU UUID; None otherwise.
    slices: dict[tuple[str, str, str], str] | None = None


@dataclass
class ProcessContainerReading:
    """Where one GPU process runs, from /proc/<pid>/cgroup (exporter.kubernetes.cgroup).
    state: "container" (pod_uid "" for a container of no pod), "no_container" (a host
    process), or "unknown" (gone, unreadable or of an unknown shape: detail says which)."""

    pid: int
    state: str
    pod_uid: str = ""
    container_id: str = ""
    detail: str = ""
    first_seen_s: float = 0.0  # Unix time the daemon first saw it use a GPU


@dataclass
class HostReading:
    total_bytes: int
    available_bytes: int
    swap_total_bytes: int
    swap_used_bytes: int
    process_resident_bytes: int | None = None
    process_resident_peak_bytes: int | None = None

    def __post_init__(self) -> None:
        self.process_resident_peak_bytes = _peak(
            self.process_resident_peak_bytes, self.process_resident_bytes
        )


@dataclass
class HostProcessReading:
    """One process's host memory (from /proc/PID/status): who holds the host's RAM."""

    pid: int
    role: str
    rank: str
    resident_bytes: int
    resident_peak_bytes: int | None = None
    swap_bytes: int | None = None

    def __post_init__(self) -> None:
        self.resident_peak_bytes = _peak(self.resident_peak_bytes, self.resident_bytes)


def _peak(peak: int | None, current: int | None) -> int | None:
    """A peak never below the current value it is served beside. The kernel's high-water
    mark (ru_maxrss) lags the RSS that /proc reads (its per-thread counters fold in every
    64 page faults), so a peak read right after can be a few MB below it."""
    if peak is None or current is None:
        return peak
    return max(peak, current)


@dataclass
class PinnedHostReading:
    """Page-locked host memory held by one process's PyTorch caching host allocator
    (`pin_memory=True`, staging and swap buffers): host RAM that cannot be swapped out."""

    held_bytes: int  # blocks the allocator owns, in use or cached for reuse
    in_use_bytes: int  # blocks handed out and not yet reusable
    # Under `gpumem-exporter run`: which process of the server this is (catalog.PROCESS_LABELS).
    process: dict[str, str] = field(default_factory=dict)

    @property
    def cached_bytes(self) -> int:
        return max(self.held_bytes - self.in_use_bytes, 0)


@dataclass
class ActionCounts:
    """What one process's allocator actions did, as monotonic counts (its own, so they stay
    monotonic per process when one endpoint serves several)."""

    snapshots: dict[str, int] = field(default_factory=dict)  # trigger -> count
    empty_cache_released_bytes: int = 0
    remediations: dict[str, int] = field(default_factory=dict)  # "action/outcome" -> count
    # Under `run`: probe records the process dropped because the launcher's socket was full
    # (the probe never blocks its host to send one).
    records_dropped: int = 0
    # exporter.start(): helpers this process's probe started again after one died.
    helper_restarts: int = 0
    # What the ledger could not take as the server asked (exporter.components.PROBLEMS).
    component_problems: dict[str, int] = field(default_factory=dict)


@dataclass
class ProcessCounts:
    """One process's action counts, with its labels (empty for an embedded exporter)."""

    process: dict[str, str] = field(default_factory=dict)
    counts: ActionCounts = field(default_factory=ActionCounts)
    # Under `run`: Unix time of the process's last report to the launcher (None: none yet).
    last_report: float | None = None


# How a tick merges one part of the readings across its sources (Readings.merge).
EXTEND, UPDATE, LATEST, ANY = "extend", "update", "latest", "any"


def part(merge: str, default: Any = None, *, traced: bool = True) -> Any:
    """One part of the readings, declared once: how a tick merges it across sources (EXTEND a
    list, UPDATE a dict, LATEST non-None value wins, ANY of the flags) and whether a trace
    keeps it. The sample, a source's reading, the tick's merge, the replay's split and the
    trace's codec all come from these declarations."""
    metadata = {"merge": merge, "traced": traced}
    if merge == EXTEND:
        return field(default_factory=list, metadata=metadata)
    if merge == UPDATE:
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class Readings:
    """The parts of what one tick reads: a source returns any subset of them (SourceReading),
    the sampler merges every source's into one Sample."""

    allocators: list[AllocatorReading] = part(EXTEND)
    gpus: list[GpuReading] = part(EXTEND)
    mig_instances: list[MigInstanceReading] = part(EXTEND)
    processes: list[ProcessGpuReading] = part(EXTEND)
    host: HostReading | None = part(LATEST)
    host_processes: list[HostProcessReading] = part(EXTEND)
    pinned_host: list[PinnedHostReading] = part(EXTEND)
    # PID that NVML would show for this process; replays carry the recorded one.
    self_pid: int | None = part(LATEST)
    # Messages from agents that were rejected, by reason (gpumem-exporter run), and readings
    # not served because a series budget is full, by budget (exporter.budget): the serving
    # exporter's own bookkeeping, not what it read, so a replay never plays them back.
    rejected_messages: dict[str, int] = part(UPDATE, traced=False)
    over_budget: dict[str, int] = part(UPDATE, traced=False)
    # `processes` repeat an earlier read: NVML's process list is its costliest call (~35 us
    # per GPU), so it is read every few seconds, not every tick.
    processes_cached: bool = part(ANY, False)
    # The node daemon's Kubernetes attribution (exporter.sources.kubelet): of this node at
    # this moment, never part of a trace.
    kubelet: KubeletReading | None = part(LATEST, traced=False)
    process_containers: list[ProcessContainerReading] = part(EXTEND, traced=False)

    def merge(self, other: Readings) -> None:
        """Add another source's readings to these, each part as it declares (every tick, for
        every source: the plan is worked out once, _MERGE)."""
        for name in _MERGE[EXTEND]:
            getattr(self, name).extend(getattr(other, name))
        for name in _MERGE[UPDATE]:
            getattr(self, name).update(getattr(other, name))
        for name in _MERGE[ANY]:
            setattr(self, name, getattr(self, name) or getattr(other, name))
        for name in _MERGE[LATEST]:
            theirs = getattr(other, name)
            if theirs is not None:
                setattr(self, name, theirs)

    def parts(self) -> dict[str, Any]:
        """The readings alone, by part (what a source's reading of this sample would be)."""
        return {f.name: getattr(self, f.name) for f in READING_PARTS}


@dataclass
class SourceReading(Readings):
    """What one source returns from one read: any subset of the parts of a sample."""

    # Why this source has nothing to report on this host (no NVML library, no driver, no
    # GPU): "no data", not a failure. Empty when it reports.
    unavailable: str = ""


@dataclass
class Sample(Readings):
    """Everything read in one tick, merged from all sources."""

    timestamp: float = field(kw_only=True)

    def allocator_pid(self, reading: AllocatorReading) -> int | None:
        """The host PID of the process an allocator reading is from: its `pid` label under
        `run`, else the sample's own process."""
        pid_text = reading.process.get("pid", "")
        return int(pid_text) if pid_text.isdigit() else self.self_pid

    def to_dict(self) -> dict[str, Any]:
        """One line of a trace (exporter.trace): the timestamp, then every traced part."""
        return {
            "timestamp": self.timestamp,
            **{name: _plain(getattr(self, name)) for name, _ in _TRACED},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """A trace's line (checked by exporter.trace first); parts it lacks keep their
        defaults, parts this version does not know are left for newer writers."""
        parts = {name: _decode(hint, data[name]) for name, hint in _TRACED if name in data}
        return cls(timestamp=float(data["timestamp"]), **parts)


READING_PARTS = fields(Readings)
# The parts' names by how they merge: four short loops a tick instead of a test per part.
_MERGE = {
    how: tuple(f.name for f in READING_PARTS if f.metadata["merge"] == how)
    for how in (EXTEND, UPDATE, LATEST, ANY)
}
# (name, declared type) of the parts a trace keeps, in the order its lines list them.
_TRACED = tuple(
    (f.name, typing.get_type_hints(Readings)[f.name]) for f in READING_PARTS if f.metadata["traced"]
)


def _plain(value: Any) -> Any:
    return (
        asdict(value)
        if is_dataclass(value) and not isinstance(value, type)
        else ([_plain(v) for v in value] if isinstance(value, list) else value)
    )


def _decode(hint: Any, value: Any) -> Any:
    """A traced part from its JSON value, by its declared type."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):  # X | None
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _decode(inner, value)
    if origin is list:
        (inner,) = typing.get_args(hint)
        return [_decode(inner, v) for v in value]
    if isinstance(hint, type) and is_dataclass(hint):
        make: Any = getattr(hint, "from_dict", hint)  # a reading with nested parts has one
        return make(value) if make is not hint else hint(**value)
    if hint is bool:
        return bool(value)
    return dict(value) if origin is dict else value


@dataclass
class SourceStatus:
    """The sampler's account of one source, exported as gpumem_exporter_source_*."""

    up: bool = False
    duration_s: float = 0.0
    errors: int = 0
    failed_reads: int = 0  # in a row, up to the latest
    last_error: str = ""  # of the latest read, when it failed
    unavailable: str = ""  # SourceReading.unavailable of the latest read


@dataclass
class ExporterState:
    """What the sampler publishes: the latest sample plus its own health per source."""

    sample: Sample | None = None
    sources: dict[str, SourceStatus] = field(default_factory=dict)
