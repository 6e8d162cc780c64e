"""Sampler cost per tick per device: this exporter vs the naive sidecar from tutorials.

Naive: a thread calling torch.cuda.memory_stats(i) and setting a few prometheus Gauges.
Ours: TorchAllocatorSource + NvmlSource reads, and a whole Sampler.tick (with host memory and
detectors). CPU time is thread CPU time (user + system) of the calling thread.
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
    }


def main() -> None:
    from exporter.config import load_config
    from exporter.runtime import build_runtime, live_sources
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

    torch_source, nvml_source = TorchAllocatorSource(), NvmlSource()
    config = load_config(env={})
    runtime = build_runtime(config, mode="embedded", sources=live_sources(config, torch=True))
    results = {
        "devices": len(devices),
        "naive_memory_stats_and_gauges": measure(naive),
        "cheapest_nested_dict": measure(cheapest),
        "ours_torch_source": measure(torch_source.read),
        "ours_nvml_source": measure(nvml_source.read),
        "ours_allocator_plus_nvml": measure(lambda: (torch_source.read(), nvml_source.read())),
        "ours_full_tick": measure(runtime.sampler.tick),
    }
    from prometheus_client import generate_latest

    results["ours_render_metrics"] = measure(lambda: generate_latest(runtime.registry), 500)
    results["naive_render_metrics"] = measure(lambda: generate_latest(registry), 500)
    results["machine"] = machine()
    del held
    emit(results)


if __name__ == "__main__":
    main()
