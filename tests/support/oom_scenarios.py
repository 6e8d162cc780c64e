"""OOMs made on purpose on a real GPU, one cause each, for the verdict tests and the captured
fixture: `python tests/support/oom_scenarios.py NAME` prints one JSON object.

Each scenario arms the exporter's OOM observer (the allocator source and LocalActions, as an
embedded exporter does), then a second observer of its own, which PyTorch calls right after
ours at the same moment: it takes the independent readings (torch's public
`memory_stats`/`memory_snapshot`/`mem_get_info`, raw NVML) that the test compares with the
exporter's verdict. The scenarios only measure; tests/gpu/test_gpu_oom.py asserts.
`python tests/support/oom_scenarios.py capture OUT.json` runs them all and writes the
fixture the CPU tests use (tests/data/oom_verdicts.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

MiB = 1 << 20
GiB = 1 << 30


def _walk_holes(segments: list[dict[str, Any]], device: int) -> tuple[int, int]:
    """Free bytes and the largest free block of the default pool, by a plain walk."""
    free = largest = 0
    for segment in segments:
        if segment["device"] != device or tuple(segment["segment_pool_id"]) != (0, 0):
            continue
        for block in segment["blocks"]:
            if block["state"] == "inactive":
                free += block["size"]
                largest = max(largest, block["size"])
    return free, largest


def _arm() -> tuple[Any, Any]:
    """The exporter's allocator source and OOM observer, attached first; then ours."""
    import torch

    from exporter.actions.local import LocalActions
    from exporter.actions.oom import OomCapture
    from exporter.actions.snapshots import SnapshotStore
    from exporter.config import Config
    from exporter.sources.non_allocator import NonAllocatorReader
    from exporter.sources.torch_allocator import TorchAllocatorSource

    source = TorchAllocatorSource(non_allocator=NonAllocatorReader())
    folder = tempfile.mkdtemp(prefix="gpumem-oom-")
    config = Config(snapshot_dir=folder)
    actions = LocalActions(SnapshotStore.for_config(config), config=config, oom_reader=source)
    capture = OomCapture(actions, source, snapshots=True, cooldown_s=60.0)
    source.read()
    assert capture.attach(), "the OOM observer did not attach"
    truth: dict[str, Any] = {}

    def independent(device: int, size: int, limit_or_total: int, free: int) -> None:
        import pynvml

        stats = torch.cuda.memory_stats(device)
        holes, largest = _walk_holes(torch.cuda.memory_snapshot(), device)
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        others = {
            p.pid: p.usedGpuMemory
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            if p.pid != os.getpid()
        }
        segments = torch.cuda.memory_snapshot()
        pools_free = sum(
            seg["total_size"] - seg["allocated_size"]
            for seg in segments
            if seg["device"] == device and tuple(seg["segment_pool_id"]) != (0, 0)
        )
        truth.update(
            pools_free=pools_free,
            device=device,
            requested=size,
            limit_or_total=limit_or_total,
            device_free=free,
            mem_get_info_free=torch.cuda.mem_get_info(device)[0],
            total=torch.cuda.get_device_properties(device).total_memory,
            fraction=torch.cuda.get_per_process_memory_fraction(device),
            reserved=stats["reserved_bytes.all.current"],
            allocated=stats["allocated_bytes.all.current"],
            holes=holes,
            largest=largest,
            others=others,
        )

    torch._C._cuda_attach_out_of_memory_observer(independent)  # type: ignore[attr-defined]
    return source, (actions, truth, folder)


def _oom(size: int) -> bool:
    import torch

    try:
        torch.empty(size, dtype=torch.uint8, device="cuda:0")
    except torch.cuda.OutOfMemoryError:
        return True
    return False


def _result(source: Any, armed: Any, raised: bool) -> dict[str, Any]:
    actions, truth, folder = armed
    deadline = time.monotonic() + 30
    reading = source.read().allocators[0]
    while reading.last_oom is not None and not reading.last_oom.snapshot:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)  # the writer thread links the snapshot once written
        reading = source.read().allocators[0]
    listed = [info.public() for info in actions.store.list()]
    return {
        "raised": raised,
        "reading": asdict(reading),
        "truth": truth,
        "snapshots": listed,
        "folder": folder,
    }


def _cap(torch: Any, cap_bytes: int) -> None:
    torch.cuda.set_per_process_memory_fraction(
        cap_bytes / torch.cuda.get_device_properties(0).total_memory, 0
    )


def _shatter(torch: Any) -> list[Any]:
    """Six cached 1 GiB segments carved into 96 MiB tensors, every other one freed: 3 GiB
    free in holes, no free block over 96 MiB (and a 64 MiB tail per segment)."""
    big = [torch.empty(GiB, dtype=torch.uint8, device="cuda:0") for _ in range(6)]
    del big
    pieces = [torch.empty(96 * MiB, dtype=torch.uint8, device="cuda:0") for _ in range(60)]
    return pieces[::2]


def fragmentation() -> dict[str, Any]:
    """A shattered cache under a cap: a 512 MiB request fits no hole and no new segment."""
    import torch

    torch.empty(1, device="cuda:0")
    source, armed = _arm()
    _cap(torch, 6 * GiB + 256 * MiB)
    kept = _shatter(torch)
    raised = _oom(512 * MiB)
    result = _result(source, armed, raised)
    del kept
    return result


def cap() -> dict[str, Any]:
    """A 2 GiB cap, 1.5 GiB live, 1 GiB asked: the GPU has room, the cap does not."""
    import torch

    torch.empty(1, device="cuda:0")
    source, armed = _arm()
    _cap(torch, 2 * GiB)
    live = torch.empty(1536 * MiB, dtype=torch.uint8, device="cuda:0")
    raised = _oom(GiB)
    result = _result(source, armed, raised)
    del live
    return result


_HOLDER = """
import sys, torch
held = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print("held", flush=True)
sys.stdin.read()
"""


def other_processes() -> dict[str, Any]:
    """Another process fills the GPU but 6 GiB; this one holds 2 GiB and asks 8 GiB."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    free_now = torch.cuda.mem_get_info(0)[0]  # before our context: what the holder may take
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(free_now - 6 * GiB - 600 * MiB)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        torch.empty(1, device="cuda:0")
        source, armed = _arm()
        live = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda:0")
        raised = _oom(8 * GiB)
        result = _result(source, armed, raised)
        result["holder_pid"] = holder.pid
        result["total"] = total
        del live
        return result
    finally:
        holder.kill()
        holder.wait()


def exhaustion() -> dict[str, Any]:
    """Live tensors fill the GPU but ~2 GiB; 4 GiB asked."""
    import torch

    torch.empty(1, device="cuda:0")
    source, armed = _arm()
    free = torch.cuda.mem_get_info(0)[0]
    live = [torch.empty(GiB, dtype=torch.uint8, device="cuda:0") for _ in range(free // GiB - 2)]
    raised = _oom(4 * GiB)
    result = _result(source, armed, raised)
    del live
    return result


def pools() -> dict[str, Any]:
    """A live MemPool holds 4 GiB it no longer uses (its tensors freed, its segments cached
    for it: PyTorch's flush at an OOM keeps a live pool's), and the default pool, under a
    6 GiB cap with 1 GiB live, asks 2 GiB: 1 GiB of room, 4 GiB stranded."""
    import torch

    import exporter

    torch.empty(1, device="cuda:0")
    source, armed = _arm()
    pool = torch.cuda.MemPool()
    exporter.name_pool(pool, "kv_cache")  # named as a server names it: the verdict says it
    with torch.cuda.use_mem_pool(pool):
        held = [torch.empty(GiB, dtype=torch.uint8, device="cuda:0") for _ in range(4)]
    del held
    _cap(torch, 6 * GiB)
    live = torch.empty(GiB, dtype=torch.uint8, device="cuda:0")
    raised = _oom(2 * GiB)
    result = _result(source, armed, raised)
    result["pool_id"] = "_".join(str(part) for part in pool.id)
    del live
    return result


def outside_allocator() -> dict[str, Any]:
    """CuPy's memory pool in this same process holds the GPU but ~6 GiB; torch holds 1 GiB
    live and asks 8 GiB."""
    import torch

    try:
        import cupy
    except ImportError:
        return {"skipped": "CuPy is not installed"}
    torch.empty(1, device="cuda:0")
    source, armed = _arm()
    free = torch.cuda.mem_get_info(0)[0]
    held = cupy.empty(free - 7 * GiB, dtype=cupy.uint8)
    cupy.cuda.Device(0).synchronize()
    live = torch.empty(GiB, dtype=torch.uint8, device="cuda:0")
    raised = _oom(8 * GiB)
    result = _result(source, armed, raised)
    result["cupy_bytes"] = cupy.get_default_memory_pool().total_bytes()
    del held, live
    return result


SCENARIOS = {
    "fragmentation": fragmentation,
    "cap": cap,
    "other_processes": other_processes,
    "exhaustion": exhaustion,
    "pools": pools,
    "outside_allocator": outside_allocator,
}


def capture(out: str) -> None:
    """Every scenario in a fresh process, and with expandable segments the cap and the
    fragmentation recipe (which no longer runs out of memory: PyTorch's flush unmaps the
    holes), written as the CPU tests' fixture."""
    expandable = "expandable_segments:True"
    runs = [(name, "") for name in SCENARIOS] + [("cap", expandable), ("fragmentation", expandable)]
    captured = []
    for name, conf in runs:
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
        proc = subprocess.run(
            [sys.executable, __file__, name], env=env, capture_output=True, text=True, check=True
        )
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        captured.append({"scenario": name, "alloc_conf": conf, **result})
    import torch

    data = {
        "captured_with": f"python tests/support/oom_scenarios.py capture {out}",
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "runs": captured,
    }
    with open(out, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    if sys.argv[1] == "capture":
        capture(sys.argv[2])
    else:
        print(json.dumps(SCENARIOS[sys.argv[1]](), default=str))
