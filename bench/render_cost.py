"""What rendering /metrics costs, per 100 series, against the naive sidecar and the floor.

The series are real readings: this machine's GPUs through the exporter's own sources (on a
GPU machine), else the packaged demo trace (recorded on an H100); repeated under further
device numbers for 8 GPUs' worth. For each, CPU per render of:

- `prometheus_client`: its encoder over the registry, as the exporter rendered before issue 35
  (its collect() builds prometheus_client's families, the encoder writes every line);
- `ours`: the exporter's rows through its templates (exporter.exposition_templates), split in
  `rows` (the collector filling its families from the sample) and `templates` (the text);
- `floor`: formatting the values alone (`floatToGoString` of each, joined), nothing else;
- `naive`: the tutorial sidecar, six Gauges per GPU set from `torch.cuda.memory_stats()`-sized
  values and prometheus_client's encoder (its render only).

Text 0.0.4 and OpenMetrics 1.0.0 (what Prometheus 3 asks for). One JSON object on stdout.

    python -m bench.render_cost --devices 1 --devices 8
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import choose_encoder
from prometheus_client.utils import floatToGoString

from bench.common import machine, summary
from exporter.config import load_config
from exporter.exposition_templates import TemplateRenderer, families_of
from exporter.runtime import Runtime, build_runtime
from exporter.sample import SourceReading

FORMATS = {
    "text": "text/plain;version=0.0.4",
    "openmetrics": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
}


def cpu_us(fn: Callable[[], object], count: int) -> dict[str, float]:
    """CPU microseconds per call (thread CPU clock), median and p99 over `count` calls."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(count):
        started = time.thread_time()
        fn()
        times.append(time.thread_time() - started)
    return summary(times, 1e6)


def _sources(devices: int) -> tuple[list[Any], str]:
    import torch

    if torch.cuda.is_available():
        from bench.scrape_latency import Replicated
        from exporter.sources.host import HostMemorySource
        from exporter.sources.nvml import NvmlSource
        from exporter.sources.torch_allocator import TorchAllocatorSource

        for d in range(torch.cuda.device_count()):
            torch.empty(1 << 26, dtype=torch.uint8, device=f"cuda:{d}")
        replicated = Replicated([TorchAllocatorSource(), NvmlSource()], devices)
        return [replicated, HostMemorySource()], "this machine's GPUs"
    return [_DemoReplicated(devices)], "the demo trace"


class _DemoReplicated:
    """The demo trace's busiest sample, repeated under `devices` device numbers."""

    name = "demo"

    def __init__(self, devices: int) -> None:
        import copy

        from exporter.sources.replay import demo_trace_path
        from exporter.trace import read_trace

        _, samples = read_trace(demo_trace_path())
        sample = max(samples, key=lambda s: len(s.allocators) + len(s.gpus))
        self.reading = SourceReading(host=sample.host)
        for k in range(devices):
            for a in sample.allocators:
                clone = copy.copy(a)
                clone.device, clone.gpu_uuid = k, f"{a.gpu_uuid}-{k}"
                self.reading.allocators.append(clone)
            for g in sample.gpus:
                gpu = copy.copy(g)
                gpu.index, gpu.uuid = k, f"{g.uuid}-{k}"
                self.reading.gpus.append(gpu)

    def read(self) -> SourceReading:
        return self.reading

    def close(self) -> None:
        pass


def _naive(devices: int) -> CollectorRegistry:
    registry = CollectorRegistry()
    names = ("allocated", "reserved", "active", "inactive_split", "peak_allocated", "retries")
    gauges = [Gauge(f"naive_{n}_bytes", n, ["device"], registry=registry) for n in names]
    for d in range(devices):
        for i, gauge in enumerate(gauges):
            gauge.labels(str(d)).set(float(1 << (20 + i)) * (d + 1))
    return registry


def measure(runtime: Runtime, devices: int, count: int) -> dict[str, Any]:
    exposition = runtime.exposition
    assert exposition is not None
    collectors = exposition._collectors
    families = list(families_of(collectors))
    values = [v for family in families for v in family.values()]
    result: dict[str, Any] = {"devices": devices, "series": len(values)}
    naive = _naive(devices)
    for name, accept in FORMATS.items():
        encoder = choose_encoder(accept)[0]
        renderer = TemplateRenderer(encoder)
        rows = cpu_us(lambda: list(families_of(collectors)), count)
        templates = cpu_us(lambda: renderer.render(families), count)  # noqa: B023
        result[name] = {
            "prometheus_client": cpu_us(lambda: encoder(runtime.registry), count),  # noqa: B023
            "ours": cpu_us(lambda: renderer.render(families_of(collectors)), count),  # noqa: B023
            "rows": rows,
            "templates": templates,
            "floor": cpu_us(lambda: "".join([floatToGoString(v) for v in values]), count),
            "naive": cpu_us(lambda: encoder(naive), count),  # noqa: B023
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, action="append")
    parser.add_argument("--count", type=int, default=2000)
    args = parser.parse_args()
    results = []
    for devices in args.devices or [1, 8]:
        sources, origin = _sources(devices)
        runtime = build_runtime(load_config(env={}), mode="embedded", sources=sources)
        runtime.sampler.tick()
        results.append({"readings": origin, **measure(runtime, devices, args.count)})
        runtime.sampler.stop()
    print(json.dumps({"machine": machine(), "results": results}))


if __name__ == "__main__":
    main()
