"""What an OOM costs the OOM-ing thread with the exporter's observer armed, per form of snapshot.

PyTorch calls the observer on the thread whose allocation failed, before it raises: every
microsecond there is added to the OOM's own latency (the server's error path). For 1k and 10k
live blocks, with allocation history off and on (100k entries, Python stacks), the exporter's
own source and observer run against OOMs made on purpose under a cap, and the verdict records
the time its observer took (OomVerdict.observe_s):

- `first`: the OOM that writes a snapshot (the full `_snapshot()`, with the history trace where
  recording is on, handed to a writer thread);
- `later`: OOMs within the snapshot cooldown (the light snapshot: segments without the trace,
  skipped while history records, where the verdict falls back to the stats);
- `capture_s`: `POST /snapshot`'s capture on the serving thread, in the same state.

Run on a GPU: `python -m bench.oom_observer` (one JSON object on the last line).
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import torch

from bench.common import MiB, emit, machine, summary
from exporter.actions.local import LocalActions
from exporter.actions.oom import OomCapture
from exporter.actions.snapshots import SnapshotStore
from exporter.config import Config
from exporter.sources.non_allocator import NonAllocatorReader
from exporter.sources.torch_allocator import TorchAllocatorSource

BLOCK_COUNTS = (1_000, 10_000)
LATER_OOMS = 50


def _blocks(count: int) -> list[torch.Tensor]:
    sizes = [512, 4096, 64 * 1024, 3 * MiB]
    tensors = [
        torch.empty(sizes[i % len(sizes)], dtype=torch.uint8, device="cuda:0") for i in range(count)
    ]
    return [t for i, t in enumerate(tensors) if i % 3]


def _oom() -> None:
    try:
        torch.empty(64 << 30, dtype=torch.uint8, device="cuda:0")
    except torch.cuda.OutOfMemoryError:
        return
    raise AssertionError("no OOM")


def main() -> None:
    torch.empty(1, device="cuda:0")
    source = TorchAllocatorSource(non_allocator=NonAllocatorReader())
    config = Config(snapshot_dir=tempfile.mkdtemp(prefix="gpumem-bench-oom-"))
    actions = LocalActions(SnapshotStore.for_config(config), config=config, oom_reader=source)
    capture = OomCapture(actions, source, cooldown_s=3600.0)
    source.read()
    assert capture.attach()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((24 << 30) / total, 0)
    results: dict[str, Any] = {}
    for history in ("off", "python"):
        for count in BLOCK_COUNTS:
            if history == "python":
                torch.cuda.memory._record_memory_history(
                    max_entries=100_000, stacks="python", context="all"
                )
            live = _blocks(count)
            for _ in range(20_000 if history == "python" else 0):  # fill the history
                del live[-1]
                live.append(torch.empty(4096, dtype=torch.uint8, device="cuda:0"))
            capture._last = None  # the next OOM writes a snapshot
            _oom()
            first = source.ooms.last(0)
            later = []
            for _ in range(LATER_OOMS):
                _oom()
                last = source.ooms.last(0)
                assert last is not None
                later.append(last.observe_s)
            started = time.perf_counter()
            actions.capture()
            capture_s = time.perf_counter() - started
            assert first is not None
            results[f"{history}/{count}"] = {
                "blocks": count,
                "history": history,
                "verdict": first.verdict,
                "first_observe_ms": first.observe_s * 1000,
                "later_observe_ms": summary(later, 1000),
                "later_missing": source.ooms.last(0).missing,  # type: ignore[union-attr]
                "capture_ms": capture_s * 1000,
            }
            del live
            if history == "python":
                torch.cuda.memory._record_memory_history(enabled=None)
            torch.cuda.empty_cache()
            time.sleep(1)  # the writer threads finish
    emit({"machine": machine(), "results": results})


if __name__ == "__main__":
    main()
