"""How long a layout reading (segments-only snapshot + walk) stalls the serving thread.

For 1k, 10k and 50k live blocks, with history recording off and on, the serving thread of
bench/stalls.py (allocate 1 MiB, queue a kernel, free; no sync) runs while another thread
takes readings with the exporter's own code (LayoutReader with its guards lifted). Stall of a
reading = the longest serving iteration that started during it, minus the serving loop's
median iteration outside readings.

`--minute` adds the check the default settings were chosen for: a decoder serving steps for
60 s with the sampler's reader at its default cadence and the block count just under the
guard, against 60 s without readings; it reports p99 of the step time of both.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import torch

from bench.common import Decoder, MiB, emit, machine, summary
from bench.stalls import HISTORY_MODES, ServingLoop
from exporter.sources.allocator_layout import (
    DEFAULT_INTERVAL_S,
    DEFAULT_MAX_BLOCKS,
    LayoutReader,
    layouts_from_segments,
)

BLOCK_COUNTS = (1_000, 10_000, 50_000)
READINGS = 10


def _make_blocks(count: int) -> list[torch.Tensor]:
    """`count` blocks in the allocator: live tensors of mixed small and large sizes, with
    every third one freed so segments hold inactive blocks as well."""
    sizes = [512, 4096, 64 * 1024, 3 * MiB]
    tensors = [
        torch.empty(sizes[i % len(sizes)], dtype=torch.uint8, device="cuda:0") for i in range(count)
    ]
    torch.cuda.synchronize()
    return [t for i, t in enumerate(tensors) if i % 3]


def _read_once() -> dict[str, Any]:
    snapshot = torch._C._cuda_memorySnapshot(None)
    return {d: layout.blocks for d, layout in layouts_from_segments(snapshot["segments"]).items()}


def stall_per_reading(count: int, history: str) -> dict[str, Any]:
    mode = HISTORY_MODES[history]
    try:
        if mode is not None:
            torch.cuda.memory._record_memory_history(max_entries=100_000, **mode)
        live = _make_blocks(count)
        blocks = _read_once().get(0, 0)
        windows = []
        with ServingLoop() as loop:
            for _ in range(READINGS):
                start = time.perf_counter()
                _read_once()
                windows.append((start, time.perf_counter()))
                time.sleep(0.05)
        inside_any = set()
        stalls = []
        for start, end in windows:
            hit = [(t, d) for t, d in loop.times if start - 0.001 <= t <= end]
            inside_any.update(hit)
            stalls.append(max((d for _, d in hit), default=0.0))
        outside = [d for t, d in loop.times if (t, d) not in inside_any]
        base = statistics.median(outside) if outside else 0.0
        del live
        return {
            "blocks": blocks,
            "read_ms": summary([end - start for start, end in windows], 1e3),
            "stall_ms": summary([max(s - base, 0.0) for s in stalls], 1e3),
            "serving_iteration_median_ms": base * 1e3,
        }
    except Exception as exc:  # record it and go on with the other cases
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.empty_cache()


def minute(seconds: float) -> dict[str, Any]:
    """p99 of a decoder step over `seconds` without and with the default reader running."""
    decoder = Decoder()
    live = _make_blocks(int(DEFAULT_MAX_BLOCKS * 0.95))
    blocks = _read_once().get(0, 0)
    reader = LayoutReader(
        lambda: torch._C._cuda_memorySnapshot(None),
        history_enabled=torch._C._cuda_isHistoryEnabled,
    )
    results: dict[str, Any] = {
        "blocks": blocks,
        "interval_s": reader.interval_s,
        "seconds": seconds,
    }
    warm: list[float] = []
    decoder.request(4, 64, 64, warm)
    for name in ("off", "default_reader"):
        stop = threading.Event()
        durations: list[float] = []

        def sample(stop: threading.Event = stop, durations: list[float] = durations) -> None:
            while not stop.wait(0.1):
                if reader.due():
                    read = reader.read(blocks)
                    durations.append(read.duration_s)

        thread = threading.Thread(target=sample)
        if name != "off":
            reader._next = 0.0
            thread.start()
        steps: list[float] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            decoder.request(4, 64, 64, steps)
        stop.set()
        if thread.is_alive():
            thread.join()
        results[name] = {
            "step_ms": summary(steps, 1e3),
            "readings": len(durations),
            "read_ms": summary(durations, 1e3),
        }
    del live
    results["added_p99_ms"] = (
        results["default_reader"]["step_ms"]["p99"] - results["off"]["step_ms"]["p99"]
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minute", type=float, default=0.0, help="seconds per arm of the check")
    args = parser.parse_args()
    torch.empty(1, device="cuda:0")
    result: dict[str, Any] = {
        "defaults": {"interval_s": DEFAULT_INTERVAL_S, "max_blocks": DEFAULT_MAX_BLOCKS},
        "readings": {
            f"{count // 1000}k/{history}": stall_per_reading(count, history)
            for count in BLOCK_COUNTS
            for history in ("off", "state+python", "all+python")
        },
        "machine": machine(),
    }
    if args.minute:
        result["minute"] = minute(args.minute)
    emit(result)


if __name__ == "__main__":
    main()
