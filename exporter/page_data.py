"""What the live page shows of a sample, as JSON-ready rows: its processes, each GPU's ledger,
the OOM banner's verdicts, host memory, and a firing alert's note in words.

Plain functions of a sample (no HTTP, no clock): exporter.http.page serves them in
`/api/window`, and the page's tests build them from recorded samples.
"""

from __future__ import annotations

from typing import Any

from exporter.ledger import ledger
from exporter.oom_verdict import retry_pressure
from exporter.sample import Sample

# Rows of the process table: a node daemon may see every process of a busy node.
MAX_PROCESS_ROWS = 256
# OOM verdicts in the page's banner (the newest first): one per process and device.
MAX_OOM_ROWS = 16


def host_row(sample: Sample | None) -> dict[str, int] | None:
    if sample is None or sample.host is None:
        return None
    host = sample.host
    return {
        "total_bytes": host.total_bytes,
        "available_bytes": host.available_bytes,
        "swap_total_bytes": host.swap_total_bytes,
        "swap_used_bytes": host.swap_used_bytes,
    }


def alert_note(sample: Sample | None, alert: str, labels: dict[str, str]) -> str:
    """What a firing alert's process shows now, in words: for allocation retries, whether
    fragmentation or the cap is building (exporter.oom_verdict.retry_pressure)."""
    if alert != "GpuMemAllocRetries" or sample is None:
        return ""
    for reading in sample.allocators:
        ids = {"device": str(reading.device), "gpu_uuid": reading.gpu_uuid, **reading.process}
        if all(ids.get(name, "") == value for name, value in labels.items()):
            return retry_pressure(
                reading.layout.get("free_in_used_segments_bytes"),
                reading.layout.get("largest_free_block_bytes"),
                reading.gauges.get("reserved_bytes"),
                reading.gauges.get("memory_limit_bytes"),
                reading.last_oom,
            )
    return ""


def in_words(seconds: float) -> str:
    """10 min, 90 s, 2 h: a window as the page says it."""
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


def oom_rows(
    sample: Sample, runbook: str, pending: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The latest OOM of each process and device that had one, newest first: its verdict with
    the deciding numbers and the action (exporter/oom_verdict.py), for the page's banner; an
    OOM whose verdict is not in yet (exporter.oom_pending) comes first, as pending."""
    latest: list[tuple[float, dict[str, Any]]] = [
        (row["since"], {**row, "pending": True, "runbook_url": runbook}) for row in pending or []
    ]
    for reading in sample.allocators:
        last = reading.last_oom
        if last is None:
            continue
        pid = sample.allocator_pid(reading)
        latest.append(
            (
                last.timestamp,
                {
                    "pid": pid,
                    "rank": reading.process.get("rank", ""),
                    "role": reading.process.get("role", ""),
                    "device": reading.device,
                    "gpu_uuid": reading.gpu_uuid,
                    "ooms": reading.counters.get("ooms"),
                    "ooms_by_verdict": dict(reading.ooms_by_verdict),
                    "verdict": last.to_dict(),
                    "runbook_url": runbook,
                },
            )
        )
    latest.sort(key=lambda entry: -entry[0])
    return [row for _, row in latest[:MAX_OOM_ROWS]]


def ledger_rows(sample: Sample) -> dict[str, list[list[Any]]]:
    """Per GPU (the window's key: its UUID, or cuda:N) the latest sample's ledger, its
    processes' parts summed by name in ledger order: [[part, bytes], ...]."""
    found: dict[str, dict[str, int]] = {}
    for reading in sample.allocators:
        parts = found.setdefault(reading.gpu_uuid or f"cuda:{reading.device}", {})
        for part, nbytes in ledger(reading):
            parts[part] = parts.get(part, 0) + nbytes
    return {key: [[part, nbytes] for part, nbytes in parts.items()] for key, parts in found.items()}


def process_rows(sample: Sample) -> list[dict[str, Any]]:
    """One row per process: its GPU memory (NVML, and its allocators where it has them) and
    its host memory. Under `run` the allocators carry the process labels; elsewhere the one
    allocator process is the sample's own (`self_pid`, the recorded one in a replay)."""
    rows: dict[int, dict[str, Any]] = {}

    def row(pid: int) -> dict[str, Any]:
        if pid not in rows:
            rows[pid] = {
                "pid": pid,
                "role": "",
                "rank": "",
                "gpus": [],
                "gpu_used_bytes": None,
                "allocated_bytes": None,
                "reserved_bytes": None,
                "host_resident_bytes": None,
                "host_resident_peak_bytes": None,
                "host_swap_bytes": None,
            }
        return rows[pid]

    def add(entry: dict[str, Any], name: str, value: int | None) -> None:
        if value is not None:
            entry[name] = (entry[name] or 0) + value

    def on_gpu(entry: dict[str, Any], key: str) -> None:
        if key not in entry["gpus"]:
            entry["gpus"].append(key)

    for reading in sample.allocators:
        pid = sample.allocator_pid(reading)
        if pid is None:
            continue
        entry = row(pid)
        entry["role"] = reading.process.get("role", "") or entry["role"]
        entry["rank"] = reading.process.get("rank", "") or entry["rank"]
        on_gpu(entry, reading.gpu_uuid or f"cuda:{reading.device}")
        add(entry, "allocated_bytes", reading.gauges.get("allocated_bytes"))
        add(entry, "reserved_bytes", reading.gauges.get("reserved_bytes"))
    for process in sample.processes:
        entry = row(process.pid)
        on_gpu(entry, process.gpu_uuid)
        add(entry, "gpu_used_bytes", process.used_bytes)
    for host_process in sample.host_processes:
        entry = row(host_process.pid)
        entry["role"] = host_process.role or entry["role"]
        entry["rank"] = host_process.rank or entry["rank"]
        entry["host_resident_bytes"] = host_process.resident_bytes
        entry["host_resident_peak_bytes"] = host_process.resident_peak_bytes
        entry["host_swap_bytes"] = host_process.swap_bytes
    own = rows.get(sample.self_pid) if sample.self_pid is not None else None
    if own is not None and own["host_resident_bytes"] is None and sample.host is not None:
        # Outside `run` the exporter's own process is the allocator's: its resident memory.
        own["host_resident_bytes"] = sample.host.process_resident_bytes
        own["host_resident_peak_bytes"] = sample.host.process_resident_peak_bytes
    ordered = sorted(
        rows.values(),
        key=lambda r: (-(r["gpu_used_bytes"] or r["reserved_bytes"] or 0), r["pid"]),
    )
    return ordered[:MAX_PROCESS_ROWS]
