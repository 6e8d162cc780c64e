"""The node daemon, `gpumem-exporter serve`: NVML, host memory, Kubernetes."""

from __future__ import annotations

from exporter import catalog, sources
from exporter.modes.embedded import local_actions
from exporter.modes.mode import Mode
from exporter.sampler import Sampler
from exporter.traits import Traits


def blind_reason(sampler: Sampler) -> str | None:
    """Why a node daemon cannot see any GPU, or None while it sees one. It exists to read
    NVML: without it (no library, no driver, no GPU visible, a container without the NVIDIA
    runtime) it is not ready, whatever else it serves."""
    state = sampler.state()
    nvml = state.sources.get("nvml")
    if nvml is None:
        return "NVML is turned off (GPUMEM_NVML)"
    if state.sample is None:
        return "no sample yet"
    if nvml.unavailable:
        return f"NVML: {nvml.unavailable}"
    if not nvml.up:
        return f"NVML read failed: {nvml.last_error or 'unknown error'}"
    if not any(gpu.up for gpu in state.sample.gpus):
        return "no GPU answers NVML" if state.sample.gpus else "NVML lists no GPU"
    return None


MODE = Mode(
    Traits(
        "node",
        frozenset(
            {
                catalog.DEVICES,
                catalog.HOST,
                catalog.OWN_PROCESS,
                catalog.BUDGETS,
                catalog.HOST_PROCESSES,
                catalog.GPU_PROCESSES,
                catalog.KUBERNETES,
            }
        ),
    ),
    "the node daemon, `gpumem-exporter serve`: NVML, host memory, Kubernetes",
    "its own HTTP server",
    "its own process, which holds no allocator: actions answer 409",
    "NVML answers for a GPU (it exists to read NVML)",
    blind_reason,
    local_actions,
    reads=(
        sources.DEVICE_MEMORY,
        sources.HOST_MEMORY,
        sources.HOST_PROCESSES,
        sources.KUBERNETES,
    ),
)
