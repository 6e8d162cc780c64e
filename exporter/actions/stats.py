"""What the admin API's `/stats` answers: the latest sample as JSON with the firing in-process
alerts, the OOMs whose verdict is not in yet and each process's ledger, all limited to the
processes a Target chooses (pid/rank, in every mode)."""

from __future__ import annotations

from typing import Any

from exporter.actions.base import Target
from exporter.config import Config, public_settings
from exporter.detectors import Detectors
from exporter.identity import process_labels
from exporter.ledger import ledger
from exporter.oom_pending import PendingOoms
from exporter.sample import AllocatorReading, Sample


def latest_stats(
    sample: Sample | None,
    target: Target,
    *,
    mode: str,
    detectors: Detectors | None,
    pending_ooms: PendingOoms,
    config: Config | None = None,
) -> dict[str, Any]:
    """The latest sample (its allocators and alerts limited to `target`)."""
    readings = sample.allocators if sample else []
    chosen = [
        not target.selective or target.matches(_process_of(sample, reading)) for reading in readings
    ]
    data = sample.to_dict() if sample else None
    if data is not None and target.selective:
        # to_dict keeps the readings' order
        data["allocators"] = [a for a, keep in zip(data["allocators"], chosen, strict=True) if keep]
        data["host_processes"] = [
            p for p in data["host_processes"] if target.matches(_str_labels(p))
        ]
    firing = [
        {"alert": alert, **labels}
        for alert, labels in (detectors.firing_subjects() if detectors else [])
        if not target.selective or target.matches(labels)
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
        for reading, keep in zip(readings, chosen, strict=True)
        if keep
    ]
    return {
        "mode": mode,
        "sample": data,
        "alerts_firing": firing,
        "ooms_pending": pending,
        "ledgers": ledgers,
        # What the endpoint runs with: a process that joined a helper with other settings
        # is told so (exporter.helper.link) and reads here which are in force.
        "settings": public_settings(config) if config is not None else None,
    }


def _str_labels(entry: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in entry.items() if k in ("pid", "rank")}


def _process_of(sample: Sample | None, reading: AllocatorReading) -> dict[str, str]:
    """Who a reading is from: its process labels (run), or this process's identity with the
    reading's PID (Sample.allocator_pid: the recorded process's in a replay, which the demo's
    actions take as theirs too)."""
    if reading.process:
        return reading.process
    pid = sample.allocator_pid(reading) if sample is not None else None
    return {**process_labels(), **({"pid": str(pid)} if pid is not None else {})}
