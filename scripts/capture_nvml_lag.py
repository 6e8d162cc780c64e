"""How long NVML's per-process used memory takes to show a cudaMalloc or a cudaFree of the
caching allocator, on a real GPU: the question behind the outside-allocator bytes' agreement
rule (exporter/sources/non_allocator.py), which trusts a process list read while the
allocator's state stands still.

    PYTHONPATH=. python scripts/capture_nvml_lag.py --trials 40 > lag.json

Each trial allocates 64-512 MiB with the cache empty (one cudaMalloc), then reads NVML's list
in a loop until this process's used minus reserved is back at its value before (within
2 MiB); then frees it with empty_cache (one cudaFree) and does the same. One JSON object:
per kind, the lag in ms and how many list reads saw the old number.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import pynvml
import torch

from bench.common import summary
from exporter.sources.own_process_reads import OwnProcessReads

MiB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--timeout-s", type=float, default=2.0)
    args = parser.parse_args()
    torch.ones(1, device="cuda:0")
    torch.cuda.synchronize()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    reads = OwnProcessReads(pynvml)
    pid = os.getpid()

    def outside() -> int:
        used = reads.used_by(handle, pid)
        assert used is not None, "NVML does not list this process"
        return used - torch.cuda.memory_reserved(0)

    time.sleep(0.5)
    base = outside()
    rng = random.Random(23)
    lags: dict[str, list[float]] = {"malloc": [], "free": []}
    stale_reads: dict[str, list[int]] = {"malloc": [], "free": []}
    worst_off: dict[str, int] = {"malloc": 0, "free": 0}
    for _ in range(args.trials):
        for kind in ("malloc", "free"):
            if kind == "malloc":
                block = torch.empty(rng.randint(64, 512) * MiB, dtype=torch.uint8, device="cuda:0")
            else:
                del block
                torch.cuda.empty_cache()
            started, stale = time.perf_counter(), 0
            while True:
                off = outside() - base
                if abs(off) <= 2 * MiB:
                    break
                stale += 1
                worst_off[kind] = max(worst_off[kind], abs(off))
                if time.perf_counter() - started > args.timeout_s:
                    break
            lags[kind].append((time.perf_counter() - started) * 1000)
            stale_reads[kind].append(stale)
        time.sleep(rng.uniform(0.02, 0.08))
    print(
        json.dumps(
            {
                "machine": torch.cuda.get_device_name(0),
                "driver": pynvml.nvmlSystemGetDriverVersion(),
                "torch": torch.__version__,
                "base_outside_MiB": base / MiB,
                "lag_ms": {k: summary(v) for k, v in lags.items()},
                "trials_with_stale_reads": {
                    k: sum(1 for s in v if s) for k, v in stale_reads.items()
                },
                "stale_reads_max": {k: max(v) for k, v in stale_reads.items()},
                "worst_off_MiB": {k: v / MiB for k, v in worst_off.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
