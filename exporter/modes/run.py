"""`gpumem-exporter run -- CMD`: a launcher for every process of a server, an agent in each
(exporter.run)."""

from __future__ import annotations

from exporter import catalog, sources
from exporter.modes.mode import Mode, first_sample
from exporter.sampler import Sampler
from exporter.traits import Traits


def silent_processes(sampler: Sampler) -> list[str]:
    """The processes of `run` that stopped reporting (exporter.transport.aggregator), in words."""
    found = []
    for source in sampler.sources:
        silent = getattr(source, "silent_processes", None)
        if silent is None:
            continue
        for labels, quiet_s in silent():
            name = labels.get("role") or "process"
            found.append(f"pid {labels.get('pid', '?')} ({name}) silent for {quiet_s:.0f} s")
    return found


def every_process_reports(sampler: Sampler) -> str | None:
    """Ready once the first sample is in and while every process of the server reports; a
    stopped or hung one is named (its numbers are withdrawn meanwhile)."""
    reason = first_sample(sampler)
    if reason is not None:
        return reason
    silent = silent_processes(sampler)
    return "not every process reports: " + "; ".join(silent) if silent else None


MODE = Mode(
    Traits(
        "run",
        frozenset(
            {
                catalog.ALLOCATOR,
                catalog.DEVICES,
                catalog.HOST,
                catalog.OWN_PROCESS,
                catalog.AGENTS,
                catalog.BUDGETS,
                catalog.HOST_PROCESSES,
            }
        ),
        one_process=False,
    ),
    "`gpumem-exporter run -- CMD`: a launcher for every process of a server, an agent in each",
    "the launcher's HTTP server, one /metrics for every process",
    "each process of the server (or the one chosen), through its agent",
    "the first sample is in and every process reports (none silent for max(3 intervals, 5 s))",
    every_process_reports,
    None,  # the launcher passes its fan-out to the agents
    # Besides its agents (each reads its process's allocator) and its process tree.
    reads=(sources.DEVICE_MEMORY, sources.HOST_MEMORY),
)
