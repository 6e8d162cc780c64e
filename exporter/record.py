"""Record a running exporter: scrape its /metrics and turn each scrape back into a sample.

This is the inverse of exporter.metrics, driven by the same name tables, so that any exporter
(a pod in an incident, a node daemon) can be recorded without admin access and replayed with
`gpumem-exporter demo --trace FILE`.

A recording keeps what it took: each sample is in the trace file as soon as it is scraped (a
live TraceWriter), and a target that stops answering, or starts answering with something that
is not its metrics (an HTML page, NaN or infinite values), ends the recording with the samples
taken so far (TargetStopped) rather than losing them.
"""

from __future__ import annotations

import http.client
import math
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from exporter import catalog
from exporter.catalog import PROCESS_LABELS
from exporter.no_redirects import opener
from exporter.oom_verdict import READINGS, OomVerdict, decide
from exporter.refusals import basic_auth_hint
from exporter.sample import (
    AllocatorReading,
    GpuReading,
    HostReading,
    PinnedHostReading,
    ProcessGpuReading,
    Sample,
)
from exporter.trace import TraceWriter

# Exposed name -> the catalog's family, for those with the allocator's labels.
_ALLOCATOR = {f.exposed: f for f in catalog.FAMILIES if f.labels[:2] == catalog.ALLOCATOR_LABELS}
_GPU_FIELDS = {f.exposed: f.key for f in catalog.group("gpu_memory")}
# A live exporter's own process is the server (embedded): client_python's RSS is its RSS.
_HOST_FIELDS = {
    **{f.exposed: f.key for f in catalog.group("machine_host")},
    **{f.exposed: f.key for f in catalog.group("own_process_host")},
    "process_resident_memory_bytes": "process_resident_bytes",
}
# The cached bytes are held minus in use: not a field of their own.
_PINNED_FIELDS = {f.exposed: f.key for f in catalog.group("pinned_host") if f.key != "cached_bytes"}


# Scrapes that may fail in a row before a recording stops: one slow or refused scrape (a pod
# under pressure) must not end an incident's recording; a target that is gone ends it soon.
MAX_MISSED_SCRAPES = 3


class RecordError(RuntimeError):
    """Recording failed; str() is a one-line reason."""


class TargetStopped(RecordError):
    """The target stopped answering with metrics after some samples had been written."""


def sample_from_exposition(text: str, timestamp: float) -> Sample:
    """Rebuild a Sample from the text exposition of one scrape.

    Raises RecordError (one line) for text that is not an exporter's exposition: a parse
    error, a series without its labels, a non-finite value where a count belongs.
    """
    try:
        return _sample_from_exposition(text, timestamp)
    except (ValueError, KeyError) as exc:
        reason = f"missing label {exc}" if isinstance(exc, KeyError) else str(exc)
        raise RecordError(f"not a gpumem-exporter exposition: {_one_line(reason)}") from None


def _one_line(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _count(name: str, value: float) -> int:
    if not math.isfinite(value):
        raise RecordError(f"{name} is {value}, not a finite value")
    return int(value)


def _sample_from_exposition(text: str, timestamp: float) -> Sample:
    allocators: dict[tuple[int, str, str], AllocatorReading] = {}
    gpus: dict[tuple[int, str], GpuReading] = {}
    processes: list[ProcessGpuReading] = []
    host: dict[str, int] = {}
    pinned: dict[str, dict[str, Any]] = {}  # pid label -> PinnedHostReading fields

    def allocator(labels: dict[str, str]) -> AllocatorReading:
        key = (int(labels["device"]), labels["gpu_uuid"], labels.get("pid", ""))
        if key not in allocators:
            allocators[key] = AllocatorReading(
                device=key[0],
                gpu_uuid=key[1],
                backend="native",
                expandable_segments=False,
                process={k: labels[k] for k in PROCESS_LABELS if k in labels},
            )
        return allocators[key]

    def gpu(labels: dict[str, str]) -> GpuReading:
        key = (int(labels["gpu"]), labels["gpu_uuid"])
        if key not in gpus:
            gpus[key] = GpuReading(index=key[0], uuid=key[1])
        return gpus[key]

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, labels, value = s.name, s.labels, s.value
            if name in _ALLOCATOR and "device" in labels:
                _allocator_value(allocator(labels), _ALLOCATOR[name], labels, value)
            elif name in _GPU_FIELDS and "gpu" in labels:
                setattr(gpu(labels), _GPU_FIELDS[name], _count(name, value))
            elif name == "gpu_up" and "gpu" in labels:
                gpu(labels).up = value == 1.0
            elif name == "gpu_info" and "gpu" in labels:
                reading_gpu = gpu(labels)
                reading_gpu.name = labels.get("name", "")
                reading_gpu.driver_version = labels.get("driver_version", "")
                reading_gpu.pci_bus_id = labels.get("pci_bus_id", "")
            elif name == "gpu_process_memory_used_bytes":
                processes.append(
                    ProcessGpuReading(
                        gpu_index=int(labels["gpu"]),
                        gpu_uuid=labels["gpu_uuid"],
                        pid=int(labels["pid"]),
                        used_bytes=_count(name, value),
                    )
                )
            elif name in _PINNED_FIELDS:
                process = {k: labels[k] for k in PROCESS_LABELS if k in labels}
                entry = pinned.setdefault(labels.get("pid", ""), {"process": process})
                entry[_PINNED_FIELDS[name]] = _count(name, value)
            elif name in _HOST_FIELDS:
                host[_HOST_FIELDS[name]] = _count(name, value)
    sample = Sample(
        timestamp=timestamp,
        allocators=list(allocators.values()),
        gpus=list(gpus.values()),
        processes=processes,
        host=HostReading(**host) if _complete_host(host) else None,
        pinned_host=[
            PinnedHostReading(**entry)
            for entry in pinned.values()
            if "held_bytes" in entry and "in_use_bytes" in entry
        ],
    )
    by_uuid = {g.uuid: g for g in sample.gpus}
    for reading in sample.allocators:
        _complete_oom(reading, by_uuid)
    sample.self_pid = _self_pid(sample)
    return sample


def _allocator_value(
    reading: AllocatorReading, entry: catalog.Family, labels: dict[str, str], value: float
) -> None:
    """One scraped series of the allocator back into its reading, by its catalog group."""
    group, key, name = entry.group, entry.key, entry.exposed
    if group == "allocator_gauge":
        reading.gauges[key] = _count(name, value)
    elif group == "allocator_counter":
        reading.counters[key] = _count(name, value)
    elif group == "pool":
        reading.pools.setdefault(labels["pool"], {})[key] = _count(name, value)
    elif group == "layout":
        reading.layout[key] = _count(name, value)
    elif group == "private_pool_info" and "pool_id" in labels:
        reading.private_pool_info[labels["pool_id"]] = {
            "kind": labels.get("kind", ""),
            "name": labels.get("name", ""),
        }
    elif group == "private_pool" and "pool_id" in labels:
        reading.private_pools.setdefault(labels["pool_id"], {})[key] = _count(name, value)
    elif key == "non_allocator_bytes":
        reading.non_allocator_bytes = _count(name, value)
    elif key in ("non_allocator_age_s", "layout_age_s"):
        setattr(reading, key, value)
    elif key == "layout_skipped":
        reading.layout_skipped = labels.get("reason", "")
    elif group == "component":
        reading.components[labels.get("component", "")] = _count(name, value)
    elif group == "oom":
        _oom_value(reading, key, labels, _count(name, value) if key != "last_timestamp" else value)
    elif entry.name == "torch_cuda_allocator":
        reading.backend = labels.get("backend", "native")
        reading.expandable_segments = labels.get("expandable_segments") == "true"
        split = labels.get("max_split_size_bytes", "")
        reading.max_split_size_bytes = int(split) if split else None
        reading.settings = _settings(labels)
    # Ratios and the ledger are derived from the rest, never read back.


# torch_cuda_oom_last_bytes{reading} -> the OomVerdict field it is (cap_room is derived).
_OOM_READINGS = {name: f"{name}_bytes" for name in READINGS if name != "cap_room"}


def _oom_value(reading: AllocatorReading, key: str, labels: dict[str, str], value: float) -> None:
    """An OOM verdict series back into the reading: the counts by verdict, and what a scrape
    says of the latest one (its verdict, time and, at the full detail level, its numbers; the
    reason and action are decided again from them in _complete_oom)."""
    if key == "ooms_by_verdict":
        reading.ooms_by_verdict[labels.get("verdict", "unknown")] = int(value)
        return
    last = reading.last_oom or OomVerdict(reading.device, 0.0, 0)
    if key == "last_timestamp":
        last = replace(last, timestamp=value, verdict=labels.get("verdict", "unknown"))
    elif labels.get("reading") in _OOM_READINGS:
        fields: dict[str, Any] = {_OOM_READINGS[labels["reading"]]: int(value)}
        last = replace(last, **fields)
    elif labels.get("reading") == "cap_room" and last.reserved_bytes is not None:
        last = replace(last, memory_limit_bytes=last.reserved_bytes + int(value))
    reading.last_oom = last


def _complete_oom(reading: AllocatorReading, gpus: dict[str, GpuReading]) -> None:
    """The latest verdict's reason and action, decided again from the scraped numbers where
    the rule gives the verdict the exporter served (else the verdict alone is kept)."""
    last = reading.last_oom
    if last is None:
        return
    gpu = gpus.get(reading.gpu_uuid)
    total = gpu.total_bytes if gpu is not None else None
    if last.memory_limit_bytes is not None and total is not None:
        capped = last.memory_limit_bytes < total
        last = replace(last, memory_limit_bytes=last.memory_limit_bytes if capped else None)
    last = replace(last, device_total_bytes=total, expandable_segments=reading.expandable_segments)
    decided = decide(last)
    reading.last_oom = decided if decided.verdict == last.verdict else last


def _settings(labels: dict[str, str]) -> dict[str, str]:
    """AllocatorReading.settings back from torch_cuda_allocator_info's labels (the live
    settings' expandable_segments and max_split_size are the labels of those names)."""
    threshold = labels.get("garbage_collection_threshold", "")
    if labels.get("settings_source") != "live":
        return {"garbage_collection_threshold": threshold, "source": "environment"}
    return {
        "expandable_segments": labels.get("expandable_segments", "false"),
        "garbage_collection_threshold": threshold,
        "max_split_size": labels.get("max_split_size_bytes") or "-1",
        "source": "live",
    }


def _complete_host(host: dict[str, Any]) -> bool:
    return all(
        k in host for k in ("total_bytes", "available_bytes", "swap_total_bytes", "swap_used_bytes")
    )


def _self_pid(sample: Sample) -> int | None:
    """The exporting process's PID, which the exposition does not carry directly.

    non_allocator = NVML used(pid) - reserved, so the PID is the one whose NVML entry on that
    GPU is nearest to reserved + non_allocator (exactly, while memory stands still).
    """
    for reading in sample.allocators:
        if reading.process:
            continue  # per-process series carry their pid
        outside = reading.non_allocator_bytes
        reserved = reading.gauges.get("reserved_bytes")
        if outside is None or reserved is None:
            continue
        on_gpu = [entry for entry in sample.processes if entry.gpu_uuid == reading.gpu_uuid]
        if on_gpu:
            nearest = min(on_gpu, key=lambda e: abs(e.used_bytes - (reserved + outside)))
            return nearest.pid
    return None


def scrape(
    url: str,
    timeout_s: float = 5.0,
    *,
    context: ssl.SSLContext | None = None,
    headers: Mapping[str, str] | None = None,
) -> str:
    """The exposition at `url`; `context` for https (a CA, a client certificate), `headers`
    for basic auth."""
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        # No redirect followed: a basic-auth password must not go where one points.
        with opener(context).open(request, timeout=timeout_s) as response:
            if response.headers.get_content_type() == "text/html":
                raise RecordError(f"{url} answered with an HTML page, not metrics")
            return str(response.read().decode("utf-8"))
    except urllib.error.HTTPError as exc:
        where = f" ({exc.msg})" if 300 <= exc.code < 400 else ""
        basic = basic_auth_hint(
            exc.headers.get("WWW-Authenticate") if exc.headers else None,
            "Authorization" in request.headers,
        )
        if exc.code == 401 and basic is not None:
            where = f": {basic}"
        raise RecordError(f"{url} answered HTTP {exc.code}{where}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        # HTTPException: the target died mid-answer (IncompleteRead, a bad status line).
        reason = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
        raise RecordError(f"cannot scrape {url}: {reason}") from None
    except UnicodeDecodeError:
        raise RecordError(f"{url} answered with bytes that are not UTF-8 text") from None


def _scrape_sample(
    url: str,
    clock: Callable[[], float],
    context: ssl.SSLContext | None = None,
    headers: Mapping[str, str] | None = None,
) -> Sample:
    text = scrape(url, context=context, headers=headers)
    try:
        return sample_from_exposition(text, clock())
    except RecordError as exc:
        raise RecordError(f"{url}: {exc}") from None


def record_url(
    url: str,
    writer: TraceWriter,
    *,
    duration_s: float,
    interval_s: float,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    max_missed: int = MAX_MISSED_SCRAPES,
    context: ssl.SSLContext | None = None,
    headers: Mapping[str, str] | None = None,
) -> int:
    """Scrape `url` every interval for `duration_s`; returns the number of samples written.

    The first scrape must succeed (RecordError: a wrong URL fails at once). After it, a failed
    scrape is skipped and retried at the next interval; `max_missed` failures in a row end the
    recording early with TargetStopped, the samples so far being in `writer` already.
    """
    deadline = time.monotonic() + duration_s
    recorded = missed = 0
    while True:
        started = time.monotonic()
        try:
            sample = _scrape_sample(url, clock, context, headers)
        except RecordError as exc:
            missed += 1
            if not recorded:
                raise
            if missed >= max_missed:
                raise TargetStopped(
                    f"the target stopped answering after {recorded} samples "
                    f"({missed} scrapes in a row failed, the last: {exc})"
                ) from None
        else:
            writer(sample)
            recorded += 1
            missed = 0
        if started + interval_s > deadline:
            return writer.count
        sleep(max(interval_s - (time.monotonic() - started), 0.0))
