"""What fresh per-process and non-allocator numbers cost per tick.

An embedded exporter's allocator and NVML sources read once per tick, in two states:
- steady: memory stands still (the process list is read only on its 10 s round);
- moving: between two ticks (untimed) 64 MiB is allocated or freed with the cache emptied,
  so reserved and NVML's used move on every tick (the process list is read on each, and the
  non-allocator bytes are taken again, bracketed by a second stats read).
The sources' clocks advance one second per tick, as at 1 Hz. To compare with another version,
run it with that version's package first on PYTHONPATH (docs/performance.md does).

    python3 -m bench.freshness_cost
"""

from __future__ import annotations

import time

import torch

from bench.common import MiB, emit, machine, summary

TICKS = 2000


class TickClock:
    """One second per tick: the sources' periodic rounds as at 1 Hz."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _calls(count: int = 2000) -> dict[str, float]:
    """Mean wall time of the calls a tick is made of, on GPU 0."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    calls = {
        "nvml_memory_v1": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle),
        "nvml_memory_v2": lambda: pynvml.nvmlDeviceGetMemoryInfo(
            handle, version=pynvml.nvmlMemory_v2
        ),
        "nvml_process_list": lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle),
        "allocator_stats": lambda: torch._C._cuda_memoryStats(0),
    }
    result = {}
    for name, call in calls.items():
        started = time.perf_counter()
        for _ in range(count):
            call()
        result[name] = (time.perf_counter() - started) / count * 1e6
    pynvml.nvmlShutdown()
    return result


def _used_values() -> int:
    """How many distinct values NVML's used memory of GPU 0 takes in 100 reads, 1 ms apart,
    with nothing allocating: whether the device reading is a quiet signal."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    values = set()
    for _ in range(100):
        values.add(pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).used)
        time.sleep(0.001)
    pynvml.nvmlShutdown()
    return len(values)


def main() -> None:
    import pynvml

    import exporter
    from exporter.config import load_config
    from exporter.runtime import sources_for

    # Count the process-list reads of each state (the sources call the module's function).
    list_reads = [0]
    read_list = pynvml.nvmlDeviceGetComputeRunningProcesses

    def counted(handle: object) -> object:
        list_reads[0] += 1
        return read_list(handle)

    pynvml.nvmlDeviceGetComputeRunningProcesses = counted
    held = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    config = load_config(env={"GPUMEM_HOST_MEMORY": "false"})
    sources = sources_for("embedded", config)
    clock = TickClock()
    for source in sources:
        # The NVML source's and (where it exists) the non-allocator probe's clocks.
        for owner in (source, getattr(source, "_non_allocator", None)):
            if owner is not None and hasattr(owner, "_clock"):
                owner._clock = clock

    per_source = {source.name: 0.0 for source in sources}

    def tick() -> tuple[float, float]:
        clock.now += 1.0
        w0, c0 = time.perf_counter(), time.thread_time()
        for source in sources:
            started = time.perf_counter()
            source.read()
            per_source[source.name] += time.perf_counter() - started
        return time.thread_time() - c0, time.perf_counter() - w0

    for _ in range(50):
        tick()
    results: dict = {"exporter_path": exporter.__file__, "devices": 1, "ticks": TICKS}
    for state in ("steady", "moving"):
        cpu, wall = [], []
        list_reads[0] = 0
        per_source.update((name, 0.0) for name in per_source)
        moving: torch.Tensor | None = None
        for _ in range(TICKS):
            if state == "moving":
                if moving is None:
                    moving = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0")
                else:
                    moving = None
                torch.cuda.empty_cache()
                torch.cuda.synchronize()
            c, w = tick()
            cpu.append(c)
            wall.append(w)
        results[state] = {
            "wall_us": summary(wall, 1e6),
            "cpu_mean_us": sum(cpu) / len(cpu) * 1e6,
            "wall_mean_us": sum(wall) / len(wall) * 1e6,
            "process_list_reads_per_tick": list_reads[0] / TICKS,
            "per_source_wall_mean_us": {n: t / TICKS * 1e6 for n, t in per_source.items()},
        }
    pynvml.nvmlDeviceGetComputeRunningProcesses = read_list
    results["calls_us"] = _calls()
    results["used_v2_distinct_in_100_reads"] = _used_values()
    results["machine"] = machine()
    del held
    emit(results)


if __name__ == "__main__":
    main()
