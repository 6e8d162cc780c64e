"""Where the embedded exporter's CPU goes in the serving process: a sampling profile of its
threads while it runs as in production, and a deterministic profile of its tick and render.

The process: a thread allocating GPU memory, `exporter.start()` at 1 Hz, scraped once a second
over a kept-alive connection with Prometheus 3's headers. For `--seconds`:

1. py-spy (if installed) samples every thread at 200 Hz; the exporter's threads' samples are
   summed by function (self time) and by the exporter function they run under;
2. each exporter thread's CPU clock gives its CPU per second, and the CPU of each tick and of
   each /metrics body (render and gzip when the tick is new) is read around the call, in
   place: cold, as once a second finds the caches, unlike a loop of calls.

Then the sampler is stopped and `--ticks` ticks and renders are run under cProfile (top
functions by own time). Writes `profile_embedded.json` and, if py-spy ran,
`pyspy_collapsed.txt` under `--out`.

    python -m bench.profile_embedded --seconds 20 --out /tmp/profile
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import machine, summary
from bench.loop_lateness import _SCRAPER, PROMETHEUS_ACCEPT, _threads_cpu_s


def _allocating(stop: threading.Event) -> None:
    import torch

    while not stop.is_set():
        kept = [torch.empty(4 << 20, dtype=torch.uint8, device="cuda:0") for _ in range(8)]
        del kept
        time.sleep(0.005)


def _pyspy_summary(path: Path) -> dict[str, Any]:
    """Self samples by function, and samples by the outermost exporter function, of the
    exporter's threads (py-spy's collapsed stacks: `thread;frame;frame count`)."""
    own: collections.Counter[str] = collections.Counter()
    under: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        frames = stack.split(";")
        if not frames or "gpumem" not in frames[0]:
            continue
        count = int(count_text)
        total += count
        own[frames[-1]] += count
        exporter_frames = [f for f in frames if "/exporter/" in f]
        under[exporter_frames[-1] if exporter_frames else frames[-1]] += count
    return {
        "exporter_thread_samples": total,
        "self": own.most_common(25),
        "innermost_exporter_frame": under.most_common(25),
    }


class InPlace:
    """CPU (thread clock) of each call of a bound method, replacing it on its instance (or
    of a callable, given as `method`)."""

    def __init__(self, instance: Any, name: str, method: Any = None) -> None:
        self.method = getattr(instance, name) if method is None else method
        self.times: list[float] = []
        if method is None:
            setattr(instance, name, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return self.method(*args, **kwargs)
        finally:
            self.times.append(time.thread_time() - started)


class Profiled:
    """cProfile around each call of a bound method, on the thread that calls it (in place,
    while the server runs), replacing it on its instance."""

    def __init__(self, instance: Any, name: str) -> None:
        self.method = getattr(instance, name)
        self.profile = cProfile.Profile()
        setattr(instance, name, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.profile.runcall(self.method, *args, **kwargs)

    def top(self) -> str:
        out = io.StringIO()
        pstats.Stats(self.profile, stream=out).sort_stats("tottime").print_stats(30)
        return out.getvalue()


def _cprofile(fn: Any, count: int) -> str:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(count):
        fn()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--ticks", type=int, default=500)
    parser.add_argument("--port", type=int, default=9472)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    import exporter

    torch.empty(1, device="cuda:0")
    stop = threading.Event()
    threading.Thread(target=_allocating, args=(stop,), name="allocator", daemon=True).start()
    handle = exporter.start(port=args.port, interval_s=1.0)
    assert handle.runtime.exposition is not None
    sampler = handle.runtime.sampler
    ticks = InPlace(sampler, "tick")
    bodies = InPlace(handle.runtime.exposition, "body")
    parts = {f"source {s.name}": InPlace(s, "read") for s in sampler.sources}
    listeners = [InPlace(None, "", listener) for listener in sampler.listeners]
    sampler.listeners[:] = listeners
    for listener in listeners:
        name = getattr(listener.method, "__name__", type(listener.method).__name__)
        parts[f"listener {name}"] = listener
    time.sleep(1.5)
    url = f"http://127.0.0.1:{args.port}"
    scraper = subprocess.Popen([sys.executable, "-c", _SCRAPER, url, str(args.seconds), "/metrics"])
    result: dict[str, Any] = {"machine": machine(), "seconds": args.seconds}
    pyspy = shutil.which("py-spy")
    collapsed = args.out / "pyspy_collapsed.txt"
    spy = None
    if pyspy:
        spy = subprocess.Popen(
            [pyspy, "record", "--pid", str(os.getpid()), "--duration", str(int(args.seconds)),
             "--rate", "200", "--threads", "--format", "raw", "--nonblocking",
             "--output", str(collapsed)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
    before, started = _threads_cpu_s(), time.perf_counter()
    scraper.wait(timeout=args.seconds + 30)
    wall = time.perf_counter() - started
    after = _threads_cpu_s()
    result["threads_cpu_ms_per_s"] = {
        name: (cpu - before.get(name, 0.0)) / wall * 1000 for name, cpu in after.items()
    }
    result["in_place_us"] = {
        "tick": summary(ticks.times[2:], 1e6),
        "metrics_body": summary(bodies.times[2:], 1e6),
        **{name: summary(part.times[2:], 1e6) for name, part in parts.items()},
    }
    if spy is not None:
        _, err = spy.communicate(timeout=60)
        if collapsed.exists():
            result["pyspy"] = _pyspy_summary(collapsed)
        else:
            result["pyspy_error"] = err[-2000:]
    else:
        result["pyspy_error"] = "py-spy not installed"
    runtime = handle.runtime
    # In place again, under cProfile: what the tick and the render spend their time on.
    profiled_tick = Profiled(runtime.sampler, "tick")
    profiled_body = Profiled(runtime.exposition, "body")
    scraper = subprocess.Popen([sys.executable, "-c", _SCRAPER, url, str(args.seconds), "/metrics"])
    scraper.wait(timeout=args.seconds + 30)
    result["cprofile_tick_in_place"] = profiled_tick.top()
    result["cprofile_body_in_place"] = profiled_body.top()
    del runtime.sampler.tick, runtime.exposition.body  # the classes' own methods again
    runtime.sampler.stop()  # closes sources: tick again with fresh ones below
    stop.set()
    from exporter.runtime import sources_for

    runtime.sampler.sources = sources_for("embedded", runtime.config)
    exposition = runtime.exposition
    assert exposition is not None

    def render() -> None:
        exposition._key = None  # a new tick: render again
        exposition.body(PROMETHEUS_ACCEPT, "gzip")

    result["cprofile_tick"] = _cprofile(runtime.sampler.tick, args.ticks)
    result["cprofile_render"] = _cprofile(render, args.ticks)
    (args.out / "profile_embedded.json").write_text(json.dumps(result, indent=1))
    handle.stop()
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("cprofile")}))


if __name__ == "__main__":
    main()
