"""Every metric family the exporter can serve, declared once.

Each entry gives the family's name, type, help, labels, the modes that serve it, the source
it comes from and, where a reading's field carries it, that field (`key`). From this list:

- exporter.metrics makes every family it serves (it cannot make one not listed here);
- the sample's key tuples (exporter.sample), the agents' protocol (exporter.transport.protocol) and
  the trace recorder (exporter.record) take their fields from the groups below;
- docs/metrics.md's family table is written from it (`python -m exporter.reference --write`),
  and a test keeps the two equal.

Families of client_python's own collectors (process_*, python_*) are not ours and not listed.
Labels are the family's own: every family also carries the constant labels (GPUMEM_LABELS,
rank), and a `per_process` family gains PROCESS_LABELS where one endpoint serves several
processes (`gpumem-exporter run`). Standard library only: agents import this.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

# Labels that tell the processes of one server apart when one endpoint serves them all.
PROCESS_LABELS = ("pid", "rank", "local_rank", "role")
ALLOCATOR_LABELS = ("device", "gpu_uuid")
GPU_LABELS = ("gpu", "gpu_uuid")
# A MIG GPU instance: its whole GPU's labels, NVML's GPU instance ID and its profile.
MIG_LABELS = (*GPU_LABELS, "gpu_instance", "profile")
HOST_PROCESS_LABELS = ("pid", "role", "rank")
# gpumem_exporter_alert_firing: one meaning per label, whatever the alert is about.
ALERT_LABELS = ("alert", "device", "gpu", "gpu_uuid", *PROCESS_LABELS)
# gpumem_exporter_allocator_settings_change(s): an allocator alert's subject.
SETTINGS_CHANGE_LABELS = ("device", "gpu_uuid", *PROCESS_LABELS)

# GPUMEM_DETAIL: "basic" keeps a fleet's series budget (docs/metrics.md, "Detail levels");
# "full" adds the families declared `full_only` below.
DETAIL_LEVELS = ("basic", "full")

# What a family needs of a mode to be served there: a mode has some of these (its
# exporter.traits.Traits.has, declared in exporter/modes/); a family names one, never a mode.
ANYWHERE = ""  # needs nothing: the exporter's own health, served everywhere
ALLOCATOR = "allocator"  # a PyTorch allocator read, or replayed, and actions on it
DEVICES = "devices"  # GPUs read through NVML (or replayed)
HOST = "host"  # the host's memory
OWN_PROCESS = "own_process"  # the process that serves is one it reports
AGENTS = "agents"  # processes that report through agents (run)
BUDGETS = "budgets"  # readings of many processes, held to series budgets
HOST_PROCESSES = "host_processes"  # host memory per process
GPU_PROCESSES = "gpu_processes"  # every process on the node's GPUs (the node daemon)
KUBERNETES = "kubernetes"  # the kubelet's and the API server's view of the node
NEEDS = (
    ALLOCATOR,
    DEVICES,
    HOST,
    OWN_PROCESS,
    AGENTS,
    BUDGETS,
    HOST_PROCESSES,
    GPU_PROCESSES,
    KUBERNETES,
)
EVERYWHERE = "*"  # full_only: at the full detail level wherever it is served


@dataclass(frozen=True)
class Family:
    name: str  # as client_python takes it: a counter without _total, an info without _info
    kind: str  # gauge, counter or info
    help: str
    labels: tuple[str, ...]
    source: str  # what reads it: torch, nvml, host, process_memory, kubelet, agents, exporter
    needs: str  # what a mode must have to serve it (NEEDS), or ANYWHERE
    group: str = ""  # the families read from one part of a reading, served alike
    key: str = ""  # the reading's field (or dict key) that holds the value
    per_process: bool = False  # gains PROCESS_LABELS under `gpumem-exporter run`
    info_labels: tuple[str, ...] = ()  # the value labels of an info family
    # Served only at the full detail level (GPUMEM_DETAIL=full): EVERYWHERE, or in the modes
    # that have this (NEEDS); "" never. Breakdowns no shipped rule or dashboard needs, kept
    # off a fleet's series budget.
    full_only: str = ""
    # A deprecated name (exporter.contract): the family that replaces it, whose samples it
    # is served with, beside it, until a minor release after `deprecated_since`.
    replaced_by: str = ""
    deprecated_since: str = ""

    def served(self, has: Collection[str]) -> bool:
        """Whether a mode that has these (Traits.has) serves it, at some detail level."""
        return self.needs == ANYWHERE or self.needs in has

    def full_only_in(self, has: Collection[str]) -> bool:
        """Whether such a mode serves it only at the full detail level."""
        return self.full_only == EVERYWHERE or (bool(self.full_only) and self.full_only in has)

    @property
    def exposed(self) -> str:
        """The name a scrape shows (text format)."""
        return self.name + {"counter": "_total", "info": "_info"}.get(self.kind, "")


def _allocator(
    kind: str,
    group: str,
    key: str,
    help: str,
    name: str = "",
    labels: tuple[str, ...] = (),
    full_only: str = "",
) -> Family:
    return Family(
        name or f"torch_cuda_{key}",
        kind,
        help,
        (*ALLOCATOR_LABELS, *labels),
        "torch",
        ALLOCATOR,
        group,
        key,
        per_process=True,
        full_only=full_only,
    )


_LAYOUT = "From an allocator snapshot read every few seconds (torch_cuda_layout_age_seconds)."

FAMILIES: tuple[Family, ...] = (
    # -- the exporter itself -------------------------------------------------------------
    Family(
        "gpumem_exporter_build",
        "info",
        "gpumem-exporter version and mode.",
        (),
        "exporter",
        ANYWHERE,
        info_labels=("version", "mode"),
    ),
    Family(
        "gpumem_exporter_source_up",
        "gauge",
        "1 if the source's last read succeeded.",
        ("source",),
        "exporter",
        ANYWHERE,
    ),
    Family(
        "gpumem_exporter_source_duration_seconds",
        "gauge",
        "Wall time of the source's last read.",
        ("source",),
        "exporter",
        ANYWHERE,
        full_only=EVERYWHERE,
    ),
    Family(
        "gpumem_exporter_source_errors",
        "counter",
        "Failed reads of the source.",
        ("source",),
        "exporter",
        ANYWHERE,
    ),
    Family(
        "gpumem_exporter_source_unavailable",
        "info",
        "A source with nothing to read on this host, and why (no NVML library, no driver, "
        "no GPU): no data, not a failure (its source_up stays 1).",
        ("source",),
        "exporter",
        ANYWHERE,
        info_labels=("reason",),
    ),
    Family(
        "gpumem_exporter_alert_firing",
        "gauge",
        "1 while the in-process detector for the alert is firing; labels name what it "
        "is about (device: CUDA ordinal, gpu: NVML index, process labels).",
        ALERT_LABELS,
        "exporter",
        ANYWHERE,
    ),
    Family(
        "gpumem_exporter_allocator_settings_changes",
        "counter",
        "How often an allocator's live settings (torch_cuda_allocator_info with "
        "settings_source live) changed while its process ran, as the in-process detector "
        "saw them, once per layout read at most.",
        SETTINGS_CHANGE_LABELS,
        "exporter",
        ALLOCATOR,
    ),
    Family(
        "gpumem_exporter_allocator_settings_change",
        "info",
        "Each allocator setting's last change while its process ran: from what to what "
        "(labelled as torch_cuda_allocator_info labels it).",
        (*SETTINGS_CHANGE_LABELS, "setting"),
        "exporter",
        ALLOCATOR,
        info_labels=("from", "to"),
    ),
    Family(
        "gpumem_exporter_process",
        "info",
        "Each process this endpoint reports, by the labels its series carry, with its pid: "
        "series of a process with a rank or a role of its own carry no pid, so they keep "
        "their identity when the server restarts; join on these labels to find the pid.",
        ("rank", "local_rank", "role"),
        "agents",
        AGENTS,
        info_labels=("pid",),
    ),
    Family(
        "gpumem_exporter_agent_messages_rejected",
        "counter",
        "Messages from agents of `gpumem-exporter run` dropped as malformed, by reason.",
        ("reason",),
        "agents",
        AGENTS,
    ),
    Family(
        "gpumem_exporter_readings_over_budget",
        "gauge",
        "Readings left out of this scrape because a series budget is full (budget: "
        "per_process, an agent's allocators over 16; per_endpoint, all agents' allocators "
        "over 256, the first connected kept; host_processes, host-memory rows over 256, the "
        "largest kept). 0 while everything is served.",
        ("budget",),
        "exporter",
        BUDGETS,
    ),
    Family(
        "gpumem_exporter_snapshots",
        "counter",
        "Allocator snapshots written.",
        ("trigger",),
        "exporter",
        ALLOCATOR,
        per_process=True,
    ),
    Family(
        "torch_cuda_empty_cache_released_bytes",
        "counter",
        "Bytes returned to the driver by empty_cache calls of the exporter.",
        (),
        "exporter",
        ALLOCATOR,
        per_process=True,
    ),
    Family(
        "gpumem_exporter_remediations",
        "counter",
        "Automatic remediation actions by outcome.",
        ("action", "outcome"),
        "exporter",
        ALLOCATOR,
        per_process=True,
    ),
    Family(
        "gpumem_exporter_helper_restarts",
        "counter",
        "Helper processes a process's probe started again after the one serving it died "
        "(exporter.start()); served once a process has started one.",
        (),
        "exporter",
        AGENTS,
        per_process=True,
    ),
    Family(
        "gpumem_exporter_component_problems",
        "gauge",
        "What the memory ledger could not take as the server named it: overflowed (names "
        "past the bound, their bytes in other_named), negative_growth (blocks that freed more "
        "than they allocated), reentered (a component entered while open: not measured "
        "again), open (blocks entered and not left yet); served where one happened.",
        ("problem",),
        "exporter",
        ALLOCATOR,
        per_process=True,
    ),
    Family(
        "gpumem_exporter_probe_records_dropped",
        "counter",
        "Allocator records a process under `gpumem-exporter run` dropped because the "
        "launcher's socket had no room (the probe never blocks its host to send one); "
        "served once a process has dropped one.",
        (),
        "exporter",
        AGENTS,
        per_process=True,
    ),
    Family(
        "gpumem_exporter_agent_last_report_timestamp_seconds",
        "gauge",
        "Unix time of each process's last report to the launcher of `gpumem-exporter run`. A "
        "process silent for longer than max(3 intervals, 5 s) (stopped, or hung holding its "
        "GIL) has its allocator series withdrawn and /readyz names it: "
        "time() - this > 10 finds it.",
        (),
        "exporter",
        AGENTS,
        per_process=True,
    ),
    Family(
        "gpumem_exporter_admin_requests",
        "counter",
        "Admin API requests by action and outcome.",
        ("action", "outcome"),
        "exporter",
        ANYWHERE,
    ),
    Family(
        "gpumem_exporter_render_failures",
        "counter",
        "/metrics answers that failed to render (each a 500, logged once while it lasts; "
        "/healthz says failing until one renders). Served once one has failed.",
        (),
        "exporter",
        ANYWHERE,
    ),
    Family(
        "gpumem_exporter_web",
        "info",
        "The endpoint's security: TLS, client certificates, basic auth, how admin callers are "
        "identified (admin_auth: token, kubernetes or both where configured; none: admin "
        "actions off; open: the demo's), and whether admin credentials are accepted over "
        "plain HTTP from other hosts (admin_cleartext: loopback-only, allowed, or n/a with "
        "TLS).",
        ("tls", "client_auth", "basic_auth", "admin_auth", "admin_cleartext"),
        "exporter",
        ANYWHERE,
    ),
    Family(
        "gpumem_exporter_web_config_last_reload_successful",
        "gauge",
        "Whether the last reading of the web config file (or a file it names) could be used; "
        "0: the last good one is still served.",
        (),
        "exporter",
        ANYWHERE,
    ),
    Family(
        "gpumem_exporter_web_config_last_reload_success_timestamp_seconds",
        "gauge",
        "Unix time of the last successful reading of the web config file.",
        (),
        "exporter",
        ANYWHERE,
    ),
    Family(
        "gpumem_exporter_tls_certificate_expiry_timestamp_seconds",
        "gauge",
        "notAfter of the TLS certificate the endpoint serves, as Unix time.",
        (),
        "exporter",
        ANYWHERE,
    ),
    Family(
        "gpumem_exporter_last_sample_timestamp_seconds",
        "gauge",
        "Unix time of the last completed sample.",
        (),
        "exporter",
        ANYWHERE,
    ),
    # -- the caching allocator: memory_stats, every tick -------------------------------------
    _allocator(
        "gauge",
        "allocator_gauge",
        "allocated_bytes",
        "Bytes of live tensors held by the CUDA caching allocator.",
    ),
    _allocator(
        "gauge",
        "allocator_gauge",
        "reserved_bytes",
        "Bytes the caching allocator holds from the driver (allocated plus cache).",
    ),
    _allocator(
        "gauge",
        "allocator_gauge",
        "active_bytes",
        "Allocated bytes plus freed blocks still in use by a stream.",
    ),
    _allocator(
        "gauge",
        "allocator_gauge",
        "inactive_split_bytes",
        "Free bytes inside partly used segments (fragmentation).",
    ),
    _allocator(
        "gauge",
        "allocator_gauge",
        "requested_bytes",
        "Bytes callers asked for, before the allocator's rounding.",
    ),
    _allocator(
        "gauge",
        "allocator_gauge",
        "allocated_peak_bytes",
        "Peak allocated bytes since the process last reset peaks.",
    ),
    _allocator(
        "gauge",
        "allocator_gauge",
        "reserved_peak_bytes",
        "Peak reserved bytes since the process last reset peaks.",
    ),
    _allocator(
        "gauge",
        "allocator_gauge",
        "segments",
        "Segments (cudaMalloc'd regions) the allocator holds.",
    ),
    _allocator("gauge", "allocator_gauge", "allocations", "Live allocations."),
    _allocator(
        "gauge",
        "allocator_gauge",
        "memory_limit_bytes",
        "Most bytes the caching allocator may reserve on the device: "
        "torch.cuda.set_per_process_memory_fraction times the device's memory (the device's "
        "memory when no fraction is set). Requests past it raise out-of-memory errors.",
    ),
    _allocator(
        "counter",
        "allocator_counter",
        "alloc_retries",
        "Allocations that failed, flushed the cache and were retried.",
    ),
    _allocator(
        "counter",
        "allocator_counter",
        "ooms",
        "Out-of-memory errors raised by the allocator.",
    ),
    _allocator(
        "counter",
        "allocator_counter",
        "device_malloc",
        "Device allocations (cudaMalloc, or cuMemMap with expandable segments).",
    ),
    _allocator(
        "counter",
        "allocator_counter",
        "device_free",
        "Device frees (cudaFree, or cuMemUnmap with expandable segments).",
    ),
    _allocator(
        "counter",
        "allocator_counter",
        "sync_all_streams",
        "Full stream synchronisations (each empty_cache counts one).",
    ),
    *(
        _allocator(
            "gauge",
            "pool",
            key,
            f"Per pool: {help}",
            name=f"torch_cuda_pool_{key}",
            labels=("pool",),
            full_only=EVERYWHERE,
        )
        for key, help in (
            ("allocated_bytes", "Bytes of live tensors held by the CUDA caching allocator."),
            (
                "reserved_bytes",
                "Bytes the caching allocator holds from the driver (allocated plus cache).",
            ),
            ("active_bytes", "Allocated bytes plus freed blocks still in use by a stream."),
            ("inactive_split_bytes", "Free bytes inside partly used segments (fragmentation)."),
            ("requested_bytes", "Bytes callers asked for, before the allocator's rounding."),
        )
    ),
    _allocator(
        "gauge",
        "ratio",
        "fragmentation_ratio",
        "inactive_split / reserved; only where the allocator tracks inactive_split.",
    ),
    _allocator(
        "gauge",
        "ratio",
        "cached_free_ratio",
        "(reserved - allocated) / reserved: cache held but not used by tensors.",
    ),
    _allocator(
        "gauge",
        "non_allocator",
        "non_allocator_bytes",
        "GPU memory of this process outside the caching allocator (NVML used - reserved): "
        "CUDA context, NCCL, library workspaces. Taken only from readings of one moment.",
    ),
    _allocator(
        "gauge",
        "non_allocator",
        "non_allocator_age_s",
        "Age of torch_cuda_non_allocator_bytes at this tick: it is taken again whenever "
        "the process's memory moves, and kept while its readings disagree.",
        name="torch_cuda_non_allocator_age_seconds",
        full_only=EVERYWHERE,
    ),
    # -- out-of-memory verdicts: taken in PyTorch's OOM observer (exporter/oom_verdict.py) ---
    _allocator(
        "counter",
        "oom",
        "ooms_by_verdict",
        "Out-of-memory errors by the verdict taken at each (fragmentation, pools, cap, "
        "other_processes, outside_allocator, exhaustion, unknown; "
        "docs/runbooks.md#out-of-memory-verdicts).",
        labels=("verdict",),
    ),
    _allocator(
        "gauge",
        "oom",
        "last_timestamp",
        "Unix time of the device's latest out-of-memory error, labelled with its verdict.",
        name="torch_cuda_oom_last_timestamp_seconds",
        labels=("verdict",),
    ),
    _allocator(
        "gauge",
        "oom",
        "last_bytes",
        "The readings that decided the latest out-of-memory verdict, taken in the OOM "
        "observer: requested, free_in_holes, largest_free_block, allocated, reserved, "
        "cap_room, device_free, other_processes, private_pools_free, outside_allocator.",
        name="torch_cuda_oom_last_bytes",
        labels=("reading",),
        # Eight series a device after an OOM: past a fleet's budget (the page, `why` and
        # /stats carry them at every level; the demo, one process, serves them).
        full_only=OWN_PROCESS,
    ),
    # -- the memory ledger: what the server named, and where every byte goes (exporter.ledger)
    _allocator(
        "gauge",
        "component",
        "components",
        "Bytes the server named as this component (exporter.component(): the allocator's "
        "growth inside the block; set_component(): the size it gave), as it said them; "
        "torch_cuda_memory_ledger_bytes cuts them to what is still allocated.",
        name="torch_cuda_component_bytes",
        labels=("component",),
        full_only=EVERYWHERE,
    ),
    _allocator(
        "gauge",
        "ledger",
        "ledger",
        "Where this process's memory on the GPU goes: each named component, private_pools "
        "(live in CUDA graphs' and MemPools' pools), other_live (the rest of allocated), "
        "cached_free (reserved - allocated) and outside_allocator (NVML's per-process used - "
        "reserved); the parts sum to NVML's per-process used (docs/metrics.md, the ledger).",
        name="torch_cuda_memory_ledger_bytes",
        labels=("component",),
        # Four or more series a device: past a fleet's budget of 40 a GPU at the basic level
        # (39.1 on a TP=8 node, tests/test_fleet_budget.py). The live page, `why` and /stats
        # carry the ledger at every level; its four parts of an unmodified server are the
        # allocated, reserved and non-allocator series there.
        full_only=EVERYWHERE,
    ),
    # -- the allocator's layout: a segments-only snapshot, every few seconds ----------------
    _allocator(
        "gauge",
        "layout",
        "largest_free_block_bytes",
        "Biggest free block in the default pool's cache: the biggest request that fits "
        "without a new cudaMalloc (or cuMemMap with expandable segments). " + _LAYOUT,
    ),
    _allocator(
        "gauge",
        "layout",
        "default_pool_free_bytes",
        "Free bytes cached in the default pool: what ordinary allocations can reuse. From an "
        "allocator snapshot.",
    ),
    _allocator(
        "gauge",
        "layout",
        "free_in_used_segments_bytes",
        "Free bytes inside segments that also hold live blocks, in every pool: "
        "fragmentation, defined with expandable segments too (there inactive_split_bytes is "
        "not tracked). From an allocator snapshot.",
    ),
    _allocator(
        "gauge",
        "layout_state",
        "layout_age_s",
        "Age of the allocator snapshot behind the layout families (largest free block, "
        "private pool allocated bytes) at this tick.",
        name="torch_cuda_layout_age_seconds",
    ),
    Family(
        "torch_cuda_layout_skipped",
        "info",
        "Why the latest allocator snapshot was not taken (too_many_blocks: it would stall "
        "the serving thread; history_recording: it would build every block's stack).",
        ALLOCATOR_LABELS,
        "torch",
        ALLOCATOR,
        "layout_state",
        "layout_skipped",
        per_process=True,
        info_labels=("reason",),
    ),
    _allocator(
        "gauge",
        "private_pool",
        "reserved_bytes",
        "Bytes reserved by one private pool (a CUDA graph's or a MemPool's): part of "
        "reserved_bytes that ordinary allocations cannot reuse.",
        name="torch_cuda_private_pool_reserved_bytes",
        labels=("pool_id",),
        full_only=EVERYWHERE,
    ),
    _allocator(
        "gauge",
        "private_pool",
        "allocated_bytes",
        "Bytes of live tensors in one private pool (from an allocator snapshot).",
        name="torch_cuda_private_pool_allocated_bytes",
        labels=("pool_id",),
        full_only=EVERYWHERE,
    ),
    Family(
        "torch_cuda_private_pool",
        "info",
        "What one private pool is: kind graph (a CUDA graph's) or mempool (a torch.cuda.MemPool, "
        "or a shared graph pool the server did not name), and the name the server gave it "
        "(exporter.name_pool); joins torch_cuda_private_pool_*_bytes by pool_id.",
        (*ALLOCATOR_LABELS, "pool_id"),
        "torch",
        ALLOCATOR,
        "private_pool_info",
        "private_pool_info",
        per_process=True,
        info_labels=("kind", "name"),
        full_only=EVERYWHERE,
    ),
    Family(
        "torch_cuda_allocator",
        "info",
        "CUDA caching allocator settings (settings_source: live when the allocator "
        "reported them, else environment).",
        ALLOCATOR_LABELS,
        "torch",
        ALLOCATOR,
        per_process=True,
        info_labels=(
            "backend",
            "expandable_segments",
            "max_split_size_bytes",
            "garbage_collection_threshold",
            "settings_source",
            "torch_version",
        ),
    ),
    # -- PyTorch's caching host allocator (pinned memory), per process -----------------------
    Family(
        "torch_cuda_pinned_host_bytes",
        "gauge",
        "Page-locked host memory held by PyTorch's caching host allocator (in use or cached): "
        "host RAM that cannot be swapped out.",
        (),
        "torch",
        ALLOCATOR,
        "pinned_host",
        "held_bytes",
        per_process=True,
    ),
    Family(
        "torch_cuda_pinned_host_in_use_bytes",
        "gauge",
        "Pinned host blocks handed out and not yet reusable (updated when the host allocator "
        "next processes its events, so it can lag a free).",
        (),
        "torch",
        ALLOCATOR,
        "pinned_host",
        "in_use_bytes",
        per_process=True,
        full_only=EVERYWHERE,
    ),
    Family(
        "torch_cuda_pinned_host_cached_bytes",
        "gauge",
        "Pinned host memory cached for reuse: held minus in use.",
        (),
        "torch",
        ALLOCATOR,
        "pinned_host",
        "cached_bytes",
        per_process=True,
        full_only=EVERYWHERE,
    ),
    # -- NVML ------------------------------------------------------------------------------
    Family(
        "gpu_memory_total_bytes",
        "gauge",
        "Memory of the GPU that processes can use (NVML).",
        GPU_LABELS,
        "nvml",
        DEVICES,
        "gpu_memory",
        "total_bytes",
    ),
    Family(
        "gpu_memory_used_bytes",
        "gauge",
        "GPU memory in use by every process on the GPU, CUDA contexts included (NVML).",
        GPU_LABELS,
        "nvml",
        DEVICES,
        "gpu_memory",
        "used_bytes",
    ),
    Family(
        "gpu_memory_free_bytes",
        "gauge",
        "GPU memory no process holds (NVML).",
        GPU_LABELS,
        "nvml",
        DEVICES,
        "gpu_memory",
        "free_bytes",
    ),
    Family(
        "gpu_memory_driver_reserved_bytes",
        "gauge",
        "GPU memory the driver and firmware keep for themselves: never available to "
        "processes (NVML memory info v2).",
        GPU_LABELS,
        "nvml",
        DEVICES,
        "gpu_memory",
        "driver_reserved_bytes",
        full_only=EVERYWHERE,
    ),
    Family(
        "gpu_process_memory_used_bytes",
        "gauge",
        "GPU memory used by a process (NVML; host PIDs).",
        (*GPU_LABELS, "pid"),
        "nvml",
        DEVICES,
        key="used_bytes",
        full_only=EVERYWHERE,
    ),
    # MIG: one row per GPU instance (its compute instances share its memory: counted once),
    # joined to the whole GPU's series by gpu_uuid; present only where MIG is on.
    Family(
        "gpu_mig_memory_total_bytes",
        "gauge",
        "Memory of a MIG GPU instance (NVML, through one of its MIG devices).",
        MIG_LABELS,
        "nvml",
        DEVICES,
        "gpu_mig_memory",
        "total_bytes",
    ),
    Family(
        "gpu_mig_memory_used_bytes",
        "gauge",
        "Memory in use in a MIG GPU instance, by its processes and what no process owns "
        "(NVML; its compute instances share it: counted once).",
        MIG_LABELS,
        "nvml",
        DEVICES,
        "gpu_mig_memory",
        "used_bytes",
    ),
    Family(
        "gpu_mig_memory_free_bytes",
        "gauge",
        "Memory of a MIG GPU instance that nothing holds (NVML).",
        MIG_LABELS,
        "nvml",
        DEVICES,
        "gpu_mig_memory",
        "free_bytes",
    ),
    Family(
        "gpu_mig_non_process_memory_bytes",
        "gauge",
        "Memory in use in a MIG GPU instance that none of its processes holds: used minus "
        "what NVML's process list gives the processes running in it.",
        MIG_LABELS,
        "nvml",
        DEVICES,
        key="non_process_bytes",
    ),
    Family(
        "gpu_mig_device",
        "info",
        "A MIG device (one compute instance) and the GPU instance whose memory it shares: "
        "what device plugins assign to pods by its UUID.",
        (*GPU_LABELS, "gpu_instance", "mig_uuid"),
        "nvml",
        DEVICES,
        info_labels=("profile",),
    ),
    Family(
        "gpu_up",
        "gauge",
        "1 while NVML answers for the GPU; 0 when lost or refused.",
        GPU_LABELS,
        "nvml",
        DEVICES,
        key="up",
    ),
    Family(
        "gpu_mig_mode",
        "info",
        "MIG mode of a GPU where it is on or about to change (NVML): a pending mode other "
        "than the current one takes effect after a GPU reset.",
        GPU_LABELS,
        "nvml",
        DEVICES,
        info_labels=("current", "pending"),
    ),
    Family(
        "gpu_memory_unavailable",
        "info",
        "Why the GPU's own memory series are absent while NVML answers for it: inside a "
        "container given a MIG slice, NVML refuses the whole GPU's memory (its instance's "
        "memory is in gpu_mig_memory_*).",
        GPU_LABELS,
        "nvml",
        DEVICES,
        info_labels=("reason",),
    ),
    Family(
        "gpu",
        "info",
        "GPU identity from NVML.",
        GPU_LABELS,
        "nvml",
        DEVICES,
        info_labels=("name", "driver_version", "pci_bus_id"),
    ),
    # -- Kubernetes attribution (node daemon) ----------------------------------------------
    Family(
        "gpumem_exporter_kubelet_up",
        "gauge",
        "1 if the latest List of the kubelet's pod-resources API succeeded.",
        (),
        "kubelet",
        KUBERNETES,
    ),
    Family(
        "gpumem_exporter_kubelet_refresh_errors",
        "counter",
        "Failed Lists of the kubelet's pod-resources API.",
        (),
        "kubelet",
        KUBERNETES,
    ),
    Family(
        "gpumem_exporter_kubelet_last_success_timestamp_seconds",
        "gauge",
        "Unix time of the latest successful List: the age of the attribution.",
        (),
        "kubelet",
        KUBERNETES,
    ),
    Family(
        "gpumem_exporter_kubelet_error",
        "info",
        "Why the latest List of the kubelet's pod-resources API failed.",
        (),
        "kubelet",
        KUBERNETES,
        info_labels=("error", "socket"),
    ),
    Family(
        "gpumem_exporter_pods_api_up",
        "gauge",
        "1 if the latest list of this node's pods from the Kubernetes API succeeded "
        "(the pod reader names processes on shared GPUs).",
        (),
        "kubelet",
        KUBERNETES,
    ),
    Family(
        "gpumem_exporter_pods_api_error",
        "info",
        "Why the latest list of this node's pods from the Kubernetes API failed.",
        (),
        "kubelet",
        KUBERNETES,
        info_labels=("error",),
    ),
    Family(
        "gpumem_exporter_kubelet_container_logs_error",
        "info",
        "Why the latest read of the kubelet's container log links (/var/log/containers, which "
        "name each GPU process's pod and container from its cgroup) failed; absent while "
        "they are read. Without them (and without the pod reader) processes keep their pod "
        "UIDs alone.",
        (),
        "kubelet",
        KUBERNETES,
        info_labels=("error", "folder"),
    ),
    Family(
        "gpu_pod_info",
        "gauge",
        "1 for each container the kubelet assigned a GPU to (gpu_uuid: the NVML GPU the "
        "device is on, empty where none matches), whether or not NVML sees that GPU.",
        ("gpu_uuid", "device_id", "resource", "namespace", "pod", "container"),
        "kubelet",
        KUBERNETES,
    ),
    Family(
        "gpu_pod_mig_instance",
        "info",
        "Each container the kubelet assigned a MIG device to, with the GPU instance it is in "
        "(the device plugin's MIG-<uuid>; NVIDIA's DRA name where its GPU has one instance of "
        "that profile): joins gpu_mig_memory_* by gpu_uuid and gpu_instance.",
        ("gpu_uuid", "gpu_instance", "device_id", "namespace", "pod", "container"),
        "kubelet",
        KUBERNETES,
    ),
    Family(
        "gpu_dra_claim_info",
        "gauge",
        "1 for each device a ResourceClaim gave a pod's container (Dynamic Resource "
        "Allocation, as the kubelet's pod-resources API reports it): the claim, the driver's "
        "pool and device names, and share_id where several claims share the device. Its "
        "gpu_pod_info row has resource=<driver>, device_id=<device>.",
        (
            "gpu_uuid",
            "namespace",
            "pod",
            "container",
            "claim",
            "claim_namespace",
            "driver",
            "pool",
            "device",
            "share_id",
        ),
        "kubelet",
        KUBERNETES,
    ),
    Family(
        "gpu_dra_claim_memory_claimed_bytes",
        "gauge",
        "GPU memory a ResourceClaim consumed of a GPU several claims share (its allocation's "
        "consumedCapacity memory; with the claim reader).",
        (*GPU_LABELS, "claim_namespace", "claim", "share_id"),
        "kubelet",
        KUBERNETES,
    ),
    Family(
        "gpu_dra_claim_memory_used_bytes",
        "gauge",
        "GPU memory the processes of a ResourceClaim's container use on the GPU it shares "
        "(with the claim reader and the pod reader, which names processes on shared GPUs). "
        "Above gpu_dra_claim_memory_claimed_bytes the claim starves its neighbours.",
        (*GPU_LABELS, "claim_namespace", "claim", "share_id"),
        "kubelet",
        KUBERNETES,
    ),
    Family(
        "gpumem_exporter_claims_api_up",
        "gauge",
        "1 if the latest list of this node's ResourceClaims from the Kubernetes API "
        "succeeded (the claim reader).",
        (),
        "kubelet",
        KUBERNETES,
    ),
    Family(
        "gpumem_exporter_claims_api_error",
        "info",
        "Why the latest list of this node's ResourceClaims from the Kubernetes API failed.",
        (),
        "kubelet",
        KUBERNETES,
        info_labels=("error",),
    ),
    Family(
        "gpu_process_container_info",
        "gauge",
        "1 for each GPU process in a pod: its pod UID and container ID (from its cgroup).",
        ("pid", "pod_uid", "container_id"),
        "kubelet",
        KUBERNETES,
        full_only=EVERYWHERE,
    ),
    Family(
        "gpu_process_pod_info",
        "gauge",
        "1 for each GPU process whose pod is certain: its cgroup's pod UID and container ID "
        "as the kubelet's container log links or the Kubernetes API (pod reader) name them.",
        ("pid", "namespace", "pod", "container"),
        "kubelet",
        KUBERNETES,
        full_only=EVERYWHERE,
    ),
    Family(
        "gpu_memory_unattributed_bytes",
        "gauge",
        "GPU memory that no pod holding the GPU owns: the whole GPU's used memory where no "
        "pod holds it, else its processes in no pod.",
        GPU_LABELS,
        "kubelet",
        KUBERNETES,
    ),
    Family(
        "gpu_mig_memory_unattributed_bytes",
        "gauge",
        "Memory of a MIG GPU instance that no pod holding it owns: all of an instance no pod "
        "was given, else its processes their pod does not hold. On GPUs whose every "
        "assignment names its instance (the device plugin's MIG-<uuid>).",
        (*GPU_LABELS, "gpu_instance"),
        "kubelet",
        KUBERNETES,
    ),
    Family(
        "gpu_process_mig_instance",
        "info",
        "The MIG GPU instance a process runs in (NVML's process record): joins "
        "gpu_process_memory_used_bytes to gpu_mig_memory_* by gpu_uuid, pid and gpu_instance.",
        (*GPU_LABELS, "pid", "gpu_instance"),
        "nvml",
        DEVICES,
    ),
    Family(
        "gpu_container_memory_used_bytes",
        "gauge",
        "GPU memory used on one GPU by the processes of one container whose pod is certain "
        "(as gpu_process_pod_info says): per-process memory keyed by what survives a restart.",
        (*GPU_LABELS, "namespace", "pod", "container"),
        "kubelet",
        KUBERNETES,
    ),
    Family(
        "gpu_process_memory_unattributed_bytes",
        "gauge",
        "GPU memory of a process outside every pod that holds its GPU (reason: no_pod, "
        "not_assigned; listed but not counted as unattributed: unknown, its cgroup could not "
        "be read, and pending, a pod's process newer than the kubelet's latest answer).",
        (*GPU_LABELS, "pid", "reason"),
        "kubelet",
        KUBERNETES,
    ),
    # -- host memory -----------------------------------------------------------------------
    Family(
        "host_process_resident_memory_bytes",
        "gauge",
        "Resident host memory of one process of the server (VmRSS), pinned buffers included.",
        HOST_PROCESS_LABELS,
        "process_memory",
        HOST_PROCESSES,
        "host_process",
        "resident_bytes",
        full_only=GPU_PROCESSES,
    ),
    Family(
        "host_process_resident_memory_peak_bytes",
        "gauge",
        "Peak resident host memory of one process of the server (VmHWM), never below its "
        "current resident memory.",
        HOST_PROCESS_LABELS,
        "process_memory",
        HOST_PROCESSES,
        "host_process",
        "resident_peak_bytes",
        full_only=GPU_PROCESSES,
    ),
    Family(
        "host_process_swap_bytes",
        "gauge",
        "Host memory of one process of the server swapped out (VmSwap).",
        HOST_PROCESS_LABELS,
        "process_memory",
        HOST_PROCESSES,
        "host_process",
        "swap_bytes",
        full_only=GPU_PROCESSES,
    ),
    Family(
        "host_memory_total_bytes",
        "gauge",
        "Physical memory of the host (MemTotal in /proc/meminfo).",
        (),
        "host",
        HOST,
        "machine_host",
        "total_bytes",
    ),
    Family(
        "host_memory_available_bytes",
        "gauge",
        "Memory the host can give to new work without swapping (MemAvailable): what is left "
        "for pinned buffers, data loaders and the next process.",
        (),
        "host",
        HOST,
        "machine_host",
        "available_bytes",
    ),
    Family(
        "host_swap_total_bytes",
        "gauge",
        "Swap space configured on the host.",
        (),
        "host",
        HOST,
        "machine_host",
        "swap_total_bytes",
    ),
    Family(
        "host_swap_used_bytes",
        "gauge",
        "Swap space in use on the host; pages of a serving process swapped out make its "
        "requests slow.",
        (),
        "host",
        HOST,
        "machine_host",
        "swap_used_bytes",
    ),
    # Live modes also serve the peak of the exporter's own process, beside client_python's
    # process_resident_memory_bytes. A replay never does: `process_` names belong to the
    # process that serves them, and the recorded process is served as host_process_*.
    Family(
        "process_resident_memory_peak_bytes",
        "gauge",
        "Peak resident memory of this process (ru_maxrss), never below its current "
        "process_resident_memory_bytes.",
        (),
        "host",
        OWN_PROCESS,
        "own_process_host",
        "process_resident_peak_bytes",
    ),
)

BY_NAME = {family.name: family for family in FAMILIES}


def deprecated_names(families: tuple[Family, ...]) -> dict[str, tuple[Family, ...]]:
    """Replacement's name -> the deprecated families served beside it with its samples."""
    found: dict[str, tuple[Family, ...]] = {}
    for entry in families:
        if entry.replaced_by:
            found[entry.replaced_by] = (*found.get(entry.replaced_by, ()), entry)
    return found


DEPRECATED = deprecated_names(FAMILIES)


def family(name: str) -> Family:
    """The declared family of this name (KeyError for one not declared)."""
    return BY_NAME[name]


def group(name: str) -> tuple[Family, ...]:
    """The families of one group, in declaration order."""
    found = tuple(f for f in FAMILIES if f.group == name)
    if not found:
        raise KeyError(name)
    return found


def keys(name: str) -> tuple[str, ...]:
    """The reading fields of one group, in declaration order."""
    return tuple(f.key for f in group(name))


# -- docs/metrics.md (written by exporter.reference) ----------------------------------------


def deprecation(entry: Family) -> str:
    """What the docs say first of a deprecated family."""
    if not entry.replaced_by:
        return ""
    return f"Deprecated since {entry.deprecated_since}: use `{entry.replaced_by}`. "


def markdown_table(modes: Mapping[str, Collection[str]]) -> str:
    """Every family as one row: what a scrape shows, its labels and the modes that serve it
    (`modes`: each mode's name and what it has, exporter.modes; exporter.reference passes
    them, since the modes sit above this table)."""
    rows = [
        "| family | type | labels | modes | source | help |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for entry in FAMILIES:
        labels = [f"`{name}`" for name in entry.labels]
        if entry.per_process:
            labels.append("process labels under `run`")
        labels += [f"`{name}` (value)" for name in entry.info_labels]
        serving = [name for name, has in modes.items() if entry.served(has)]
        full_only = [name for name in serving if entry.full_only_in(modes[name])]
        words = "every mode" if len(serving) == len(modes) else ", ".join(serving)
        if full_only:
            detail = ", ".join(full_only)
            words += (
                " (full detail only)"
                if full_only == serving
                else f" (full detail only in {detail})"
            )
        cells = (
            f"`{entry.exposed}`",
            entry.kind,
            ", ".join(labels),
            words,
            entry.source,
            deprecation(entry) + entry.help.replace("|", "\\|"),
        )
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
