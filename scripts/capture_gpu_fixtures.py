"""Capture real allocator and NVML readings on a GPU machine for the CPU tests.

Run on a machine with a CUDA GPU, from the repository root:

    python3 scripts/capture_gpu_fixtures.py --out tests/data

For each allocator configuration (native, expandable_segments, cudaMallocAsync, and native
with a model's weights and KV cache named by exporter.component()) a fresh
process allocates a fixed pattern (varied sizes, alternating frees, so inactive_split is not
zero where it is tracked), then writes:
- the raw `torch.cuda.memory_stats_as_nested_dict(0)` and the flat `memory_stats(0)`;
- the reading the exporter's own sources produce (TorchAllocatorSource, NvmlSource);
- the raw NVML values (v1 and v2 memory info, per-process list) and this process's PID;
- independent truth: torch.cuda.memory_allocated/reserved and the tensor bytes held live;
- a captured CUDA graph and a MemPool (private pools), a 1 GiB pinned host tensor, the raw
  `_cuda_hostMemoryStats()`, a segments-only snapshot and a plain walk of its blocks
  (largest free block, free bytes in used segments, bytes per private pool).
The CPU tests check the exporter's mapping against these files; nothing in them is typed by
hand.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

CONFIGS = {
    "native": "",
    "expandable": "expandable_segments:True",
    "async": "backend:cudaMallocAsync",
    # native, with a model's weights and a KV cache named (exporter.component): the ledger
    "components": "",
}


def _nvml_raw() -> dict:
    import pynvml

    pynvml.nvmlInit()
    devices = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
        v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        devices.append(
            {
                "index": i,
                "uuid": pynvml.nvmlDeviceGetUUID(h),
                "name": pynvml.nvmlDeviceGetName(h),
                "pci_bus_id": pynvml.nvmlDeviceGetPciInfo(h).busId,
                "memory_v1": {"total": v1.total, "free": v1.free, "used": v1.used},
                "memory_v2": {
                    "total": v2.total,
                    "free": v2.free,
                    "used": v2.used,
                    "reserved": v2.reserved,
                },
                "processes": [{"pid": p.pid, "usedGpuMemory": p.usedGpuMemory} for p in procs],
            }
        )
    return {
        "driver_version": pynvml.nvmlSystemGetDriverVersion(),
        "nvml_version": pynvml.nvmlSystemGetNVMLVersion(),
        "devices": devices,
    }


PINNED_BYTES = 1 << 30


def _private_pools(torch: Any, device: Any) -> dict[str, Any]:
    """A captured CUDA graph (its private pool) and a MemPool holding a tensor, where the
    backend supports them; their ids and the bytes allocated inside."""
    result: dict[str, Any] = {}
    static = torch.randn(1024, 1024, device=device)
    try:
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            static @ static  # warm-up outside the capture, as CUDA graphs require
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = static @ static
            scratch = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        _KEEP.extend([graph, static, out, scratch])
        result["graph"] = {"pool_id": list(graph.pool()), "tensor_bytes": (4 << 20) + (64 << 20)}
    except Exception as exc:  # record what the backend said
        result["graph"] = {"error": repr(exc)}
    try:
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool, device=device):
            tensor = torch.empty(32 << 20, dtype=torch.uint8, device=device)
        _KEEP.extend([pool, tensor])
        result["mempool"] = {"pool_id": list(pool.id), "tensor_bytes": 32 << 20}
    except Exception as exc:
        result["mempool"] = {"error": repr(exc)}
    return result


_KEEP: list[Any] = []


def _segments_snapshot(torch: Any) -> dict[str, Any] | None:
    try:
        snapshot = torch._C._cuda_memorySnapshot(None)
    except RuntimeError:  # cudaMallocAsync has none
        return None
    return {"segments": snapshot["segments"], "allocator_settings": snapshot["allocator_settings"]}


def _independent_walk(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The layout numbers by a plain walk over every block (not the exporter's code)."""
    largest = default_free = in_used = 0
    pools: dict[str, list[int]] = {}
    for segment in snapshot["segments"]:
        blocks = segment["blocks"]
        free = [b["size"] for b in blocks if b["state"] == "inactive"]
        used = [b["size"] for b in blocks if b["state"] != "inactive"]
        pool = "_".join(map(str, segment["segment_pool_id"]))
        if pool == "0_0":
            default_free += sum(free)
            largest = max([largest, *free])
        else:
            sums = pools.setdefault(pool, [0, 0])
            sums[0] += segment["total_size"]
            sums[1] += sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        if used:
            in_used += sum(free)
    return {
        "largest_free_block_bytes": largest,
        "default_pool_free_bytes": default_free,
        "free_in_used_segments_bytes": in_used,
        "private_pools": {
            p: {"reserved_bytes": r, "allocated_bytes": a} for p, (r, a) in pools.items()
        },
    }


def _named_components(torch: Any, device: Any, keep: list[Any]) -> dict[str, int]:
    """A model's weights and its KV cache, each in exporter.component(); what each added to
    torch.cuda.memory_allocated, read around the block (the truth the ledger is held to)."""
    import exporter

    truth = {}
    for name, shape in (("weights", (8, 4096, 4096)), ("kv_cache", (2, 16, 1024, 8, 128))):
        before = torch.cuda.memory_allocated(device)
        with exporter.component(name):
            keep.append(torch.empty(shape, dtype=torch.bfloat16, device=device))
        truth[name] = torch.cuda.memory_allocated(device) - before
    return truth


def child(config_name: str, out: Path) -> None:
    import torch

    from exporter.sources.nvml import NvmlSource
    from exporter.sources.torch_allocator import TorchAllocatorSource

    before_init = {
        "is_initialized": torch.cuda.is_initialized(),
        "memory_stats_as_nested_dict_0": torch.cuda.memory_stats_as_nested_dict(0),
    }
    device = torch.device("cuda:0")
    keep = []
    # Varied sizes in both pools; free every other one so split blocks go inactive.
    sizes = [512, 4096, 300_000, 1_500_000, 3_000_000, 7_000_000, 9_000_000, 50_000_000]
    allocs = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes * 4]
    for i, tensor in enumerate(allocs):
        if i % 2 == 0:
            keep.append(tensor)
    del allocs, tensor
    torch.cuda.synchronize()
    named = _named_components(torch, device, keep) if config_name == "components" else {}
    live_bytes = sum(t.numel() * t.element_size() for t in keep)
    private = _private_pools(torch, device)
    pinned = torch.empty(PINNED_BYTES, dtype=torch.uint8, pin_memory=True)
    keep.append(pinned)
    torch.cuda.synchronize()

    stats = torch.cuda.memory_stats_as_nested_dict(0)
    flat = torch.cuda.memory_stats(0)
    source_reading = TorchAllocatorSource().read()
    snapshot = _segments_snapshot(torch)
    nvml_reading = NvmlSource().read()
    settings = None
    if hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        try:
            settings = str(torch._C._accelerator_getAllocatorSettings())
        except Exception as exc:  # record what it did, whatever it was
            settings = f"error: {exc!r}"
    result = {
        "config": config_name,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "device_name": torch.cuda.get_device_name(0),
        "device_uuid": str(torch.cuda.get_device_properties(0).uuid),
        "allocator_backend": torch.cuda.get_allocator_backend(),
        "allocator_settings": settings,
        "pid": os.getpid(),
        "before_init": before_init,
        "truth": {
            "memory_allocated": torch.cuda.memory_allocated(0),
            "memory_reserved": torch.cuda.memory_reserved(0),
            "live_tensor_bytes": live_bytes,
            "pinned_tensor_bytes": PINNED_BYTES,
            "private_pools": private,
            "snapshot_walk": None if snapshot is None else _independent_walk(snapshot),
            "components": named,  # each component's allocated growth, read by torch itself
        },
        # Segments-only snapshot (history off, so no frames), taken right after the source
        # read: the layout the CPU tests recompute. None where the backend has no snapshot.
        "snapshot": snapshot,
        "host_memory_stats": torch._C._cuda_hostMemoryStats(),
        "exporter_pinned_host": [asdict(p) for p in source_reading.pinned_host],
        "memory_stats_as_nested_dict": stats,
        "memory_stats": flat,
        "exporter_allocators": [asdict(a) for a in source_reading.allocators],
        "exporter_gpus": [asdict(g) for g in nvml_reading.gpus],
        "exporter_processes": [asdict(p) for p in nvml_reading.processes],
        "nvml_raw": _nvml_raw(),
    }
    path = out / f"allocator_{config_name}.json"
    path.write_text(json.dumps(result, indent=1, sort_keys=True, default=str) + "\n")
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/data"))
    parser.add_argument("--child", choices=sorted(CONFIGS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args.child, args.out)
        # Skip interpreter teardown: on cudaMallocAsync, freeing the captured graph's tensors
        # at exit aborts the process (torch 2.11: "uncaptured free of a captured allocation",
        # then invalid argument), after the file was written.
        sys.stdout.flush()
        os._exit(0)
    for name, conf in CONFIGS.items():
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
        subprocess.run(
            [sys.executable, __file__, "--child", name, "--out", str(args.out)], env=env, check=True
        )


if __name__ == "__main__":
    main()
