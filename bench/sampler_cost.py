"""Sampler cost per tick per device: this exporter vs the naive sidecar from tutorials.

Naive: a thread calling torch.cuda.memory_stats(i) and setting a few prometheus Gauges.
Ours: TorchAllocatorSource + NvmlSource reads, and a whole Sampler.tick (with host memory and
detectors). The NVML source reads its process list every 10 s: its reads are measured with a
clock that advances one second per read, so the mean is the per-tick average at 1 Hz (the
read with the list and the read without it are measured too). Render: the cached bytes a
scrape gets once the tick's text exists, and the uncached prometheus_client rendering.
CPU time is thread CPU time (user + system) of the calling thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry, Gauge

from bench.common import MiB, emit, machine, summary

TICKS = 3000


def measure(fn: Callable[[], object], ticks: int = TICKS) -> dict[str, dict[str, float]]:
    for _ in range(50):
        fn()
    wall, cpu = [], []
    for _ in range(ticks):
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    # thread_time has coarse resolution on some kernels: report the mean too.
    return {
        "wall_us": summary(wall, 1e6),
        "cpu_us": summary(cpu, 1e6),
        "cpu_mean_us": {"mean": sum(cpu) / len(cpu) * 1e6},
        "wall_mean_us": {"mean": sum(wall) / len(wall) * 1e6},
    }


def main() -> None:
    from exporter.config import load_config
    from exporter.runtime import build_runtime, sources_for
    from exporter.sources.nvml import NvmlSource
    from exporter.sources.torch_allocator import TorchAllocatorSource

    devices = list(range(torch.cuda.device_count()))
    held = [torch.empty(64 * MiB, dtype=torch.uint8, device=f"cuda:{d}") for d in devices]
    torch.cuda.synchronize()

    registry = CollectorRegistry()
    names = ("allocated", "reserved", "active", "inactive_split", "retries", "ooms")
    gauges = {n: Gauge(f"naive_{n}", n, ["device"], registry=registry) for n in names}

    def naive() -> None:
        for d in devices:
            s = torch.cuda.memory_stats(d)
            gauges["allocated"].labels(str(d)).set(s["allocated_bytes.all.current"])
            gauges["reserved"].labels(str(d)).set(s["reserved_bytes.all.current"])
            gauges["active"].labels(str(d)).set(s["active_bytes.all.current"])
            gauges["inactive_split"].labels(str(d)).set(s["inactive_split_bytes.all.current"])
            gauges["retries"].labels(str(d)).set(s["num_alloc_retries"])
            gauges["ooms"].labels(str(d)).set(s["num_ooms"])

    def cheapest() -> None:
        for d in devices:
            torch.cuda.memory_stats_as_nested_dict(d)

    def the_c_call() -> None:
        for d in devices:
            torch._C._cuda_memoryStats(d)

    class TickClock:
        """One second per read: the NVML source's process-list cadence as at 1 Hz."""

        def __init__(self) -> None:
            self.now = 0.0

        def __call__(self) -> float:
            self.now += 1.0
            return self.now

    torch_source = TorchAllocatorSource()
    torch_source.read()
    config = load_config(env={})
    uuids = lambda: torch_source.uuids_in_use  # noqa: E731
    nvml_at_1hz = NvmlSource(clock=TickClock(), only_uuids=uuids)
    nvml_every_read = NvmlSource(only_uuids=uuids, process_interval_s=0.0)
    nvml_cached = NvmlSource(only_uuids=uuids, process_interval_s=1e9)
    sources = sources_for("embedded", config)
    for source in sources:  # the embedded tick, with the process list's cadence as at 1 Hz
        if isinstance(source, NvmlSource):
            source._clock = TickClock()
    runtime = build_runtime(config, mode="embedded", sources=sources)
    results = {
        "devices": len(devices),
        "naive_memory_stats_and_gauges": measure(naive),
        "cheapest_nested_dict": measure(cheapest),
        "floor_c_call": measure(the_c_call),
        "ours_torch_source": measure(torch_source.read),
        "ours_nvml_source": measure(nvml_at_1hz.read),
        "ours_nvml_with_process_list": measure(nvml_every_read.read),
        "ours_nvml_memory_only": measure(nvml_cached.read),
        "ours_allocator_plus_nvml": measure(lambda: (torch_source.read(), nvml_at_1hz.read())),
        "ours_full_tick": measure(runtime.sampler.tick),
    }
    from prometheus_client import generate_latest

    exposition = runtime.exposition
    assert exposition is not None
    results["ours_render_metrics"] = measure(lambda: exposition.body("", "gzip"), 3000)
    results["ours_render_uncached"] = measure(lambda: generate_latest(runtime.registry), 500)
    results["naive_render_metrics"] = measure(lambda: generate_latest(registry), 500)
    results["machine"] = machine()
    del held
    emit(results)


if __name__ == "__main__":
    main()
