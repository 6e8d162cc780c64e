"""/metrics as Prometheus scrapes it, side by side with the same series served the naive way.

Ours: the exporter's server (uvicorn, TCP_NODELAY, bytes rendered once per tick). Naive:
prometheus_client's own `start_http_server` over the very same registry, rendering on every
scrape, as a tutorial exporter does. Both serve 8 GPUs' worth of series: the real readings of
this machine's GPUs, replicated under further device labels until there are 8.

Measured, for each server: latency on a kept-alive connection (as Prometheus scrapes) and on
a new connection per request, idle and while a Python-bound decoder loop runs in this process;
CPU per scrape (this process's CPU time over many scrapes, sampler stopped, so it is the
serving cost alone); render cost; and, once, a real Prometheus scraping both every second,
reading its own `scrape_duration_seconds`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import torch

from bench.common import (
    Decoder,
    Scraper,
    emit,
    free_port,
    machine,
    scrape_once,
    scrape_times,
    summary,
)
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


CLIENT = r"""
import http.client, sys, urllib.parse
url, count = sys.argv[1], int(sys.argv[2])
parts = urllib.parse.urlsplit(url)
conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
for _ in range(count):
    conn.request("GET", parts.path, headers={"Accept-Encoding": "gzip"})
    conn.getresponse().read()
"""


def cpu_per_scrape_us(url: str, count: int = 1000) -> float:
    """This process's CPU time per scrape while another process scrapes `count` times over
    one kept-alive connection (the naive server's HTTP/1.0 closes it: it reconnects)."""
    subprocess.run([sys.executable, "-c", CLIENT, url, "50"], check=True)  # warm-up
    c0 = time.process_time()
    subprocess.run([sys.executable, "-c", CLIENT, url, str(count)], check=True)
    return (time.process_time() - c0) / count * 1e6


def thread_cpu_us(fn, count: int) -> float:
    fn()
    c0 = time.thread_time()
    for _ in range(count):
        fn()
    return (time.thread_time() - c0) / count * 1e6


def prometheus_scrape_durations(targets: dict[str, str], seconds: float, load) -> dict:
    """A real Prometheus scraping each target every second; its scrape_duration_seconds."""
    binary = os.environ.get("PROMETHEUS_BIN") or shutil.which("prometheus")
    if not binary:
        return {"error": "no prometheus binary (set PROMETHEUS_BIN)"}
    folder = Path(tempfile.mkdtemp())
    jobs = []
    for job, url in targets.items():
        parts = urllib.parse.urlsplit(url)
        jobs.append(
            {
                "job_name": job,
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "metrics_path": parts.path,
                "static_configs": [{"targets": [parts.netloc]}],
            }
        )
    (folder / "prometheus.yml").write_text(json.dumps({"scrape_configs": jobs}))
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        load(seconds)
        result = {}
        for job in targets:
            query = f'scrape_duration_seconds{{job="{job}"}}[{int(seconds) + 5}s]'
            with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query}),
                timeout=10,
            ) as response:
                data = json.loads(response.read())["data"]["result"]
            values = [float(v) for _, v in data[0]["values"]] if data else []
            result[job] = summary(values, 1e3)
        return result
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()

    from prometheus_client import generate_latest, start_http_server

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
    naive_port = free_port()
    naive_server, _ = start_http_server(naive_port, registry=runtime.registry)
    urls = {"ours": f"{http.url}/metrics", "naive": f"http://127.0.0.1:{naive_port}/metrics"}
    runtime.sampler.start()
    time.sleep(1.5)
    text = scrape_once(urls["ours"]).decode()
    series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))

    rng = random.Random(1)

    def serve(seconds: float) -> None:
        steps: list[float] = []
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            decoder.request(rng.choice([1, 4, 8, 16]), 64, 32, steps)

    result: dict = {"devices_worth": args.devices, "series": series, "servers": {}}
    result["exposition_bytes"] = len(text)
    for name, url in urls.items():
        server: dict = {}
        server["idle_kept_alive_ms"] = summary(scrape_times(url, 300, reuse=True)[20:], 1e3)
        server["idle_new_connection_ms"] = summary(scrape_times(url, 300, reuse=False)[20:], 1e3)
        scraper = Scraper(url, 0.1, Path(tempfile.mkdtemp()) / "lat.json")
        serve(args.seconds)
        server["under_load_kept_alive_ms"] = summary(scraper.stop(), 1e3)
        result["servers"][name] = server
    # Serving cost alone: no ticks meanwhile (ours then serves cached bytes every time).
    runtime.sampler.stop()
    for name, url in urls.items():
        result["servers"][name]["cpu_per_scrape_us"] = cpu_per_scrape_us(url)
    exposition = runtime.exposition
    assert exposition is not None
    result["render_us"] = {
        "cached_bytes": thread_cpu_us(lambda: exposition.body("", "gzip"), 20000),
        "prometheus_client_text": thread_cpu_us(lambda: generate_latest(runtime.registry), 300),
    }
    runtime.sampler.start()
    result["prometheus"] = prometheus_scrape_durations(urls, args.seconds + 5, serve)
    runtime.sampler.stop()
    http.stop()
    naive_server.shutdown()
    del held
    result["machine"] = machine()
    emit(result)


if __name__ == "__main__":
    main()
