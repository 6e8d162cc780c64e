"""How long the serving thread stalls while an action runs in another thread.

The serving thread allocates a 1 MiB tensor and queues a small kernel in a loop (no sync), so
it is stopped by what actions really take from it: the GIL (snapshots build Python objects
for every block and frame) and the allocator mutex (empty_cache holds it while it waits for
queued GPU work). Stall = longest serving iteration during the action.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import MiB, emit, machine, summary

HISTORY_MODES: dict[str, dict[str, Any] | None] = {
    "off": None,
    "state+python": {"enabled": "state", "context": "state", "stacks": "python"},
    "all+python": {"enabled": "all", "context": "all", "stacks": "python"},
    "all+cpp": {"enabled": "all", "context": "all", "stacks": "all"},
}


class ServingLoop:
    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []  # (start, duration)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            x = torch.empty(MiB // 4, dtype=torch.float32, device="cuda:0")
            x.fill_(1.0)
            del x
            self.times.append((t0, time.perf_counter() - t0))

    def __enter__(self) -> ServingLoop:
        self._thread.start()
        time.sleep(0.3)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.3)
        self._stop.set()
        self._thread.join()
        torch.cuda.synchronize()


def during(action: Callable[[], object]) -> dict[str, float]:
    with ServingLoop() as loop:
        start = time.perf_counter()
        action()
        end = time.perf_counter()
    inside = [d for t, d in loop.times if start - 0.001 <= t <= end]
    outside = [d for t, d in loop.times if t < start - 0.001]
    return {
        "action_s": end - start,
        "stall_ms": max(inside, default=0.0) * 1e3,
        "serving_iterations_during": len(inside),
        "baseline_p99_ms": summary(outside, 1e3).get("p99", 0.0),
    }


def snapshot_stalls(blocks: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, mode in HISTORY_MODES.items():
        try:
            if mode is not None:
                torch.cuda.memory._record_memory_history(max_entries=100_000, **mode)
            live = [torch.empty(512, dtype=torch.uint8, device="cuda:0") for _ in range(blocks)]
            torch.cuda.synchronize()
            results[name] = during(torch.cuda.memory._snapshot)
            del live
        except Exception as exc:  # record it and go on with the other modes
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
            torch.cuda.empty_cache()
    return results


def alloc_free_cost() -> dict[str, Any]:
    """Cost of one alloc+free pair with each history mode (what recording costs a server)."""
    results = {}
    for name, mode in HISTORY_MODES.items():
        if mode is not None:
            torch.cuda.memory._record_memory_history(max_entries=100_000, **mode)
        for _ in range(2000):
            del_me = torch.empty(4096, device="cuda:0")
            del del_me
        t0 = time.perf_counter()
        for _ in range(20000):
            x = torch.empty(4096, device="cuda:0")
            del x
        results[name] = {"pair_us": (time.perf_counter() - t0) / 20000 * 1e6}
        torch.cuda.memory._record_memory_history(enabled=None)
    return results


def empty_cache_stalls() -> dict[str, Any]:
    results = {}
    spare = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
    del spare  # a cached segment that empty_cache can release
    torch.cuda.synchronize()
    results["idle"] = during(torch.cuda.empty_cache)
    a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
    # Calibrate ~2 s of queued work, then queue it and empty_cache while it runs.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 20
    spare = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
    del spare

    def queued() -> None:
        for _ in range(int(2.0 / per)):
            a @ a
        torch.cuda.empty_cache()

    results["with_2s_queued"] = during(queued)
    results["queued_work_s"] = int(2.0 / per) * per
    return results


def main() -> None:
    torch.empty(1, device="cuda:0")
    emit(
        {
            "snapshot_10k_blocks": snapshot_stalls(10_000),
            "snapshot_50k_blocks": snapshot_stalls(50_000),
            "alloc_free_pair": alloc_free_cost(),
            "empty_cache": empty_cache_stalls(),
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
