"""Scenarios for the GPU tests, each run in a fresh process (allocator settings and CUDA
contexts are per process): `python tests/support/gpu_scenarios.py NAME [ARG]` prints one JSON
object.

The scenarios only measure; tests/gpu/test_gpu.py asserts. Every number the exporter reports is
paired with an independent reading (torch's own accessors, raw NVML calls, tensor sizes).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from typing import Any

MiB = 1 << 20


def _nvml_pids() -> dict[str, dict[int, int]]:
    """Raw NVML, independent of the exporter: uuid -> {pid: used bytes}."""
    import pynvml

    pynvml.nvmlInit()
    result = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        result[pynvml.nvmlDeviceGetUUID(h)] = {p.pid: p.usedGpuMemory for p in procs}
    return result


def _has_primary_context(index: int) -> bool:
    """Whether CUDA device `index` has a primary context (torch's private binding)."""
    import torch

    return bool(torch._C._cuda_hasPrimaryContext(index))  # type: ignore[attr-defined]


def _sampler(interval_s: float = 0.02) -> Any:
    from exporter.sampler import Sampler
    from exporter.sources.host import HostMemorySource
    from exporter.sources.non_allocator import NonAllocatorReader
    from exporter.sources.nvml import NvmlSource
    from exporter.sources.torch_allocator import TorchAllocatorSource

    allocator = TorchAllocatorSource(non_allocator=NonAllocatorReader())
    return Sampler([allocator, NvmlSource(), HostMemorySource()], interval_s=interval_s)


def exact_bytes() -> dict[str, Any]:
    import torch

    from exporter.sources.torch_allocator import TorchAllocatorSource

    source = TorchAllocatorSource()
    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    before = source.read().allocators[0]
    truth_before = (torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0))
    n = 64 * MiB
    tensor = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    during = source.read().allocators[0]
    truth_during = (torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0))
    del tensor
    after = source.read().allocators[0]
    return {
        "n": n,
        "before": asdict(before),
        "during": asdict(during),
        "after": asdict(after),
        "truth_before": truth_before,
        "truth_during": truth_during,
    }


def context_size() -> dict[str, Any]:
    import torch

    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    sampler = _sampler()
    sample = sampler.tick()
    del x
    uuid = sample.allocators[0].gpu_uuid
    return {
        "pid": os.getpid(),
        "sample": sample.to_dict(),
        "non_allocator": _non_allocator(sample),
        "raw_nvml_used": _nvml_pids().get(uuid, {}).get(os.getpid()),
        "torch_reserved": torch.cuda.memory_reserved(0),
    }


def no_init() -> dict[str, Any]:
    import torch

    sampler = _sampler()
    sampler.start()
    time.sleep(0.5)
    sampler.stop()
    sample = sampler.latest
    return {
        "is_initialized": torch.cuda.is_initialized(),
        "allocators": len(sample.allocators),
        "gpus": len(sample.gpus),
        "pid_on_gpus": [u for u, pids in _nvml_pids().items() if os.getpid() in pids],
    }


def one_device(index: str) -> dict[str, Any]:
    """Use only cuda:index (set_device, as a rank would); sample from a thread meanwhile."""
    import torch

    used = int(index)
    torch.cuda.set_device(used)
    sampler = _sampler(interval_s=0.01)
    sampler.start()
    tensors = []
    for i in range(50):
        tensors.append(torch.empty((i + 1) * MiB, dtype=torch.uint8, device=f"cuda:{used}"))
        if i % 3 == 0:
            tensors.pop(0)
        time.sleep(0.01)
    torch.cuda.synchronize()
    time.sleep(0.2)
    sampler.stop()
    sample = sampler.latest
    # Read NVML and the context flags before anything else could touch another device.
    pid_on_gpus = [u for u, pids in _nvml_pids().items() if os.getpid() in pids]
    has_context = [bool(_has_primary_context(i)) for i in range(torch.cuda.device_count())]
    return {
        "used": used,
        "used_uuid": f"GPU-{torch.cuda.get_device_properties(used).uuid}",
        "device_count": torch.cuda.device_count(),
        "has_context": has_context,
        "allocator_devices": [a.device for a in sample.allocators],
        "pid_on_gpus": pid_on_gpus,
    }


def backend() -> dict[str, Any]:
    import torch

    from exporter.metrics import ExporterState, SampleCollector
    from exporter.modes import MODES

    keep = []
    allocs = [
        torch.empty(s, dtype=torch.uint8, device="cuda:0")
        for s in [3 * MiB, 5 * MiB, 7 * MiB, 2 * MiB] * 8
    ]
    keep = allocs[::2]
    del allocs
    sampler = _sampler()
    sample = sampler.tick()
    collector = SampleCollector(
        lambda: ExporterState(sample=sample),
        const_labels={},
        version="test",
        traits=MODES["embedded"].traits,
        detail="full",  # the per-pool families too
    )
    names = sorted({s.name for family in collector.collect() for s in family.samples})
    return {
        "backend": torch.cuda.get_allocator_backend(),
        "reading": asdict(sample.allocators[0]),
        "metric_names": names,
        "truth_allocated": torch.cuda.memory_allocated(0),
        "truth_reserved": torch.cuda.memory_reserved(0),
        "kept": len(keep),
    }


def oom() -> dict[str, Any]:
    import torch

    from exporter.sources.torch_allocator import TorchAllocatorSource

    torch.cuda.set_per_process_memory_fraction(
        (2 << 30) / torch.cuda.get_device_properties(0).total_memory, 0
    )
    source = TorchAllocatorSource()
    held = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda:0")
    cached = torch.empty(1024 * MiB, dtype=torch.uint8, device="cuda:0")
    del cached  # a cached free segment the next, larger request cannot use
    before = source.read().allocators[0].counters
    bigger = torch.empty(1200 * MiB, dtype=torch.uint8, device="cuda:0")  # flush + retry
    del bigger
    raised = False
    try:
        torch.empty(4 << 30, dtype=torch.uint8, device="cuda:0")
    except torch.cuda.OutOfMemoryError:
        raised = True
    after = source.read().allocators[0].counters
    del held
    flat = torch.cuda.memory_stats(0)
    return {
        "raised": raised,
        "before": before,
        "after": after,
        "truth": {"num_ooms": flat["num_ooms"], "num_alloc_retries": flat["num_alloc_retries"]},
    }


def memory_limit() -> dict[str, Any]:
    """The cap series against the allocator itself: a request that ends 64 MiB under
    torch_cuda_memory_limit_bytes is served, one that ends 64 MiB past it is refused."""
    import torch

    from exporter.sources.torch_allocator import TorchAllocatorSource

    torch.empty(1, device="cuda:0")  # a context on cuda:0 only
    source = TorchAllocatorSource()
    uncapped = source.read().allocators[0].gauges["memory_limit_bytes"]
    torch.cuda.set_per_process_memory_fraction(0.25, 0)
    torch.cuda.empty_cache()
    gauges = source.read().allocators[0].gauges
    limit, reserved = gauges["memory_limit_bytes"], gauges["reserved_bytes"]
    under = torch.empty(limit - reserved - 64 * MiB, dtype=torch.uint8, device="cuda:0")
    served = True
    del under
    torch.cuda.empty_cache()
    try:
        torch.empty(limit - reserved + 64 * MiB, dtype=torch.uint8, device="cuda:0")
        refused = False
    except torch.cuda.OutOfMemoryError:
        refused = True
    return {
        "uncapped": uncapped,
        "total_memory": torch.cuda.get_device_properties(0).total_memory,
        "limit": limit,
        "fraction": torch.cuda.get_per_process_memory_fraction(0),
        "served_under": served,
        "refused_past": refused,
    }


def http() -> dict[str, Any]:
    import torch

    import exporter

    handle = exporter.start(port=0, interval_s=0.05)
    time.sleep(0.3)
    initialized_by_start = torch.cuda.is_initialized()
    x = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    time.sleep(0.3)
    with urllib.request.urlopen(f"{handle.url}/metrics", timeout=5) as response:
        text = response.read().decode()
    with urllib.request.urlopen(f"{handle.url}/healthz", timeout=5) as response:
        health = json.loads(response.read())
    truth = torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)
    del x
    handle.stop()
    return {
        "url": handle.url,
        "error": handle.error,
        "metrics": text,
        "health": health,
        "truth_allocated": truth[0],
        "truth_reserved": truth[1],
        "initialized_by_start": initialized_by_start,
    }


def read_cost() -> dict[str, Any]:
    import torch

    from exporter.sources.nvml import NvmlSource
    from exporter.sources.torch_allocator import TorchAllocatorSource

    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0")
    result = {}
    for name, source in (("torch", TorchAllocatorSource()), ("nvml", NvmlSource())):
        source.read()
        times = []
        for _ in range(2000):
            t0 = time.perf_counter()
            source.read()
            times.append(time.perf_counter() - t0)
        times.sort()
        result[name] = {
            "median_us": times[len(times) // 2] * 1e6,
            "p99_us": times[int(len(times) * 0.99)] * 1e6,
        }
    del x
    return result


def actions_on_device(index: str) -> dict[str, Any]:
    """empty_cache and a snapshot from a new thread (current device 0) of a process that
    uses only cuda:index: the guards must keep every other GPU free of a context."""
    import threading

    import torch

    from exporter.actions.local import LocalActions

    used = int(index)
    torch.cuda.set_device(used)
    keep = torch.empty(64 * MiB, dtype=torch.uint8, device=f"cuda:{used}")
    cached = torch.empty(256 * MiB, dtype=torch.uint8, device=f"cuda:{used}")
    del cached
    reserved_before = torch.cuda.memory_reserved(used)
    result: dict[str, Any] = {}

    def act() -> None:
        import pickle
        import tempfile

        from exporter.actions.snapshots import SnapshotStore

        store = SnapshotStore(tempfile.mkdtemp())
        actions = LocalActions(store)
        res = actions.empty_cache_now()
        result["released"] = res.released_bytes
        result["duration_s"] = res.duration_s
        result["reserved_after_reported"] = res.reserved_after_bytes[used]
        info = actions.write_snapshot("test")
        with open(store.path(info), "rb") as f:
            snap = pickle.load(f)
        result["snapshot_segments"] = len(snap["segments"])
        result["snapshot_devices"] = sorted({seg["device"] for seg in snap["segments"]})
        result["snapshot_name"] = info.filename

    thread = threading.Thread(target=act)
    thread.start()
    thread.join()
    pid_on_gpus = [u for u, pids in _nvml_pids().items() if os.getpid() in pids]
    has_context = [bool(_has_primary_context(i)) for i in range(torch.cuda.device_count())]
    del keep
    return {
        **result,
        "used": used,
        "reserved_before": reserved_before,
        "reserved_after": torch.cuda.memory_reserved(used),
        "has_context": has_context,
        "pid_on_gpus": pid_on_gpus,
        "used_uuid": f"GPU-{torch.cuda.get_device_properties(used).uuid}",
    }


def snapshot_on_async() -> dict[str, Any]:
    import tempfile

    import torch

    from exporter.actions.base import ActionUnavailable
    from exporter.actions.local import LocalActions
    from exporter.actions.snapshots import SnapshotStore

    x = torch.empty(MiB, device="cuda:0")
    try:
        LocalActions(SnapshotStore(tempfile.mkdtemp())).write_snapshot()
    except ActionUnavailable as exc:
        return {"unavailable": str(exc), "backend": torch.cuda.get_allocator_backend()}
    finally:
        del x
    return {"unavailable": None}


def remediation() -> dict[str, Any]:
    """Fragment, then retry and OOM under a cap, with remediation on and short durations."""
    import tempfile

    import torch

    from exporter.config import load_config
    from exporter.runtime import build_runtime, sources_for

    torch.cuda.set_per_process_memory_fraction(
        (3 << 30) / torch.cuda.get_device_properties(0).total_memory, 0
    )
    snapshot_dir = tempfile.mkdtemp()
    config = load_config(
        interval_s=0.05,
        remediate=True,
        remediate_cooldown_s=600,
        snapshot_dir=snapshot_dir,
        nvml=False,
    )
    events: list[dict] = []
    runtime = build_runtime(
        config,
        mode="embedded",
        sources=sources_for("embedded", config),
        on_alert=[lambda e: events.append({"alert": e.alert, "state": e.state, "value": e.value})],
    )
    runtime.sampler.start()
    # Alternating frees of varied sizes: holes that later, larger requests cannot use.
    keep: list[Any] = []
    size = float(MiB)
    while sum(t.numel() for t in keep) < (1 << 30):
        batch = [torch.empty(int(size), dtype=torch.uint8, device="cuda:0") for _ in range(20)]
        keep.extend(batch[::2])
        del batch
        size *= 1.05
    time.sleep(0.5)
    latest = runtime.sampler.latest
    assert latest is not None
    reading = latest.allocators[0]
    frag = runtime.detectors.is_firing(
        "GpuMemFragmentationHigh", {"device": "0", "gpu_uuid": reading.gpu_uuid}
    )
    ratio = reading.fragmentation_ratio
    # A cached free segment, then a larger request that crosses the cap: flush and retry.
    cached = torch.empty(600 * MiB, dtype=torch.uint8, device="cuda:0")
    del cached
    retried = torch.empty(700 * MiB, dtype=torch.uint8, device="cuda:0")
    del retried
    time.sleep(0.5)
    oom = False
    try:
        torch.empty(4 << 30, dtype=torch.uint8, device="cuda:0")
    except torch.cuda.OutOfMemoryError:
        oom = True
    time.sleep(0.5)
    runtime.actions.remediation.wait_idle()  # type: ignore[attr-defined]  # LocalActions'
    runtime.sampler.stop()
    flat = torch.cuda.memory_stats(0)
    counts = runtime.actions.counts()[0].counts
    return {
        "fragmentation_firing": frag,
        "ratio": ratio,
        "oom": oom,
        "events": events,
        "remediations": {k.replace("/", ":"): n for k, n in counts.remediations.items()},
        "snapshots": dict(counts.snapshots),
        "snapshot_files": sorted(f for f in os.listdir(snapshot_dir) if f.endswith(".pickle")),
        "released_total": counts.empty_cache_released_bytes,
        "retries": flat["num_alloc_retries"],
        "ooms": flat["num_ooms"],
    }


def _post(url: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body or {}).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _one(body: dict) -> dict:
    """The single process's result of an action (every action answers a list)."""
    assert len(body["processes"]) == 1, body
    entry = body["processes"][0]
    return {**(entry["result"] or entry), "replay": body["replay"]}


def _get(url: str, token: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status, response.read()


def admin_http() -> dict[str, Any]:
    """The admin API in a real CUDA process: snapshots (immediate, windowed), view,
    empty_cache, history, reset-peak, stats."""
    import pickle
    import tempfile
    import threading

    import torch

    import exporter

    token = "gpu-test-token"
    snapshot_dir = tempfile.mkdtemp()
    handle = exporter.start(
        port=0,
        interval_s=0.05,
        admin_token=token,
        snapshot_dir=snapshot_dir,
        empty_cache_cooldown_s=0,
    )
    base = handle.url
    result: dict[str, Any] = {}
    keep = [torch.empty((i % 7 + 1) * MiB, dtype=torch.uint8, device="cuda:0") for i in range(40)]
    cached = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda:0")
    del cached
    torch.cuda.synchronize()
    time.sleep(0.2)
    status, info = _post(f"{base}/snapshot", token)
    info = _one(info)
    result["immediate_status"] = status
    _, raw = _get(f"{base}/snapshots/{info['id']}", token)
    snap = pickle.loads(raw)
    result["immediate_segments"] = len(snap["segments"])
    result["immediate_devices"] = sorted({s["device"] for s in snap["segments"]})
    result["immediate_reserved"] = sum(s["total_size"] for s in snap["segments"])
    result["truth_reserved"] = torch.cuda.memory_reserved(0)
    status, page = _get(f"{base}/snapshots/{info['id']}/view", token)
    result["view_status"] = status
    result["view_bytes"] = len(page)
    result["view_external"] = b"https://" in page or b"http://" in page

    # Windowed: allocations made while recording must show up in the trace.
    status, window = _post(f"{base}/snapshot", token, {"record_s": 1.0})
    window = _one(window)
    result["window_status"] = status
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            t = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda:0")
            del t
            time.sleep(0.005)

    worker = threading.Thread(target=churn)
    worker.start()
    busy_status, _ = _post(f"{base}/snapshot", token)
    result["busy_status"] = busy_status
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, listing = _get(f"{base}/snapshots", token)
        entry = next(s for s in json.loads(listing)["snapshots"] if s["id"] == window["id"])
        if entry["status"] != "recording":
            break
        time.sleep(0.1)
    stop.set()
    worker.join()
    result["window_final_status"] = entry["status"]
    _, raw = _get(f"{base}/snapshots/{window['id']}", token)
    windowed = pickle.loads(raw)
    traces = windowed.get("device_traces", [[]])
    result["window_trace_entries"] = sum(len(t) for t in traces)
    result["window_actions"] = sorted({e["action"] for t in traces for e in t})
    result["window_frames"] = any(e.get("frames") for t in traces for e in t)
    result["history_after_window"] = _one(json.loads(_get(f"{base}/history", token)[1]))["enabled"]
    status, page = _get(f"{base}/snapshots/{window['id']}/view", token)
    result["window_view_status"] = status

    status, cleared = _post(f"{base}/empty-cache", token)
    result["empty_cache_status"] = status
    result["empty_cache"] = _one(cleared)
    result["reserved_after_empty_cache"] = torch.cuda.memory_reserved(0)
    status, hist = _post(f"{base}/history", token, {"enabled": True, "max_entries": 1000})
    result["history_on"] = (status, _one(hist)["enabled"])
    status, hist = _post(f"{base}/history", token, {"enabled": False})
    result["history_off"] = (status, _one(hist)["enabled"], bool(_one(hist)["snapshot"]))
    peak_before = torch.cuda.max_memory_allocated(0)
    status, reset = _post(f"{base}/reset-peak", token, {"device": 0})
    result["reset_peak"] = (
        status,
        _one(reset)["devices"],
        peak_before,
        torch.cuda.max_memory_allocated(0),
        torch.cuda.memory_allocated(0),
    )
    _, stats = _get(f"{base}/stats", token)
    result["stats_allocators"] = len(json.loads(stats)["sample"]["allocators"])
    del keep
    handle.stop()
    return result


def oom_exit() -> dict[str, Any]:
    """An uncaught OOM ends the process; the OOM snapshot must be on disk all the same."""
    import torch

    import exporter

    snapshot_dir = os.environ["SNAPSHOT_DIR"]
    exporter.start(
        serve_http=False,
        interval_s=0.02,
        oom_snapshot=True,
        snapshot_dir=snapshot_dir,
        history_max_entries=5000,
    )
    torch.cuda.set_per_process_memory_fraction(
        (1 << 30) / torch.cuda.get_device_properties(0).total_memory, 0
    )
    held = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda:0")
    time.sleep(0.3)  # the sampler sees CUDA in use and arms the observer and history
    torch.empty(2 << 30, dtype=torch.uint8, device="cuda:0")  # raises: the process dies
    del held
    return {"unreachable": True}


def host_memory_load() -> dict[str, Any]:
    """The validation-worker incident: one process loads many large tensor files at once."""
    import tempfile

    import torch

    from exporter.sources.host import HostMemorySource

    source = HostMemorySource()
    directory = tempfile.mkdtemp()
    files = []
    for i in range(4):
        path = os.path.join(directory, f"captured_{i}.pt")
        torch.save(torch.ones(1 << 29, dtype=torch.float32), path)  # 2 GiB each
        files.append(path)
    before = source.read().host
    loaded = [torch.load(path) for path in files]
    after = source.read().host
    assert before is not None and after is not None
    total = sum(t.numel() * t.element_size() for t in loaded)
    del loaded
    for path in files:
        os.unlink(path)
    return {"before": asdict(before), "after": asdict(after), "loaded_bytes": total}


# Every public function above is a scenario, by name.
def _non_allocator(sample: Any) -> dict[int, int]:
    """Non-allocator bytes by allocator position, where the sample has them."""
    return {
        position: reading.non_allocator_bytes
        for position, reading in enumerate(sample.allocators)
        if reading.non_allocator_bytes is not None
    }


def own_gpus_and_process_cadence() -> dict[str, Any]:
    """An embedded exporter's sources in a process that uses cuda:0 only (of 2+ GPUs): which
    GPUs NVML is read for, and per-process and non-allocator bytes when memory moves."""
    import torch

    from exporter.config import load_config
    from exporter.runtime import sources_for
    from exporter.sampler import Sampler

    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    sources = sources_for("embedded", load_config(env={}))
    sampler = Sampler(sources)
    first = sampler.tick()  # reads the process list
    grown = torch.empty(1024 * MiB, dtype=torch.uint8, device="cuda:0")  # reserved grows
    torch.cuda.synchronize()
    moved = sampler.tick()  # memory moved: the list is read again on this tick
    uuid = moved.allocators[0].gpu_uuid
    truth_used = _nvml_pids()[uuid].get(os.getpid())
    time.sleep(0.2)
    still = sampler.tick()  # nothing moved: the list is reused, the value kept, older
    mine = [p.used_bytes for p in moved.processes if p.pid == os.getpid()]
    del x, grown
    return {
        "uuid_cuda0": first.allocators[0].gpu_uuid,
        "gpus_read": [g.uuid for g in first.gpus],
        "process_gpus": sorted({p.gpu_uuid for p in first.processes}),
        "first": _non_allocator(first),
        "first_reserved": first.allocators[0].gauges["reserved_bytes"],
        "moved_flag": moved.processes_cached,
        "moved": _non_allocator(moved),
        "moved_age_s": moved.allocators[0].non_allocator_age_s,
        "moved_reserved": moved.allocators[0].gauges["reserved_bytes"],
        "moved_process_used": mine,
        "still_flag": still.processes_cached,
        "still": _non_allocator(still),
        "still_age_s": still.allocators[0].non_allocator_age_s,
        "truth_used": truth_used,
        "device_count": torch.cuda.device_count(),
    }


def _walk(snapshot: dict[str, Any], device: int) -> dict[str, Any]:
    """The layout numbers by a plain walk over every block of one device (independent of
    exporter/sources/allocator_layout.py)."""
    largest = default_free = in_used = 0
    pools: dict[str, list[int]] = {}
    for segment in snapshot["segments"]:
        if segment["device"] != device:
            continue
        blocks = segment["blocks"]
        free = [b["size"] for b in blocks if b["state"] == "inactive"]
        pool = "_".join(str(part) for part in segment["segment_pool_id"])
        if pool == "0_0":
            default_free += sum(free)
            largest = max([largest, *free])
        else:
            sums = pools.setdefault(pool, [0, 0])
            sums[0] += segment["total_size"]
            sums[1] += sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        if any(b["state"] != "inactive" for b in blocks):
            in_used += sum(free)
    return {
        "largest_free_block_bytes": largest,
        "default_pool_free_bytes": default_free,
        "free_in_used_segments_bytes": in_used,
        "private_pools": {p: {"reserved": r, "allocated": a} for p, (r, a) in pools.items()},
    }


def layout(index: str = "0") -> dict[str, Any]:
    """An embedded exporter in a process that uses cuda:index only: varied sizes with every
    other one freed, a captured CUDA graph, a 4 GiB pinned host tensor; /metrics against a
    walk of torch.cuda.memory._snapshot() and torch's own pinned-memory stats."""
    import torch
    from prometheus_client.parser import text_string_to_metric_families

    import exporter

    used = int(index)
    torch.cuda.set_device(used)
    device = torch.device(f"cuda:{used}")
    sizes = [3 * MiB, 5 * MiB, 7 * MiB, 2 * MiB, 11 * MiB, 300_000, 9000]
    allocs = [torch.empty(s, dtype=torch.uint8, device=device) for s in sizes * 12]
    keep = allocs[::2]
    del allocs
    static = torch.randn(2048, 2048, device=device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        static @ static
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = static @ static
        scratch = torch.empty(96 * MiB, dtype=torch.uint8, device=device)
    graph.replay()
    pinned = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize(device)
    handle = exporter.start(port=0, interval_s=0.05)
    time.sleep(1.0)  # several layout readings (GPUMEM_LAYOUT_INTERVAL_S=0.2)

    def snapshot() -> dict[str, Any] | None:
        try:
            return torch.cuda.memory._snapshot()
        except RuntimeError:  # cudaMallocAsync has no snapshot
            return None

    before = snapshot()
    with urllib.request.urlopen(f"{handle.url}/metrics", timeout=5) as response:
        text = response.read().decode()
    after = snapshot()
    handle.stop()
    series = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("device", str(used)) == str(used):
                series.append([sample.name, sample.labels, sample.value])
    stats = torch.cuda.memory_stats_as_nested_dict(used)
    host = torch._C._cuda_hostMemoryStats()
    pid_on_gpus = [u for u, pids in _nvml_pids().items() if os.getpid() in pids]
    has_context = [bool(_has_primary_context(i)) for i in range(torch.cuda.device_count())]
    result = {
        "used": used,
        "used_uuid": f"GPU-{torch.cuda.get_device_properties(used).uuid}",
        "error": handle.error,
        "series": series,
        "walk": None if before is None else _walk(before, used),
        "walk_after": None if after is None else _walk(after, used),
        "graph_pool": "_".join(str(part) for part in graph.pool()),
        "inactive_split_bytes": stats["inactive_split_bytes"]["all"]["current"],
        "pinned_tensor_bytes": pinned.numel(),
        "host_stats_held": host["allocated_bytes"]["current"],
        "has_context": has_context,
        "pid_on_gpus": pid_on_gpus,
        "settings": None if before is None else before["allocator_settings"],
    }
    del keep, out, scratch, static, pinned
    return result


def accelerator_source(index: str = "0") -> dict[str, Any]:
    """Today's allocator source and the torch.accelerator one, read back to back (nothing
    allocated between) while this process uses only cuda:index: their numbers, and which
    devices have a context after both read."""
    import torch

    from exporter.sources.accelerator_allocator import PARTS, AcceleratorAllocatorSource
    from exporter.sources.torch_allocator import TorchAllocatorSource

    used = int(index)
    torch.cuda.set_device(used)
    tensors = [
        torch.empty(size, dtype=torch.uint8, device=f"cuda:{used}")
        for size in [3 * MiB, 300 * 1024, 25 * MiB, 7 * MiB, 100 * 1024] * 12
    ]
    del tensors[::3]  # holes of both pools
    torch.cuda.synchronize()
    cuda_source = TorchAllocatorSource(layout_interval_s=0)
    accelerator = AcceleratorAllocatorSource()
    pairs, caps = [], []
    for _ in range(3):
        a = cuda_source.read().allocators
        b = accelerator.read().allocators
        # The memory cap is torch.cuda's alone (its fraction getter): compared without it.
        caps.append([r.gauges.pop("memory_limit_bytes", None) for r in (*a, *b)])
        pairs.append([[{k: asdict(r)[k] for k in PARTS} for r in readings] for readings in (a, b)])
    has_context = [bool(_has_primary_context(i)) for i in range(torch.cuda.device_count())]
    return {
        "used": used,
        "torch": torch.__version__,
        "pairs": pairs,
        "caps": caps,
        "total": torch.cuda.get_device_properties(used).total_memory,
        "uuids_in_use": [sorted(cuda_source.uuids_in_use), sorted(accelerator.uuids_in_use)],
        "has_context": has_context,
        "pid_on_gpus": [u for u, pids in _nvml_pids().items() if os.getpid() in pids],
        "used_uuid": f"GPU-{torch.cuda.get_device_properties(used).uuid}",
        "kept": len(tensors),
    }


def probe_records(index: str = "0") -> dict[str, Any]:
    """The probe's records and the full source's reading, back to back (nothing allocated
    between) while this process uses only cuda:index, with pinned host memory held; and
    whether the probe found anything before this process initialized CUDA."""
    import torch

    from exporter.probe import record
    from exporter.probe.allocator import AllocatorProbe
    from exporter.sources.torch_allocator import TorchAllocatorSource

    probe = AllocatorProbe()
    probe.configure("native", False)
    before = probe.records()
    initialized_before = torch.cuda.is_initialized()
    used = int(index)
    torch.cuda.set_device(used)
    torch.cuda.set_per_process_memory_fraction(0.5, used)
    tensors = [
        torch.empty(size, dtype=torch.uint8, device=f"cuda:{used}")
        for size in [3 * MiB, 300 * 1024, 25 * MiB, 7 * MiB, 100 * 1024] * 12
    ]
    del tensors[::3]  # holes of both pools
    pinned = torch.empty(8 * MiB, dtype=torch.uint8).pin_memory()
    torch.cuda.synchronize()
    source = TorchAllocatorSource(layout_interval_s=0)
    pairs = []
    for _ in range(3):
        full = source.read()
        settings = source.allocator_settings()
        assert settings is not None
        probe.configure(*settings)
        records = [record.unpack(data) for data in probe.records()]
        pairs.append(
            {
                "full": [
                    {"device": r.device, "gauges": r.gauges, "counters": r.counters,
                     "pools": r.pools, "max_split_size_bytes": r.max_split_size_bytes}
                    for r in full.allocators
                ],
                "full_pinned": [[p.held_bytes, p.in_use_bytes] for p in full.pinned_host],
                "records": [
                    {"device": device, **{k: v for k, v in parts.items()
                                          if k not in ("private_pools", "pinned")}}
                    for device, _, _, parts in records
                ],
                "record_pinned": [list(parts["pinned"] or []) for *_, parts in records],
            }
        )  # fmt: skip
    return {
        "before": len(before),
        "initialized_before": initialized_before,
        "pairs": pairs,
        "has_context": [bool(_has_primary_context(i)) for i in range(torch.cuda.device_count())],
        "kept": len(tensors) + pinned.numel() // MiB,
    }


def settings_flip(under: str = "start") -> dict[str, Any]:
    """expandable_segments turned on while the process runs, with torch's private setter (as
    vLLM does around its CuMem pool): what /metrics says before and after, and when."""
    import torch

    import exporter
    from exporter.config import load_config

    handle = exporter.start(port=0, interval_s=0.2)
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()

    def scrape() -> str:
        with urllib.request.urlopen(f"{handle.url}/metrics", timeout=5) as response:
            return response.read().decode()

    deadline = time.monotonic() + 30
    before = scrape()
    while 'source="live"' not in before and time.monotonic() < deadline:
        time.sleep(0.2)
        before = scrape()
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    flipped = time.monotonic()
    y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0")  # a segment of the new kind
    from prometheus_client.parser import text_string_to_metric_families

    def said(text: str) -> bool:
        found = {
            (s.name, s.labels.get("alert"), s.value)
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }
        return ("gpumem_exporter_allocator_settings_change_info", None, 1.0) in found and (
            ("gpumem_exporter_alert_firing", "GpuMemAllocatorSettingsChanged", 1.0) in found
        )

    after, seen_s = before, None
    while time.monotonic() < flipped + 30:
        after = scrape()
        if said(after):
            seen_s = time.monotonic() - flipped
            break
        time.sleep(0.2)
    snapshot = torch.cuda.memory._snapshot()
    del x, y
    handle.stop()
    return {
        "error": handle.error,
        "before": before,
        "after": after,
        "seen_s": seen_s,
        "layout_interval_s": load_config().layout_interval_s,
        "truth_expandable": any(s.get("is_expandable") for s in snapshot["segments"]),
    }


def ledger(url: str = "") -> dict[str, Any]:
    """A model's weights and a KV cache named with exporter.component(), an unnamed tensor
    beside them; the ledger on /metrics once it has every part, and NVML's per-process used
    read independently at that moment. `url`: under `gpumem-exporter run`, the launcher's
    (the agent reads this process); else an embedded exporter is started here."""
    import pynvml
    import torch
    from prometheus_client.parser import text_string_to_metric_families

    import exporter

    handle = None if url else exporter.start(port=0, interval_s=0.2)
    if handle is not None:
        url = str(handle.url)
    torch.empty(1, device="cuda:0")
    truth = {}
    before = torch.cuda.memory_allocated(0)
    with exporter.component("weights"):
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
    truth["weights"] = torch.cuda.memory_allocated(0) - before
    before = torch.cuda.memory_allocated(0)
    with exporter.component("kv_cache"):
        kv = torch.empty((2, 32, 2048, 8, 128), dtype=torch.float16, device="cuda:0")
    truth["kv_cache"] = torch.cuda.memory_allocated(0) - before
    unnamed = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())

    def parts_now() -> dict[str, float]:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            text = response.read().decode()
        return {
            s.labels["component"]: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "torch_cuda_memory_ledger_bytes" and s.labels.get("device") == "0"
        }

    deadline = time.monotonic() + 60
    parts: dict[str, float] = {}
    while time.monotonic() < deadline:
        parts = parts_now()
        if {"weights", "kv_cache", "outside_allocator"} <= set(parts):
            break
        time.sleep(0.2)
    pid = os.getpid()
    used = [
        p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(gpu) if p.pid == pid
    ]
    result = {
        "parts": parts,
        "truth": truth,
        "nvml_used": used[0] if used else None,
        "allocated": torch.cuda.memory_allocated(0),
        "reserved": torch.cuda.memory_reserved(0),
        "error": handle.error if handle is not None else None,
    }
    del model, kv, unnamed
    if handle is not None:
        handle.stop()
    return result


def pool_kinds() -> dict[str, Any]:
    """A CUDA graph captured without a pool of its own and a MemPool named "kv_cache", under
    an embedded exporter reading the layout every 0.5 s: /metrics' pool info and bytes, and
    the allocator's own snapshot of the same moment."""
    import torch

    import exporter

    handle = exporter.start(port=0, interval_s=0.2, layout_interval_s=0.5)
    static = torch.randn(1024, 1024, device="cuda:0")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            static @ static  # warm-up outside the capture, as CUDA graphs need
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = static @ static
    pool = torch.cuda.MemPool()
    exporter.name_pool(pool, "kv_cache")
    with torch.cuda.use_mem_pool(pool):
        kv = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    mempool_label = "_".join(str(part) for part in pool.id)
    deadline = time.monotonic() + 30
    text = ""
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{handle.url}/metrics", timeout=5) as response:
            text = response.read().decode()
        if text.count("torch_cuda_private_pool_info{") >= 2:
            break
        time.sleep(0.2)
    time.sleep(1.0)  # one more layout read: the scrape and the snapshot below agree
    with urllib.request.urlopen(f"{handle.url}/metrics", timeout=5) as response:
        text = response.read().decode()
    truth: dict[str, dict[str, int]] = {}
    for segment in torch.cuda.memory_snapshot():
        label = "_".join(str(part) for part in segment["segment_pool_id"])
        if label != "0_0":
            sums = truth.setdefault(label, {"reserved_bytes": 0, "allocated_bytes": 0})
            sums["reserved_bytes"] += segment["total_size"]
            sums["allocated_bytes"] += segment["allocated_size"]
    del out, kv, graph
    handle.stop()
    return {"metrics": text, "truth": truth, "mempool": mempool_label, "error": handle.error}


SCENARIOS = {
    name: fn
    for name, fn in list(globals().items())
    if callable(fn) and getattr(fn, "__module__", None) == __name__ and not name.startswith("_")
}

if __name__ == "__main__":
    name, *args = sys.argv[1:]
    print(json.dumps(SCENARIOS[name](*args), default=str))
