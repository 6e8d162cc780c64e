"""Serving impact, resolved to a fraction of a percent: what the exporter takes from a
Python-bound decoder loop in the same process.

Three measurements, all in one process:
1. Paired A/B: many short runs of the same decode workload (a fixed number of steps, fixed
   batch), in blocks of (off, 1 Hz, 10 Hz) in a random order per block, while a scraper
   process scrapes /metrics every second over a kept-alive connection as Prometheus does.
   Per block, the slowdown of each exporter run against the block's own "off" run; reported
   as a mean with a 95% confidence interval (normal approximation over the blocks). Pairing
   within a block removes the drift (clocks, thermals) that made unpaired 10 s runs spread 10%.
2. The exporter's own threads: CPU time of the sampler and HTTP threads per second of serving
   (`pthread_getcpuclockid`), an upper bound of the GIL time they can take.
3. GIL wait of the serving thread: after every decode step the serving thread gives up the
   GIL and takes it back (a zero-timeout `select`, as it does around every CUDA sync); how
   long taking it back takes is how long another thread held it. Summed per second.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import select
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.common import Decoder, Scraper, emit, machine, summary

# name -> (sampler interval, exporter.start() settings, scraped every second), or None: off.
# The last two take one part away from 10 Hz each, to tell which part costs.
CONFIGS: dict[str, tuple[float, dict, bool] | None] = {
    "off": None,
    "1Hz": (1.0, {}, True),
    "10Hz": (0.1, {}, True),
    "10Hz-no-NVML": (0.1, {"nvml": False}, True),
    "10Hz-no-scrapes": (0.1, {}, False),
}


def thread_cpu_s(names: tuple[str, ...]) -> float:
    total = 0.0
    for thread in threading.enumerate():
        if thread.name in names and thread.ident is not None:
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return total


def run(decoder: Decoder, steps: int, batch: int) -> tuple[float, list[float]]:
    """Decode `steps` tokens; return the wall time and each step's GIL wait."""
    torch_ = decoder.torch
    h = decoder.hidden
    waits = []
    x = torch_.randn(batch, 64, h, device=decoder.device, dtype=torch_.bfloat16)
    kv = [x[..., :h] for _ in decoder.layers]
    step = x[:, -1:, :]
    started = time.perf_counter()
    for n in range(steps):
        if n % 64 == 0:  # a new request: the KV cache starts again
            kv = [x[..., :h] for _ in decoder.layers]
        for i, layer in enumerate(decoder.layers):
            qkv = step @ layer["qkv"]
            kv[i] = torch_.cat([kv[i], qkv[..., h : 2 * h]], dim=1)
            attn = torch_.softmax((qkv[..., :h] @ kv[i].transpose(1, 2)) / 32.0, dim=-1)
            step = (attn @ kv[i]) @ layer["o"] + step
            step = torch_.nn.functional.gelu(step @ layer["up"]) @ layer["down"] + step
        step = step / (step.float().norm(dim=-1, keepdim=True).to(step.dtype) + 1)
        torch_.cuda.synchronize(decoder.device)
        t0 = time.perf_counter()
        # Give the GIL up and take it back (a zero-timeout select releases it and returns at
        # once; time.sleep(0) would add ~50 us of timer slack): the wait is another thread's
        # hold on the GIL.
        select.select([], [], [], 0)
        waits.append(time.perf_counter() - t0)
    return time.perf_counter() - started, waits


def mean_ci(values: list[float]) -> dict[str, float]:
    mean = statistics.fmean(values)
    half = 1.96 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return {"mean": mean, "ci95_low": mean - half, "ci95_high": mean + half, "n": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--configs", default="off,1Hz,10Hz", help=f"of {', '.join(CONFIGS)}")
    args = parser.parse_args()
    names = args.configs.split(",")

    import exporter

    decoder = Decoder()
    run(decoder, args.steps * 3, args.batch)  # warm-up: kernels, allocator, clocks
    rng = random.Random(0)
    tmp = Path(tempfile.mkdtemp())
    walls: dict[str, list[float]] = {name: [] for name in names}
    waits: dict[str, list[float]] = {name: [] for name in names}
    wait_per_s: dict[str, list[float]] = {name: [] for name in names}
    thread_cpu: dict[str, list[float]] = {name: [] for name in names}
    scrapes: dict[str, list[float]] = {name: [] for name in names}
    slowdown: dict[str, list[float]] = {name: [] for name in names if name != "off"}
    for block in range(args.blocks):
        order = list(names)
        rng.shuffle(order)
        wall_of: dict[str, float] = {}
        for name in order:
            config = CONFIGS[name]
            handle = scraper = None
            if config is not None:
                interval, settings, scraped = config
                handle = exporter.start(port=0, interval_s=interval, **settings)
                if scraped:
                    scraper = Scraper(f"{handle.url}/metrics", 1.0, tmp / f"{name}{block}.json")
            # Every configuration, "off" too, waits the same and then warms the GPU up again
            # before the timed run: an idle GPU drops its clocks within half a second, and a
            # wait before exporter runs only made "off" look 4-10% faster in an earlier run.
            time.sleep(0.5)  # the scraper process is up before the run starts
            run(decoder, args.steps // 5, args.batch)
            cpu0 = thread_cpu_s(("gpumem-sampler", "gpumem-http"))
            wall, step_waits = run(decoder, args.steps, args.batch)
            cpu = thread_cpu_s(("gpumem-sampler", "gpumem-http")) - cpu0
            if scraper is not None:
                scrapes[name] += scraper.stop()
            if handle is not None:
                handle.stop()
            wall_of[name] = wall
            walls[name].append(wall)
            waits[name] += step_waits
            wait_per_s[name].append(sum(step_waits) / wall)
            thread_cpu[name].append(cpu / wall)
        for name in slowdown:
            slowdown[name].append((wall_of[name] - wall_of["off"]) / wall_of["off"] * 100)
    result: dict = {
        "blocks": args.blocks,
        "steps_per_run": args.steps,
        "batch": args.batch,
        "run_s": summary(walls["off"]),
        "configs": {},
    }
    for name in names:
        result["configs"][name] = {
            "run_s": summary(walls[name]),
            "gil_wait_per_step_us": summary(waits[name], 1e6),
            "gil_wait_ms_per_s": mean_ci([w * 1e3 for w in wait_per_s[name]]),
            "exporter_thread_cpu_ms_per_s": mean_ci([c * 1e3 for c in thread_cpu[name]]),
            "scrape_ms": summary(scrapes[name], 1e3),
        }
        if name in slowdown:
            result["configs"][name]["slowdown_pct"] = mean_ci(slowdown[name])
    # How much paired runs of the same configuration differ: the method's own resolution.
    off = walls["off"]
    noise = [(b - a) / a * 100 for a, b in zip(off[::2], off[1::2], strict=False)]
    result["off_vs_off_pct"] = mean_ci(noise) if len(noise) > 1 else {}
    result["machine"] = machine()
    del decoder
    torch.cuda.empty_cache()
    emit(result)


if __name__ == "__main__":
    main()
