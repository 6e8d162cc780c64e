"""/metrics latency while a Python-bound decoder loop holds the GIL, with 8 GPUs' worth of
series: the real readings of this machine's GPUs, replicated under further device labels
until there are 8 (the series count and label sizes are what a scrape pays for)."""

from __future__ import annotations

import argparse
import copy
import random
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Decoder, Scraper, emit, machine, scrape_once, summary
from exporter.sample import SourceReading


class Replicated:
    """Wraps real sources; repeats their per-GPU readings under new device numbers."""

    name = "replicated"

    def __init__(self, sources: list, devices: int) -> None:
        self.sources = sources
        self.devices = devices

    def read(self) -> SourceReading:
        out = SourceReading()
        for source in self.sources:
            reading = source.read()
            out.allocators += reading.allocators
            out.gpus += reading.gpus
            out.processes += reading.processes
        real_allocators, real_gpus = list(out.allocators), list(out.gpus)
        real_processes = list(out.processes)
        copies = max(self.devices // max(len(real_gpus), 1), 1)
        for k in range(1, copies):
            for a in real_allocators:
                clone = copy.copy(a)
                clone.device, clone.gpu_uuid = a.device + k * len(real_gpus), f"{a.gpu_uuid}-{k}"
                out.allocators.append(clone)
            for g in real_gpus:
                clone = copy.copy(g)
                clone.index, clone.uuid = g.index + k * len(real_gpus), f"{g.uuid}-{k}"
                out.gpus.append(clone)
            for p in real_processes:
                clone = copy.copy(p)
                clone.gpu_index = p.gpu_index + k * len(real_gpus)
                clone.gpu_uuid = f"{p.gpu_uuid}-{k}"
                out.processes.append(clone)
        return out

    def close(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()

    from exporter.config import load_config
    from exporter.http.server import HttpServer, create_app
    from exporter.runtime import build_runtime
    from exporter.sources.host import HostMemorySource
    from exporter.sources.nvml import NvmlSource
    from exporter.sources.torch_allocator import TorchAllocatorSource

    held = [
        torch.empty(1 << 26, dtype=torch.uint8, device=f"cuda:{d}")
        for d in range(torch.cuda.device_count())
    ]
    decoder = Decoder()
    config = load_config(env={}, port=0)
    sources = [Replicated([TorchAllocatorSource(), NvmlSource()], args.devices), HostMemorySource()]
    runtime = build_runtime(config, mode="embedded", sources=sources)
    http = HttpServer(create_app(runtime), "127.0.0.1", 0)
    http.start()
    runtime.sampler.start()
    time.sleep(1.5)
    text = scrape_once(f"{http.url}/metrics").decode()
    series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    idle_latencies = []
    for _ in range(100):
        t0 = time.perf_counter()
        scrape_once(f"{http.url}/metrics")
        idle_latencies.append(time.perf_counter() - t0)
    scraper = Scraper(f"{http.url}/metrics", 0.1, Path(tempfile.mkdtemp()) / "lat.json")
    rng = random.Random(1)
    steps: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        decoder.request(rng.choice([1, 4, 8, 16]), 64, 32, steps)
    loaded = scraper.stop()
    runtime.sampler.stop()
    http.stop()
    del held
    emit(
        {
            "devices_worth": args.devices,
            "series": series,
            "exposition_bytes": len(text),
            "scrape_idle_ms": summary(idle_latencies, 1e3),
            "scrape_under_load_ms": summary(loaded, 1e3),
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
