"""What the exporter adds to its host: resident memory, GPU memory, CUDA contexts."""

from __future__ import annotations

import gc
import os
import time
import urllib.request

import psutil
import torch

from bench.common import MiB, emit, machine


def nvml_used_by_pid() -> dict[str, int]:
    import pynvml

    pynvml.nvmlInit()
    used = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid():
                used[pynvml.nvmlDeviceGetUUID(handle)] = int(proc.usedGpuMemory or 0)
    return used


def main() -> None:
    process = psutil.Process()
    held = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    gc.collect()
    time.sleep(1)
    before = {
        "rss": process.memory_info().rss,
        "gpu": nvml_used_by_pid(),
        "reserved": torch.cuda.memory_reserved(0),
    }

    import exporter

    handle = exporter.start(port=0, interval_s=0.1)
    # 30 s of sampling at 10 Hz with a scrape every 100 ms: steady state, not just import.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        urllib.request.urlopen(f"{handle.url}/metrics", timeout=10).read()
        time.sleep(0.1)
    gc.collect()
    after = {
        "rss": process.memory_info().rss,
        "gpu": nvml_used_by_pid(),
        "reserved": torch.cuda.memory_reserved(0),
    }
    handle.stop()
    del held
    emit(
        {
            "rss_before_bytes": before["rss"],
            "rss_after_bytes": after["rss"],
            "extra_rss_bytes": after["rss"] - before["rss"],
            "gpu_used_before": before["gpu"],
            "gpu_used_after": after["gpu"],
            "extra_gpu_bytes": sum(after["gpu"].values()) - sum(before["gpu"].values()),
            "extra_reserved_bytes": after["reserved"] - before["reserved"],
            "gpus_with_this_process": len(after["gpu"]),
            "gpus_visible": torch.cuda.device_count(),
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
