"""Turns the latest sample into Prometheus metric families: the one place names are made.

A custom collector renders whatever the sampler published last, so a GPU or process that is
gone from the sample is gone from the scrape (no stale gauges), and counters are the
allocator's own monotonic values rather than re-counted here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from exporter.attribution import Attribution, attribute
from exporter.sample import (
    ALLOCATOR_COUNTERS,
    ALLOCATOR_GAUGES,
    LAYOUT_GAUGES,
    POOL_GAUGES,
    PRIVATE_POOL_GAUGES,
    PROCESS_LABELS,
    AllocatorReading,
    ExporterState,
    ProcessCounts,
    Sample,
)

TORCH_PREFIX = "torch_cuda_"
ALLOCATOR_LABELS = ("device", "gpu_uuid")
GPU_LABELS = ("gpu", "gpu_uuid")

# GpuReading field -> (metric name, help)
GPU_MEMORY_GAUGES = {
    "total_bytes": ("gpu_memory_total_bytes", "Memory of the GPU that processes can use (NVML)."),
    "used_bytes": (
        "gpu_memory_used_bytes",
        "GPU memory in use by every process on the GPU, CUDA contexts included (NVML).",
    ),
    "free_bytes": ("gpu_memory_free_bytes", "GPU memory no process holds (NVML)."),
    "driver_reserved_bytes": (
        "gpu_memory_driver_reserved_bytes",
        "GPU memory the driver and firmware keep for themselves: never available to "
        "processes (NVML memory info v2).",
    ),
}
# HostReading field -> (metric name, help). The machine's memory, in every mode.
MACHINE_HOST_GAUGES = {
    "total_bytes": (
        "host_memory_total_bytes",
        "Physical memory of the host (MemTotal in /proc/meminfo).",
    ),
    "available_bytes": (
        "host_memory_available_bytes",
        "Memory the host can give to new work without swapping (MemAvailable): what is left "
        "for pinned buffers, data loaders and the next process.",
    ),
    "swap_total_bytes": ("host_swap_total_bytes", "Swap space configured on the host."),
    "swap_used_bytes": (
        "host_swap_used_bytes",
        "Swap space in use on the host; pages of a serving process swapped out make its "
        "requests slow.",
    ),
}
# Live modes also serve the peak of the exporter's own process, beside client_python's
# process_resident_memory_bytes. A replay never does: `process_` names belong to the
# process that serves them, and the recorded process is served as host_process_*.
HOST_GAUGES = {
    **MACHINE_HOST_GAUGES,
    "process_resident_peak_bytes": (
        "process_resident_memory_peak_bytes",
        "Peak resident memory of this process (ru_maxrss), never below its current "
        "process_resident_memory_bytes.",
    ),
}

_LAYOUT_HELP = {
    "largest_free_block_bytes": "Biggest free block in the default pool's cache: the biggest "
    "request that fits without a new cudaMalloc (or cuMemMap with expandable segments). From "
    "an allocator snapshot read every few seconds (torch_cuda_layout_age_seconds).",
    "default_pool_free_bytes": "Free bytes cached in the default pool: what ordinary "
    "allocations can reuse. From an allocator snapshot.",
    "free_in_used_segments_bytes": "Free bytes inside segments that also hold live blocks, in "
    "every pool: fragmentation, defined with expandable segments too (there "
    "inactive_split_bytes is not tracked). From an allocator snapshot.",
}
_PRIVATE_POOL_HELP = {
    "reserved_bytes": "Bytes reserved by one private pool (a CUDA graph's or a MemPool's): "
    "part of reserved_bytes that ordinary allocations cannot reuse.",
    "allocated_bytes": "Bytes of live tensors in one private pool (from an allocator snapshot).",
}
# PinnedHostReading field -> metric name
PINNED_HOST_GAUGES = {
    "held_bytes": (
        "torch_cuda_pinned_host_bytes",
        "Page-locked host memory held by PyTorch's caching host allocator (in use or cached): "
        "host RAM that cannot be swapped out.",
    ),
    "in_use_bytes": (
        "torch_cuda_pinned_host_in_use_bytes",
        "Pinned host blocks handed out and not yet reusable (updated when the host allocator "
        "next processes its events, so it can lag a free).",
    ),
    "cached_bytes": (
        "torch_cuda_pinned_host_cached_bytes",
        "Pinned host memory cached for reuse: held minus in use.",
    ),
}

_HELP = {
    "allocated_bytes": "Bytes of live tensors held by the CUDA caching allocator.",
    "reserved_bytes": "Bytes the caching allocator holds from the driver (allocated plus cache).",
    "active_bytes": "Allocated bytes plus freed blocks still in use by a stream.",
    "inactive_split_bytes": "Free bytes inside partly used segments (fragmentation).",
    "requested_bytes": "Bytes callers asked for, before the allocator's rounding.",
    "allocated_peak_bytes": "Peak allocated bytes since the process last reset peaks.",
    "reserved_peak_bytes": "Peak reserved bytes since the process last reset peaks.",
    "segments": "Segments (cudaMalloc'd regions) the allocator holds.",
    "allocations": "Live allocations.",
    "memory_limit_bytes": "Most bytes the caching allocator may reserve on the device: "
    "torch.cuda.set_per_process_memory_fraction times the device's memory (the device's "
    "memory when no fraction is set). Requests past it raise out-of-memory errors.",
    "alloc_retries": "Allocations that failed, flushed the cache and were retried.",
    "ooms": "Out-of-memory errors raised by the allocator.",
    "device_malloc": "Device allocations (cudaMalloc, or cuMemMap with expandable segments).",
    "device_free": "Device frees (cudaFree, or cuMemUnmap with expandable segments).",
    "sync_all_streams": "Full stream synchronisations (each empty_cache counts one).",
}


# HostProcessReading field -> (metric name, help) (labels pid, role, rank).
HOST_PROCESS_GAUGES = {
    "resident_bytes": (
        "host_process_resident_memory_bytes",
        "Resident host memory of one process of the server (VmRSS), pinned buffers included.",
    ),
    "resident_peak_bytes": (
        "host_process_resident_memory_peak_bytes",
        "Peak resident host memory of one process of the server (VmHWM), never below its "
        "current resident memory.",
    ),
    "swap_bytes": (
        "host_process_swap_bytes",
        "Host memory of one process of the server swapped out (VmSwap).",
    ),
}
HOST_PROCESS_LABELS = ("pid", "role", "rank")
# gpumem_exporter_alert_firing: one meaning per label, whatever the alert is about.
ALERT_LABELS = ("alert", "device", "gpu", "gpu_uuid", *PROCESS_LABELS)


@dataclass
class ActionStats:
    """Counts of allocator actions per process, and of admin requests, for /metrics."""

    processes: list[ProcessCounts] = field(default_factory=list)
    admin_requests: dict[tuple[str, str], int] = field(default_factory=dict)  # (action, outcome)


@dataclass
class _AllocatorFamilies:
    """The allocator's families of one collection, filled reading by reading."""

    gauges: dict[str, GaugeMetricFamily]
    counters: dict[str, CounterMetricFamily]
    pools: dict[str, GaugeMetricFamily]
    fragmentation: GaugeMetricFamily
    cached_free: GaugeMetricFamily
    non_allocator: GaugeMetricFamily
    non_allocator_age: GaugeMetricFamily
    layout: dict[str, GaugeMetricFamily]
    layout_age: GaugeMetricFamily
    layout_skipped: InfoMetricFamily
    private_pools: dict[str, GaugeMetricFamily]
    info: InfoMetricFamily

    def in_order(self) -> list[Metric]:
        """Every family, in the order /metrics has always listed them."""
        return [
            *self.gauges.values(),
            *self.counters.values(),
            *self.pools.values(),
            self.fragmentation,
            self.cached_free,
            self.non_allocator,
            self.non_allocator_age,
            *self.layout.values(),
            self.layout_age,
            self.layout_skipped,
            *self.private_pools.values(),
            self.info,
        ]


class SampleCollector(Collector):
    def __init__(
        self,
        state: Callable[[], ExporterState],
        *,
        const_labels: Mapping[str, str],
        version: str,
        mode: str,
        torch_version: str = "",
        host_gauges: Mapping[str, tuple[str, str]] = HOST_GAUGES,
        alerts: Callable[[], Iterable[tuple[str, dict[str, str], bool]]] | None = None,
        actions: Callable[[], ActionStats] | None = None,
        alerts_version: Callable[[], object] | None = None,
    ) -> None:
        self._actions = actions
        # Changes whenever alerts() may answer differently (cheaper than comparing answers).
        self._alerts_version = alerts_version
        self._state = state
        self._host_gauges = host_gauges
        self._alerts = alerts
        self._const_names = tuple(const_labels)
        self._const_values = tuple(const_labels.values())
        self._version = version
        self._mode = mode
        self._torch_version = torch_version

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=self._const_names + labels)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, labels=self._const_names + labels)

    def _values(self, *values: object) -> list[str]:
        return [*self._const_values, *(str(v) for v in values)]

    def _own(self, names: Iterable[str]) -> tuple[str, ...]:
        """Label names not already constant on this process (an embedded exporter with RANK
        set has `rank` on every series)."""
        return tuple(n for n in names if n not in self._const_names)

    def fingerprint(self) -> tuple[object, ...]:
        """Everything collect() reads that can change: equal fingerprints, equal output
        (exporter.exposition caches the rendered bytes on it). A tick publishes a new state
        object, so the state is compared by identity first, which is cheap."""
        if self._alerts_version is not None:
            alerts: object = self._alerts_version()
        else:
            alerts = list(self._alerts()) if self._alerts is not None else None
        actions = self._actions() if self._actions is not None else None
        return (self._state(), alerts, actions)

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        yield from self._exporter_families(state)
        sample = state.sample
        if sample is None:
            return
        yield from self._allocator_families(sample)
        yield from self._gpu_families(sample)
        yield from self._kubernetes_families(sample)
        yield from self._host_families(sample)

    def _exporter_families(self, state: ExporterState) -> Iterator[Metric]:
        info = InfoMetricFamily(
            "gpumem_exporter_build", "gpumem-exporter version and mode.", labels=self._const_names
        )
        info.add_metric(list(self._const_values), {"version": self._version, "mode": self._mode})
        yield info
        up = self._gauge(
            "gpumem_exporter_source_up", "1 if the source's last read succeeded.", ("source",)
        )
        duration = self._gauge(
            "gpumem_exporter_source_duration_seconds",
            "Wall time of the source's last read.",
            ("source",),
        )
        errors = self._counter(
            "gpumem_exporter_source_errors", "Failed reads of the source.", ("source",)
        )
        unavailable = InfoMetricFamily(
            "gpumem_exporter_source_unavailable",
            "A source with nothing to read on this host, and why (no NVML library, no driver, "
            "no GPU): no data, not a failure (its source_up stays 1).",
            labels=(*self._const_names, "source"),
        )
        for name, status in sorted(state.sources.items()):
            up.add_metric(self._values(name), 1.0 if status.up else 0.0)
            duration.add_metric(self._values(name), status.duration_s)
            errors.add_metric(self._values(name), status.errors)
            if status.unavailable:
                unavailable.add_metric(self._values(name), {"reason": status.unavailable})
        yield from (up, duration, errors)
        if unavailable.samples:
            yield unavailable
        if self._alerts is not None:
            names = self._own(ALERT_LABELS)
            firing = self._gauge(
                "gpumem_exporter_alert_firing",
                "1 while the in-process detector for the alert is firing; labels name what it "
                "is about (device: CUDA ordinal, gpu: NVML index, process labels).",
                names,
            )
            for alert, labels, is_firing in self._alerts():
                values = [alert, *(labels.get(n, "") for n in names[1:])]
                firing.add_metric(self._values(*values), 1.0 if is_firing else 0.0)
            if firing.samples:
                yield firing
        if state.sample is not None and state.sample.rejected_messages:
            rejected = self._counter(
                "gpumem_exporter_agent_messages_rejected",
                "Messages from agents of `gpumem-exporter run` dropped as malformed, by reason.",
                ("reason",),
            )
            for reason, count in sorted(state.sample.rejected_messages.items()):
                rejected.add_metric(self._values(reason), count)
            yield rejected
        if self._actions is not None:
            yield from self._action_families(self._actions())
        if state.sample is not None:
            last = self._gauge(
                "gpumem_exporter_last_sample_timestamp_seconds",
                "Unix time of the last completed sample.",
            )
            last.add_metric(self._values(), state.sample.timestamp)
            yield last

    def _action_families(self, stats: ActionStats) -> Iterator[Metric]:
        # Per process under `gpumem-exporter run` (each process's own monotonic counts).
        per_process = any(p.process for p in stats.processes)
        labels = self._own(PROCESS_LABELS) if per_process else ()
        snapshots = self._counter(
            "gpumem_exporter_snapshots", "Allocator snapshots written.", (*labels, "trigger")
        )
        released = self._counter(
            "torch_cuda_empty_cache_released_bytes",
            "Bytes returned to the driver by empty_cache calls of the exporter.",
            labels,
        )
        remediations = self._counter(
            "gpumem_exporter_remediations",
            "Automatic remediation actions by outcome.",
            (*labels, "action", "outcome"),
        )
        for entry in stats.processes:
            ids = [entry.process.get(n, "") for n in labels]
            counts = entry.counts
            for trigger, count in sorted(counts.snapshots.items()):
                snapshots.add_metric(self._values(*ids, trigger), count)
            released.add_metric(self._values(*ids), counts.empty_cache_released_bytes)
            for key, count in sorted(counts.remediations.items()):
                action, _, outcome = key.partition("/")
                remediations.add_metric(self._values(*ids, action, outcome), count)
        admin = self._counter(
            "gpumem_exporter_admin_requests",
            "Admin API requests by action and outcome.",
            ("action", "outcome"),
        )
        for (action, outcome), count in sorted(stats.admin_requests.items()):
            admin.add_metric(self._values(action, outcome), count)
        yield from (snapshots, released, remediations, admin)

    def _allocator_families(self, sample: Sample) -> Iterator[Metric]:
        if not sample.allocators:
            return
        # One endpoint for several processes (gpumem-exporter run): label each by process.
        per_process = any(reading.process for reading in sample.allocators)
        labels = ALLOCATOR_LABELS + (PROCESS_LABELS if per_process else ())
        families = self._new_allocator_families(labels)
        for reading in sample.allocators:
            ids: tuple[object, ...] = (reading.device, reading.gpu_uuid)
            if per_process:
                ids += tuple(reading.process.get(name, "") for name in PROCESS_LABELS)
            self._add_allocator_reading(families, reading, ids)
        yield from (f for f in families.in_order() if f.samples)
        yield from self._pinned_host_families(sample)

    def _new_allocator_families(self, labels: tuple[str, ...]) -> _AllocatorFamilies:
        gauges = {k: self._gauge(TORCH_PREFIX + k, _HELP[k], labels) for k in ALLOCATOR_GAUGES}
        counters = {
            k: self._counter(TORCH_PREFIX + k, _HELP[k], labels) for k in ALLOCATOR_COUNTERS
        }
        pools = {
            k: self._gauge(f"{TORCH_PREFIX}pool_{k}", f"Per pool: {_HELP[k]}", (*labels, "pool"))
            for k in POOL_GAUGES
        }
        fragmentation = self._gauge(
            "torch_cuda_fragmentation_ratio",
            "inactive_split / reserved; only where the allocator tracks inactive_split.",
            labels,
        )
        cached_free = self._gauge(
            "torch_cuda_cached_free_ratio",
            "(reserved - allocated) / reserved: cache held but not used by tensors.",
            labels,
        )
        non_allocator = self._gauge(
            "torch_cuda_non_allocator_bytes",
            "GPU memory of this process outside the caching allocator (NVML used - reserved): "
            "CUDA context, NCCL, library workspaces. Taken only from readings of one moment.",
            labels,
        )
        non_allocator_age = self._gauge(
            "torch_cuda_non_allocator_age_seconds",
            "Age of torch_cuda_non_allocator_bytes at this tick: it is taken again whenever "
            "the process's memory moves, and kept while its readings disagree.",
            labels,
        )
        layout = {k: self._gauge(TORCH_PREFIX + k, _LAYOUT_HELP[k], labels) for k in LAYOUT_GAUGES}
        layout_age = self._gauge(
            "torch_cuda_layout_age_seconds",
            "Age of the allocator snapshot behind the layout families (largest free block, "
            "private pool allocated bytes) at this tick.",
            labels,
        )
        layout_skipped = InfoMetricFamily(
            "torch_cuda_layout_skipped",
            "Why the latest allocator snapshot was not taken (too_many_blocks: it would stall "
            "the serving thread; history_recording: it would build every block's stack).",
            labels=self._const_names + labels,
        )
        private_pools = {
            k: self._gauge(
                f"{TORCH_PREFIX}private_pool_{k}", _PRIVATE_POOL_HELP[k], (*labels, "pool_id")
            )
            for k in PRIVATE_POOL_GAUGES
        }
        info = InfoMetricFamily(
            "torch_cuda_allocator",
            "CUDA caching allocator settings (settings_source: live when the allocator "
            "reported them, else environment).",
            labels=self._const_names + labels,
        )
        return _AllocatorFamilies(
            gauges,
            counters,
            pools,
            fragmentation,
            cached_free,
            non_allocator,
            non_allocator_age,
            layout,
            layout_age,
            layout_skipped,
            private_pools,
            info,
        )

    def _add_allocator_reading(
        self, f: _AllocatorFamilies, reading: AllocatorReading, ids: tuple[object, ...]
    ) -> None:
        for key, value in reading.gauges.items():
            f.gauges[key].add_metric(self._values(*ids), value)
        for key, value in reading.counters.items():
            f.counters[key].add_metric(self._values(*ids), value)
        for pool, pool_gauges in sorted(reading.pools.items()):
            for key, value in pool_gauges.items():
                f.pools[key].add_metric(self._values(*ids, pool), value)
        if (ratio := reading.fragmentation_ratio) is not None:
            f.fragmentation.add_metric(self._values(*ids), ratio)
        if (ratio := reading.cached_free_ratio) is not None:
            f.cached_free.add_metric(self._values(*ids), ratio)
        if reading.non_allocator_bytes is not None:
            f.non_allocator.add_metric(self._values(*ids), reading.non_allocator_bytes)
        if reading.non_allocator_age_s is not None:
            f.non_allocator_age.add_metric(self._values(*ids), reading.non_allocator_age_s)
        for key, value in reading.layout.items():
            f.layout[key].add_metric(self._values(*ids), value)
        if reading.layout_age_s is not None:
            f.layout_age.add_metric(self._values(*ids), reading.layout_age_s)
        if reading.layout_skipped:
            f.layout_skipped.add_metric(self._values(*ids), {"reason": reading.layout_skipped})
        for pool_id, pool_gauges in sorted(reading.private_pools.items()):
            for key, value in pool_gauges.items():
                f.private_pools[key].add_metric(self._values(*ids, pool_id), value)
        max_split = reading.max_split_size_bytes
        f.info.add_metric(
            self._values(*ids),
            {
                "backend": reading.backend,
                "expandable_segments": str(reading.expandable_segments).lower(),
                "max_split_size_bytes": "" if max_split is None else str(max_split),
                "garbage_collection_threshold": reading.settings.get(
                    "garbage_collection_threshold", ""
                ),
                "settings_source": reading.settings.get("source", "environment"),
                "torch_version": self._torch_version,
            },
        )

    def _pinned_host_families(self, sample: Sample) -> Iterator[Metric]:
        if not sample.pinned_host:
            return
        per_process = any(reading.process for reading in sample.pinned_host)
        labels = self._own(PROCESS_LABELS) if per_process else ()
        for field_name, (name, doc) in PINNED_HOST_GAUGES.items():
            family = self._gauge(name, doc, labels)
            for reading in sample.pinned_host:
                ids = (reading.process.get(n, "") for n in labels)
                family.add_metric(self._values(*ids), getattr(reading, field_name))
            yield family

    def _gpu_families(self, sample: Sample) -> Iterator[Metric]:
        if not sample.gpus:
            return
        memory = {
            field_name: self._gauge(name, doc, GPU_LABELS)
            for field_name, (name, doc) in GPU_MEMORY_GAUGES.items()
        }
        up = self._gauge(
            "gpu_up", "1 while NVML answers for the GPU; 0 when lost or refused.", GPU_LABELS
        )
        info = InfoMetricFamily(
            "gpu", "GPU identity from NVML.", labels=self._const_names + GPU_LABELS
        )
        for gpu in sample.gpus:
            ids = (gpu.index, gpu.uuid)
            up.add_metric(self._values(*ids), 1.0 if gpu.up else 0.0)
            info.add_metric(
                self._values(*ids),
                {
                    "name": gpu.name,
                    "driver_version": gpu.driver_version,
                    "pci_bus_id": gpu.pci_bus_id,
                },
            )
            for field_name, family in memory.items():
                value = getattr(gpu, field_name)
                if value is not None:
                    family.add_metric(self._values(*ids), value)
        process = self._gauge(
            "gpu_process_memory_used_bytes",
            "GPU memory used by a process (NVML; host PIDs).",
            (*GPU_LABELS, "pid"),
        )
        for entry in sample.processes:
            process.add_metric(
                self._values(entry.gpu_index, entry.gpu_uuid, entry.pid), entry.used_bytes
            )
        families: list[Metric] = [*memory.values(), process, up, info]
        yield from (f for f in families if f.samples)

    def _kubernetes_families(self, sample: Sample) -> Iterator[Metric]:
        """The node daemon's attribution (exporter.attribution): info series joined to the
        device and process series by gpu_uuid or pid, which keep their identity when a GPU
        changes hands."""
        kubelet = sample.kubelet
        if kubelet is None:
            return
        up = self._gauge(
            "gpumem_exporter_kubelet_up",
            "1 if the latest List of the kubelet's pod-resources API succeeded.",
        )
        up.add_metric(self._values(), 1.0 if kubelet.up else 0.0)
        yield up
        errors = self._counter(
            "gpumem_exporter_kubelet_refresh_errors",
            "Failed Lists of the kubelet's pod-resources API.",
        )
        errors.add_metric(self._values(), kubelet.refresh_errors)
        yield errors
        if kubelet.last_success_s is not None:
            last = self._gauge(
                "gpumem_exporter_kubelet_last_success_timestamp_seconds",
                "Unix time of the latest successful List: the age of the attribution.",
            )
            last.add_metric(self._values(), kubelet.last_success_s)
            yield last
        if kubelet.error:
            error = InfoMetricFamily(
                "gpumem_exporter_kubelet_error",
                "Why the latest List of the kubelet's pod-resources API failed.",
                labels=self._const_names,
            )
            error.add_metric(self._values(), {"error": kubelet.error, "socket": kubelet.socket})
            yield error
        if kubelet.pods_api:
            pods_up = self._gauge(
                "gpumem_exporter_pods_api_up",
                "1 if the latest list of this node's pods from the Kubernetes API succeeded "
                "(the pod reader names processes on shared GPUs).",
            )
            pods_up.add_metric(self._values(), 1.0 if kubelet.pods is not None else 0.0)
            yield pods_up
            if kubelet.pods_error:
                pods_error = InfoMetricFamily(
                    "gpumem_exporter_pods_api_error",
                    "Why the latest list of this node's pods from the Kubernetes API failed.",
                    labels=self._const_names,
                )
                pods_error.add_metric(self._values(), {"error": kubelet.pods_error})
                yield pods_error
        attribution = attribute(sample)
        if attribution is not None:
            yield from self._attribution_families(attribution)

    def _attribution_families(self, attribution: Attribution) -> Iterator[Metric]:
        """Which pod holds each GPU and process, and the memory no pod owns."""
        gpu_pods = self._gauge(
            "gpu_pod_info",
            "1 for each container the kubelet assigned a GPU to (gpu_uuid: the NVML GPU the "
            "device is on, empty where none matches), whether or not NVML sees that GPU.",
            ("gpu_uuid", "device_id", "resource", "namespace", "pod", "container"),
        )
        for row in attribution.gpu_pods:
            gpu_pods.add_metric(
                self._values(
                    row.gpu_uuid, row.device_id, row.resource, row.namespace, row.pod, row.container
                ),
                1.0,
            )
        containers = self._gauge(
            "gpu_process_container_info",
            "1 for each GPU process in a pod: its pod UID and container ID (from its cgroup).",
            ("pid", "pod_uid", "container_id"),
        )
        named = self._gauge(
            "gpu_process_pod_info",
            "1 for each GPU process whose pod is certain: named by the Kubernetes API (pod "
            "reader), or the only pod, through one container, holding the GPUs it uses, with "
            "no other pod's process on them.",
            ("pid", "namespace", "pod", "container"),
        )
        for process in attribution.process_pods:
            containers.add_metric(
                self._values(process.pid, process.pod_uid, process.container_id), 1.0
            )
            if process.pod:
                named.add_metric(
                    self._values(process.pid, process.namespace, process.pod, process.container),
                    1.0,
                )
        unattributed = self._gauge(
            "gpu_memory_unattributed_bytes",
            "GPU memory that no pod holding the GPU owns: the whole GPU's used memory where no "
            "pod holds it, else its processes in no pod.",
            GPU_LABELS,
        )
        for uuid, (index, value) in sorted(attribution.unattributed_gpus.items()):
            unattributed.add_metric(self._values(index, uuid), value)
        per_process = self._gauge(
            "gpu_process_memory_unattributed_bytes",
            "GPU memory of a process outside every pod that holds its GPU (reason: no_pod, "
            "not_assigned; unknown: its cgroup could not be read, not counted as unattributed).",
            (*GPU_LABELS, "pid", "reason"),
        )
        for entry in attribution.unattributed_processes:
            per_process.add_metric(
                self._values(entry.gpu_index, entry.gpu_uuid, entry.pid, entry.reason),
                entry.used_bytes,
            )
        families = (gpu_pods, containers, named, unattributed, per_process)
        yield from (f for f in families if f.samples)

    def _host_families(self, sample: Sample) -> Iterator[Metric]:
        if sample.host_processes:
            names = self._own(HOST_PROCESS_LABELS)
            for field_name, (name, doc) in HOST_PROCESS_GAUGES.items():
                family = self._gauge(name, doc, names)
                for process in sample.host_processes:
                    value = getattr(process, field_name)
                    if value is not None:
                        ids = {"pid": process.pid, "role": process.role, "rank": process.rank}
                        family.add_metric(self._values(*(ids[n] for n in names)), value)
                if family.samples:
                    yield family
        host = sample.host
        if host is None:
            return
        for field_name, (name, doc) in self._host_gauges.items():
            value = getattr(host, field_name)
            if value is not None:
                family = self._gauge(name, doc)
                family.add_metric(self._values(), value)
                yield family
