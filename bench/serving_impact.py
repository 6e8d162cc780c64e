"""Serving impact: a Python-bound decoder loop without the exporter, with it at 1 Hz and at
10 Hz, while /metrics is scraped every second from another process.

Configurations are interleaved (A B C A B C ...) so that clock or thermal drift hits all of
them alike; each run serves the same seeded request mix for a fixed wall time.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Decoder, Scraper, emit, machine, summary


def serve(decoder: Decoder, seconds: float, seed: int) -> tuple[int, float, list[float]]:
    rng = random.Random(seed)
    steps: list[float] = []
    tokens = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        batch = rng.choice([1, 2, 4, 8, 16])
        tokens += decoder.request(batch, rng.choice([32, 64, 128]), 32, steps)
    return tokens, time.perf_counter() - started, steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()

    import exporter

    decoder = Decoder()
    serve(decoder, 8.0, seed=0)  # warm-up: kernels, allocator, clocks
    configs = {"off": None, "1Hz": 1.0, "10Hz": 0.1}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    scrape_latencies: dict[str, list[float]] = {name: [] for name in configs}
    tmp = Path(tempfile.mkdtemp())
    for repeat in range(args.repeats):
        for name, interval in configs.items():
            handle = scraper = None
            if interval is not None:
                handle = exporter.start(port=0, interval_s=interval)
                scraper = Scraper(f"{handle.url}/metrics", 1.0, tmp / f"{name}{repeat}.json")
            tokens, wall, steps = serve(decoder, args.seconds, seed=repeat)
            if scraper is not None and handle is not None:
                scrape_latencies[name] += scraper.stop()
                handle.stop()
            runs[name].append({"tokens_per_s": tokens / wall, "step_ms": summary(steps, 1e3)})
    result: dict = {"seconds_per_run": args.seconds, "repeats": args.repeats, "configs": {}}
    for name, items in runs.items():
        throughput = [r["tokens_per_s"] for r in items]
        result["configs"][name] = {
            "tokens_per_s": summary(throughput),
            "step_p50_ms": summary([r["step_ms"]["p50"] for r in items]),
            "step_p99_ms": summary([r["step_ms"]["p99"] for r in items]),
            "scrape_ms": summary(scrape_latencies[name], 1e3),
        }
    base = result["configs"]["off"]["tokens_per_s"]["median"]
    for name in ("1Hz", "10Hz"):
        median = result["configs"][name]["tokens_per_s"]["median"]
        result["configs"][name]["throughput_loss_pct"] = (base - median) / base * 100
    result["machine"] = machine()
    result["gpu_devices_used"] = 1
    del decoder
    torch.cuda.empty_cache()
    emit(result)


if __name__ == "__main__":
    main()
