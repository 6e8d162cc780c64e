"""What the admin API's `/stats` answers: the latest sample as JSON with the firing in-process
alerts, the OOMs whose verdict is not in yet and each process's ledger, all limited to the
processes a Target chooses (pid/rank, in every mode)."""

from __future__ import annotations

from typing import Any

from exporter.actions.base import Target
from exporter.detectors import Detectors
from exporter.identity import process_labels
from exporter.ledger import ledger
from exporter.oom_pending import PendingOoms
from exporter.sample import Sample


def latest_stats(
    sample: Sample | None,
    target: Target,
    *,
    mode: str,
    detectors: Detectors | None,
    pending_ooms: PendingOoms,
) -> dict[str, Any]:
    """The latest sample (its allocators and alerts limited to `target`)."""
    data = sample.to_dict() if sample else None
    if data is not None and target.selective:
        data["allocators"] = [a for a in data["allocators"] if _selected(target, a, sample)]
        data["host_processes"] = [
            p for p in data["host_processes"] if target.matches(_str_labels(p))
        ]
    firing = [
        {"alert": alert, **labels}
        for alert, labels, is_firing in (detectors.firing() if detectors else [])
        if is_firing and (not target.selective or target.matches(labels))
    ]
    pending = [
        row
        for row in pending_ooms.rows()
        if not target.selective or target.matches(_str_labels(row))
    ]
    ledgers = [
        {
            "process": reading.process,
            "device": reading.device,
            "gpu_uuid": reading.gpu_uuid,
            "parts": dict(ledger(reading)),
        }
        for reading in (sample.allocators if sample else [])
        if not target.selective or _selected(target, {"process": reading.process}, sample)
    ]
    return {
        "mode": mode,
        "sample": data,
        "alerts_firing": firing,
        "ooms_pending": pending,
        "ledgers": ledgers,
    }


def _str_labels(entry: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in entry.items() if k in ("pid", "rank")}


def _selected(target: Target, allocator: dict[str, Any], sample: Sample | None) -> bool:
    """An allocator reading matches by its process labels (run) or, in a single process,
    by this process's identity with the sample's own PID: the recorded process's in a
    replay, which the demo's actions take as theirs too."""
    process = allocator.get("process") or {}
    if not process:
        process = process_labels()
        if sample is not None and sample.self_pid is not None:
            process = {**process, "pid": str(sample.self_pid)}
    return target.matches(process)
