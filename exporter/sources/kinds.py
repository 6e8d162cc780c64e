"""Every kind of source, declared once: what it provides (exporter.sources), the setting that
turns it on, and how it is made from the config and the sources made before it in the same
tick. A mode names what it reads (exporter.modes: Mode.reads); the kinds that provide it are
made, in this table's order; a kind that needs another's reading finds it by what that one
provides, never by its class.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exporter.config import Config
from exporter.sources import (
    ALLOCATOR,
    DEVICE_MEMORY,
    HOST_MEMORY,
    HOST_PROCESSES,
    KUBERNETES,
    OOM_VERDICTS,
    PROCESS_MEMORY,
    Source,
    providing,
)

Made = Sequence[Source]
Users = Callable[[], Hashable] | None


@dataclass(frozen=True)
class SourceKind:
    name: str
    provides: frozenset[str]  # what its readings hold (exporter.sources), as its class says
    enabled: Callable[[Config], bool]
    # (config, the sources made before it, `run`'s reporting processes) -> the source, or
    # None where what it needs was not made.
    make: Callable[[Config, Made, Users], Source | None]


def allocator_source(config: Config) -> Source:
    """The allocator source the settings pick (`allocator_api`): also what each agent of
    `gpumem-exporter run` reads in its process."""
    from exporter.sources.non_allocator import NonAllocatorReader

    probe = NonAllocatorReader.for_config(config)
    if config.allocator_api == "accelerator":
        from exporter.sources.accelerator_allocator import AcceleratorAllocatorSource

        return AcceleratorAllocatorSource(non_allocator=probe)
    from exporter.sources.torch_allocator import TorchAllocatorSource

    return TorchAllocatorSource(
        layout_interval_s=config.layout_interval_s,
        layout_max_blocks=config.layout_max_blocks,
        non_allocator=probe,
    )


def _allocator(config: Config, made: Made, users: Users) -> Source:
    return allocator_source(config)


def _nvml(config: Config, made: Made, users: Users) -> Source:
    """`users` (under `run`: the reporting processes and their GPUs) makes NVML read its
    process list at once when it changes."""
    from exporter.sources.nvml import NvmlSource

    # Inside a server, only the GPUs this process uses (read after the allocator, in the
    # same tick): every GPU of the node in every process would be O(GPUs^2) series per
    # node. The node daemon and `run` read every GPU they can see.
    allocators: list[Any] = providing(made, ALLOCATOR)
    uuids = (lambda: allocators[0].uuids_in_use) if allocators else None
    # Why none is in use, in the allocator source's words (the torch source knows a CPU-only
    # torch; the accelerator source says nothing more).
    why_idle = (lambda: str(getattr(allocators[0], "idle_reason", ""))) if allocators else None
    return NvmlSource(
        only_uuids=uuids,
        process_interval_s=config.process_interval_s,
        users=users,
        why_idle=why_idle,
    )


def _host(config: Config, made: Made, users: Users) -> Source:
    from exporter.sources.host import HostMemorySource

    return HostMemorySource()


def gpu_pids(made: Iterable[Source]) -> Callable[[], Collection[int]] | None:
    """The host PIDs that held GPU memory at the latest read, where a source reads them."""
    readers: list[Any] = providing(made, PROCESS_MEMORY)
    return (lambda: readers[0].last_pids) if readers else None


def _gpu_processes(config: Config, made: Made, users: Users) -> Source | None:
    """Host memory of every process with GPU memory (host PIDs: the DaemonSet's hostPID)."""
    from exporter.sources.process_memory import ProcessMemorySource

    pids = gpu_pids(made)
    return ProcessMemorySource(pids) if pids is not None else None


def _kubelet(config: Config, made: Made, users: Users) -> Source | None:
    pids = gpu_pids(made)
    return kubelet_source(config, pids) if pids is not None else None


# In reading order: a tick reads NVML after the allocator, whose GPUs it reads.
SOURCE_KINDS = (
    SourceKind(
        "torch",
        frozenset({ALLOCATOR, OOM_VERDICTS}),
        lambda config: config.torch and config.allocator_api == "cuda",
        _allocator,
    ),
    SourceKind(
        "accelerator",
        frozenset({ALLOCATOR}),
        lambda config: config.torch and config.allocator_api == "accelerator",
        _allocator,
    ),
    SourceKind("nvml", frozenset({DEVICE_MEMORY, PROCESS_MEMORY}), lambda c: c.nvml, _nvml),
    SourceKind("host", frozenset({HOST_MEMORY}), lambda config: config.host_memory, _host),
    # What it reads (host_process_* at the node daemon) is served only at the full detail level.
    SourceKind(
        "process_memory",
        frozenset({HOST_PROCESSES}),
        lambda config: config.host_memory and config.detail == "full",
        _gpu_processes,
    ),
    SourceKind("kubelet", frozenset({KUBERNETES}), lambda c: c.kubelet_socket != "off", _kubelet),
)


def sources_for(reads: Collection[str], config: Config, *, gpu_users: Users = None) -> list[Source]:
    """The sources providing what a mode `reads`, as the config enables them."""
    made: list[Source] = []
    for kind in SOURCE_KINDS:
        if kind.provides & set(reads) and kind.enabled(config):
            source = kind.make(config, made, gpu_users)
            if source is not None:
                made.append(source)
    return made


def kubelet_source(
    config: Config, pids: Callable[[], Collection[int]], env: Mapping[str, str] = os.environ
) -> Source | None:
    """The node daemon's Kubernetes attribution, or None where it is off: "off", or no socket
    configured outside Kubernetes with no kubelet socket at the default path. Inside
    Kubernetes a missing socket is a state on /metrics, never a silent absence."""
    from exporter.kubernetes.podresources import DEFAULT_SOCKET

    socket = config.kubelet_socket
    if socket == "off":
        return None
    if not socket:
        if "KUBERNETES_SERVICE_HOST" not in env and not os.path.exists(DEFAULT_SOCKET):
            return None
        socket = DEFAULT_SOCKET
    from exporter.kubernetes.api import ApiServer
    from exporter.kubernetes.claims import ClaimsClient
    from exporter.kubernetes.pods import PodsClient
    from exporter.sources.kubelet import DEFAULT_RESOURCES, KubeletSource

    def pods() -> PodsClient:
        return PodsClient.in_cluster(
            env,
            timeout_s=config.kubelet_timeout_s,
            credentials=Path(config.kubernetes_service_account_dir),
        )

    def claims() -> ClaimsClient:
        api = ApiServer.in_cluster(
            env,
            credentials=Path(config.kubernetes_service_account_dir),
            deadline_s=config.kubelet_timeout_s,
        )
        return ClaimsClient(api, env.get("NODE_NAME", ""))

    return KubeletSource(
        pids,
        socket_path=socket,
        refresh_s=config.kubelet_refresh_s,
        timeout_s=config.kubelet_timeout_s,
        resources=(*DEFAULT_RESOURCES, *config.kubelet_resources),
        pods=pods if config.kubelet_pod_reader else None,
        claims=claims if config.kubelet_claim_reader else None,
        logs_folder="" if config.kubelet_container_logs == "off" else config.kubelet_container_logs,
    )
