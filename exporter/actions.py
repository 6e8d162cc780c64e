"""Actions on the allocator: empty_cache and snapshots, guarded, measured and counted.

Guards come from shared/FACTS.md: act only on devices this process already initialized, call
empty_cache under `torch.cuda.device(i)` (from a new thread the current device is 0, and an
empty_cache there would create a context on GPU 0), and never snapshot on cudaMallocAsync,
where `_snapshot` raises. empty_cache waits for queued GPU work and holds each device's
allocator mutex meanwhile, so it blocks the server's allocations for as long as that takes:
callers run it off the serving path and rate-limit it.
"""

from __future__ import annotations

import gzip
import logging
import os
import pickle
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("exporter.actions")


class ActionUnavailable(RuntimeError):
    """The action cannot run here (no torch, CUDA not initialized, unsupported backend)."""


@dataclass(frozen=True)
class EmptyCacheResult:
    devices: list[int]
    reserved_before_bytes: dict[int, int]
    reserved_after_bytes: dict[int, int]
    duration_s: float

    @property
    def released_bytes(self) -> int:
        return sum(
            max(self.reserved_before_bytes[d] - self.reserved_after_bytes[d], 0)
            for d in self.devices
        )


def _torch() -> Any:
    torch = sys.modules.get("torch")  # never import torch for an action: see sources
    if torch is None or not torch.cuda.is_initialized():
        raise ActionUnavailable("CUDA is not initialized in this process")
    return torch


def initialized_devices(torch: Any) -> list[int]:
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is None:
        return [torch.cuda.current_device()]
    return [i for i in range(torch.cuda.device_count()) if has_context(i)]


def _reserved(torch: Any, device: int) -> int:
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    return int(stats.get("reserved_bytes", {}).get("all", {}).get("current", 0))


class Actions:
    """The allocator actions of this process, with their counters for /metrics."""

    def __init__(self, snapshot_dir: str | os.PathLike[str] | None = None) -> None:
        self.snapshot_dir = Path(snapshot_dir or tempfile.gettempdir()) / "gpumem-snapshots"
        self._lock = threading.Lock()
        self.snapshots: Counter[str] = Counter()  # trigger -> count
        self.empty_cache_calls: Counter[str] = Counter()
        self.released_bytes_total = 0

    def empty_cache(self, trigger: str = "api") -> EmptyCacheResult:
        torch = _torch()
        devices = initialized_devices(torch)
        if not devices:
            raise ActionUnavailable("no CUDA device is initialized in this process")
        before = {d: _reserved(torch, d) for d in devices}
        started = time.perf_counter()
        # One call frees cached blocks on every device; the device guard only keeps it from
        # creating a context on GPU 0 when this thread's current device is 0.
        with torch.cuda.device(devices[0]):
            torch.cuda.empty_cache()
        duration = time.perf_counter() - started
        result = EmptyCacheResult(
            devices, before, {d: _reserved(torch, d) for d in devices}, duration
        )
        with self._lock:
            self.empty_cache_calls[trigger] += 1
            self.released_bytes_total += result.released_bytes
        log.info(
            "empty_cache (%s) released %d bytes in %.3f s", trigger, result.released_bytes, duration
        )
        return result

    def snapshot(self, trigger: str = "api") -> Path:
        """Write `torch.cuda.memory._snapshot()` gzip-pickled, atomically; return its path."""
        torch = _torch()
        if torch.cuda.get_allocator_backend() != "native":
            raise ActionUnavailable(
                "allocator snapshots need the native backend "
                f"(this process uses {torch.cuda.get_allocator_backend()})"
            )
        snapshot = torch.cuda.memory._snapshot()
        path = self._write(snapshot, trigger)
        with self._lock:
            self.snapshots[trigger] += 1
        log.info("allocator snapshot (%s) written to %s", trigger, path)
        return path

    def _write(self, snapshot: Any, trigger: str) -> Path:
        self.snapshot_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        rank = os.environ.get("RANK", "")
        name = (
            f"{socket.gethostname()}_pid{os.getpid()}{f'_rank{rank}' if rank else ''}"
            f"_{stamp}_{trigger}_{time.time_ns() % 1_000_000:06d}.pickle.gz"
        )
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=".partial", dir=self.snapshot_dir)
        try:
            with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb") as f:
                pickle.dump(snapshot, f, protocol=pickle.HIGHEST_PROTOCOL)
            path = self.snapshot_dir / name
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path
