"""A server process whose GPU memory moves, for tests/gpu/test_gpu_freshness.py.

    python tests/support/freshness_workload.py EVENTS.jsonl [PORT]

With PORT it embeds the exporter on that port (interval GPUMEM_INTERVAL_S); without, it runs
under `gpumem-exporter run`, whose agent reads it. Phases, each logged to EVENTS as a JSON
line with its wall-clock time:
1. churn: 64-512 MiB allocated and freed every 20-80 ms with the cache emptied each time, so
   that reserved and NVML's used move all the time (non-allocator bytes must not); each block
   logged when held and when given back;
2. steps: 1-4 GiB held 3 s, then freed (per-process memory must follow within 2 ticks);
3. fragmentation and OOM under a per-process memory cap: half of sixty 100 MiB blocks freed,
   a 4 GiB request that needs a retry, a 6 GiB one that runs out of memory; then held.
The non-allocator truth (NVML used minus reserved, nothing moving) is logged before and after.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

import pynvml
import torch

MiB, GiB = 1 << 20, 1 << 30


def main() -> None:
    events = open(sys.argv[1], "a")  # noqa: SIM115 - open for the whole run
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    torch.ones(1, device="cuda:0")
    torch.cuda.synchronize()
    if port:
        import exporter

        exporter.start(port=port, interval_s=float(os.environ.get("GPUMEM_INTERVAL_S", "0.5")))
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByUUID(
        "GPU-" + str(torch.cuda.get_device_properties(0).uuid).removeprefix("GPU-")
    )

    def event(kind: str, **fields: Any) -> None:
        events.write(json.dumps({"t": time.time(), "kind": kind, **fields}) + "\n")
        events.flush()

    def truth() -> int:
        torch.cuda.synchronize()
        used = [
            p.usedGpuMemory
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            if p.pid == os.getpid()
        ]
        return int(used[0]) - torch.cuda.memory_reserved(0)

    event("ready", pid=os.getpid())
    time.sleep(3.0)
    event("truth", non_allocator=truth())

    rng = random.Random(23)
    event("churn")
    end = time.time() + 20.0
    while time.time() < end:
        mib = rng.randint(64, 512)
        block = torch.empty(mib * MiB, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        event("block", mib=mib)  # held from here (a wrong value's take is found among these)
        time.sleep(rng.uniform(0.02, 0.08))
        del block
        torch.cuda.empty_cache()
        event("block", mib=-mib)  # given back to the GPU
        time.sleep(rng.uniform(0.02, 0.08))
    event("churn_end")
    time.sleep(1.5)
    event("truth", non_allocator=truth())

    for size in (1, 3, 2, 4):
        held = torch.empty(size * GiB, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        event("step", gib=size)
        time.sleep(3.0)
        del held
        torch.cuda.empty_cache()
        event("step", gib=-size)
        time.sleep(3.0)

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(8 * GiB / total, 0)
    event("fragment")
    blocks = [torch.empty(100 * MiB, dtype=torch.uint8, device="cuda:0") for _ in range(60)]
    del blocks[::2]  # 3000 MiB cached in 100 MiB holes
    big = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda:0")  # fits after a retry
    ooms = 0
    try:
        torch.empty(6 * GiB, dtype=torch.uint8, device="cuda:0")
    except torch.cuda.OutOfMemoryError:
        ooms += 1
    torch.cuda.synchronize()
    event("hold", ooms=ooms)
    time.sleep(4.0)
    del big, blocks
    torch.cuda.empty_cache()
    time.sleep(1.5)
    event("truth", non_allocator=truth())
    event("done")
    time.sleep(600)  # the test ends it


if __name__ == "__main__":
    main()
