"""What each tick of `run`'s agent costs the serving process, by kind: a probe record (the
allocator's C call, the numbers packed, one non-blocking send) or a full sample (the allocator
source's whole read: layout when due, bytes outside the allocator, settings; then asdict and
JSON). A real Aggregator on a Unix socket in this process, the Agent ticked by its own thread at
the interval, a thread allocating and freeing GPU memory beside it as in bench.loop_lateness.

    python -m bench.loop_lateness ... (the serving loop's view)
    python -m bench.probe_ticks --seconds 12 --interval-s 1.0 (this: the tick's own view)

CPU is the ticking thread's CPU clock around each tick. `full-every-tick` forces the full
sample on every tick: what the agent did before the probe (issue 49). One JSON object on the
last line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import summary


def _allocating() -> tuple[threading.Event, threading.Thread]:
    """CUDA initialized and a thread allocating and freeing GPU memory beside the ticks, as
    in bench.loop_lateness; set the event and join the thread to end it."""
    import torch

    torch.empty(1, device="cuda:0")
    stop = threading.Event()

    def allocate() -> None:
        while not stop.is_set():
            kept = [torch.empty(4 << 20, dtype=torch.uint8, device="cuda:0") for _ in range(8)]
            del kept
            time.sleep(0.005)

    allocator = threading.Thread(target=allocate, daemon=True)
    allocator.start()
    return stop, allocator


def measure(seconds: float, interval_s: float, full_every_tick: bool) -> dict[str, Any]:

    from exporter.transport.agent import Agent
    from exporter.transport.aggregator import Aggregator

    stop, allocator = _allocating()
    run_dir = Path(tempfile.mkdtemp(prefix="pt-", dir="/tmp"))
    aggregator = Aggregator(run_dir)
    agent = Agent(str(run_dir), interval_s=3600)
    kinds: dict[str, list[float]] = {"record": [], "full": []}
    full = agent._full_tick
    took: list[str] = []

    def full_tick() -> None:
        took.append("full")
        full()

    agent._full_tick = full_tick  # type: ignore[method-assign]
    agent.tick()  # connect and the first full sample, outside the measurement
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(interval_s)
        if full_every_tick:
            agent._next_full = 0.0
        took.clear()
        started = time.thread_time()
        agent.tick()
        cpu = time.thread_time() - started
        kinds["full" if took else "record"].append(cpu)
    stop.set()
    allocator.join(10)
    agent.stop()
    served = aggregator.read().allocators
    aggregator.close()
    for child in run_dir.iterdir():
        child.unlink()
    run_dir.rmdir()
    ticks = sum(len(v) for v in kinds.values())
    return {
        "full_every_tick": full_every_tick,
        "interval_s": interval_s,
        "ticks": ticks,
        "records_dropped": agent.records_dropped,
        "served_allocated_bytes": served[0].gauges.get("allocated_bytes") if served else None,
        "cpu_ms_per_s": sum(sum(v) for v in kinds.values()) / seconds * 1000,
        "by_kind_us": {k: {"n": len(v), **summary(v, 1e6)} for k, v in kinds.items() if v},
    }


def versus_bare(seconds: float, interval_s: float) -> dict[str, Any]:
    """The agent's ticks and the bare probe's (bench.loop_lateness's floor: the C call, 47
    numbers, one struct pack, one non-blocking write to a pipe) in one thread, taking turns
    at the interval, so that both find the caches as cold; the agent's record tick in its
    parts (the probe's records, their sending)."""

    from bench.loop_lateness import bare_tick
    from exporter.transport.agent import Agent
    from exporter.transport.aggregator import Aggregator

    stop, allocator = _allocating()
    bare, reader = bare_tick()
    run_dir = Path(tempfile.mkdtemp(prefix="pt-", dir="/tmp"))
    aggregator = Aggregator(run_dir)
    agent = Agent(str(run_dir), interval_s=3600)
    parts: dict[str, list[float]] = {"bare": [], "record": [], "full": [], "records()": []}
    parts["send"] = []
    records, send_record, full = agent.probe.records, agent._send_record, agent._full_tick
    took: list[str] = []

    def timed_records() -> list[bytes]:
        started = time.thread_time()
        found = records()
        parts["records()"].append(time.thread_time() - started)
        return found

    def timed_send(data: bytes, count: int = 1) -> None:
        started = time.thread_time()
        send_record(data, count)
        parts["send"].append(time.thread_time() - started)

    def full_tick() -> None:
        took.append("full")
        full()

    agent.probe.records = timed_records  # type: ignore[method-assign]
    agent._send_record = timed_send  # type: ignore[method-assign]
    agent._full_tick = full_tick  # type: ignore[method-assign]
    agent.tick()
    stopped = threading.Event()
    end = time.monotonic() + seconds
    turn = 0
    while time.monotonic() < end:
        stopped.wait(interval_s)  # as both wait: Event.wait with the interval
        turn += 1
        took.clear()
        started = time.thread_time()
        if turn % 2:
            bare()
            parts["bare"].append(time.thread_time() - started)
            continue
        agent.tick()
        parts["full" if took else "record"].append(time.thread_time() - started)
    stop.set()
    allocator.join(10)
    agent.stop()
    aggregator.close()
    reader.stdin.close()
    reader.wait(10)
    for child in run_dir.iterdir():
        child.unlink()
    run_dir.rmdir()
    return {
        "interval_s": interval_s,
        "by_kind_us": {k: summary(v, 1e6) for k, v in parts.items() if v},
    }


def profile_full(ticks: int) -> dict[str, Any]:
    """Where a full sample's CPU goes: `ticks` full samples with the layout and NVML's process
    list forced due on each (as every `detail_interval_s` in a real run), then the same
    without them, and one cProfile of the forced ones (top functions on stderr)."""
    import cProfile
    import io
    import pstats
    import sys

    import torch

    from exporter.transport.agent import Agent
    from exporter.transport.aggregator import Aggregator

    torch.empty(1, device="cuda:0")
    kept = [torch.empty(n << 20, dtype=torch.uint8, device="cuda:0") for n in (1, 3, 7, 20)]
    run_dir = Path(tempfile.mkdtemp(prefix="pt-", dir="/tmp"))
    aggregator = Aggregator(run_dir)
    agent = Agent(str(run_dir), interval_s=3600)
    agent.tick()

    def force() -> None:
        agent._next_full = 0.0
        layout = getattr(agent.source, "_layout", None)
        if layout is not None:
            layout._next = 0.0
        non_allocator = getattr(agent.source, "_non_allocator", None)
        if non_allocator is not None:
            non_allocator._taken.clear()

    def timed(forced: bool) -> list[float]:
        took = []
        for _ in range(ticks):
            if forced:
                force()
            else:
                agent._next_full = 0.0
            started = time.thread_time()
            agent.tick()
            took.append(time.thread_time() - started)
            time.sleep(0.002)
        return took

    result = {
        "full_with_layout_and_process_list_us": summary(timed(True), 1e6),
        "full_without_us": summary(timed(False), 1e6),
    }
    profiler = cProfile.Profile(time.thread_time)
    for _ in range(ticks):
        force()
        profiler.enable()
        agent.tick()
        profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue(), file=sys.stderr)
    agent.stop()
    aggregator.close()
    del kept
    for child in run_dir.iterdir():
        child.unlink()
    run_dir.rmdir()
    return result


def cold_parts(seconds: float, interval_s: float, every: int) -> dict[str, Any]:
    """Where a full sample's CPU goes on caches as cold as a real run finds them: the agent
    ticked at the interval, a full sample (layout and NVML's process list due) every `every`
    ticks, each of its parts timed by the thread's CPU clock."""
    from exporter.transport.agent import Agent
    from exporter.transport.aggregator import Aggregator

    stop, allocator = _allocating()
    run_dir = Path(tempfile.mkdtemp(prefix="pt-", dir="/tmp"))
    aggregator = Aggregator(run_dir)
    agent = Agent(str(run_dir), interval_s=3600)
    agent.tick()  # connected, armed: the parts exist now
    source = agent.source
    parts: dict[str, list[float]] = {}

    def timed(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                parts.setdefault(label, []).append(time.thread_time() - started)

        setattr(owner, name, wrapper)

    timed(agent, "_full_tick", "full")
    timed(source, "read", "source.read")
    timed(agent, "_send", "sample encode+send")
    timed(agent.probe, "records", "records()")
    if getattr(source, "_non_allocator", None) is not None:
        timed(source._non_allocator, "apply", "non_allocator.apply")
    if getattr(source, "_layout", None) is not None:
        timed(source._layout, "read", "layout.read")
    timed(source, "_pinned_host", "pinned_host")
    timed(source.ooms, "annotate", "ooms.annotate")
    stopped = threading.Event()
    end = time.monotonic() + seconds
    turn = 0
    ticks: list[float] = []
    while time.monotonic() < end:
        stopped.wait(interval_s)
        turn += 1
        if turn % every == 0:
            agent._next_full = 0.0
            layout = getattr(source, "_layout", None)
            if layout is not None:
                layout._next = 0.0
            non_allocator = getattr(source, "_non_allocator", None)
            if non_allocator is not None:
                non_allocator._taken.clear()
        started = time.thread_time()
        agent.tick()
        ticks.append(time.thread_time() - started)
    stop.set()
    allocator.join(10)
    agent.stop()
    aggregator.close()
    for child in run_dir.iterdir():
        child.unlink()
    run_dir.rmdir()
    return {
        "interval_s": interval_s,
        "full_every": every,
        "ticks": len(ticks),
        "parts_us": {k: summary(v, 1e6) for k, v in parts.items()},
    }


def snapshot_forms(seconds: float, interval_s: float) -> dict[str, Any]:
    """The allocator snapshot's C call in its two forms, taking turns at the interval beside
    a thread allocating GPU memory (caches as cold as a tick finds them): `None` (every pool,
    the history trace included, empty while history is off) and `(0, 0, False)` (torch 2.11+:
    every pool, no trace), and the layout's walk of the segments; each by the thread's CPU
    clock."""
    from exporter.sources.allocator_layout import layouts_from_segments

    stop, allocator = _allocating()
    import torch

    snapshot = torch._C._cuda_memorySnapshot
    parts: dict[str, list[float]] = {"None": [], "(0, 0, False)": [], "walk": []}
    stopped = threading.Event()
    end = time.monotonic() + seconds
    turn = 0
    while time.monotonic() < end:
        stopped.wait(interval_s)
        turn += 1
        form: Any = None if turn % 2 else (0, 0, False)
        started = time.thread_time()
        taken = snapshot(form)
        parts["None" if form is None else "(0, 0, False)"].append(time.thread_time() - started)
        started = time.thread_time()
        layouts_from_segments(taken.get("segments", ()))
        parts["walk"].append(time.thread_time() - started)
    stop.set()
    allocator.join(10)
    return {"interval_s": interval_s, "parts_us": {k: summary(v, 1e6) for k, v in parts.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--full-every-tick", action="store_true")
    parser.add_argument(
        "--versus-bare", action="store_true", help="the bare probe's ticks and ours, in turns"
    )
    parser.add_argument(
        "--profile", type=int, default=0, help="this many full samples, their parts (CPU)"
    )
    parser.add_argument(
        "--cold-parts",
        type=int,
        default=0,
        help="a full sample every this many ticks, its parts timed (CPU, caches cold)",
    )
    parser.add_argument(
        "--snapshot-forms", action="store_true", help="the snapshot's C call, both forms (CPU)"
    )
    args = parser.parse_args()
    os.environ.setdefault("GPUMEM_LOG_LEVEL", "warning")
    if args.snapshot_forms:
        print(json.dumps(snapshot_forms(args.seconds, args.interval_s)))
        return
    if args.versus_bare:
        print(json.dumps(versus_bare(args.seconds, args.interval_s)))
        return
    if args.cold_parts:
        print(json.dumps(cold_parts(args.seconds, args.interval_s, args.cold_parts)))
        return
    if args.profile:
        print(json.dumps(profile_full(args.profile)))
        return
    print(json.dumps(measure(args.seconds, args.interval_s, args.full_every_tick)))


if __name__ == "__main__":
    main()
