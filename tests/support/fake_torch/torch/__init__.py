"""A test double of torch for the multi-process CPU tests (tests/run/test_run.py).

It serves the allocator dict captured on an H200 (tests/data/allocator_native.json) with
allocated bytes and the retry counter moving over time (and that capture's snapshot and pinned
host memory stats as they were), and tracks which devices this process
"initialized" with set_device(), so that the real agent, aggregator and launcher can be
exercised end to end on a machine without a GPU. The real thing is tested on the GPU machine
(tests/gpu/test_gpu.py::test_run_two_ranks_on_two_gpus).
"""

import copy
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

__version__ = "0.0-fake"
_DATA = json.loads(
    (Path(__file__).resolve().parents[3] / "data" / "allocator_native.json").read_text()
)
_STATS = _DATA["memory_stats_as_nested_dict"]
_started = time.monotonic()
_initialized: set = set()
_calls: list = []
_oom_observers: list = []
# torch.cuda's lazy initialization, as torch has it: calls queued with _lazy_call run on the
# thread that initializes, after the driver is up and before is_initialized() says so.
_queued_calls: list = []
_cuda_up = False


def _lazy_init():
    global _cuda_up
    if _cuda_up or _Cuda._initializing:
        return
    _Cuda._initializing = True
    try:
        for queued in list(_queued_calls):
            queued()
    finally:
        _Cuda._initializing = False
    _cuda_up = True


def _retries_override():
    """FAKE_TORCH_RETRIES_FILE: a file holding this process's retry counter, so that tests can
    give processes on one device different retry histories."""
    path = os.environ.get("FAKE_TORCH_RETRIES_FILE")
    try:
        return int(Path(path).read_text()) if path else None
    except (OSError, ValueError):
        return None


def _fake_oom(device, alloc_size=1 << 30):
    """What the real allocator does on an OOM: call the observers, then raise. On a device not
    in use yet it is the first allocation: CUDA starts (lazily, as torch's does) first."""
    if device not in _initialized:
        _Cuda.set_device(device)
    for observer in _oom_observers:
        observer(device, alloc_size, 80 << 30, 1 << 20)
    raise _Cuda.OutOfMemoryError(f"CUDA out of memory on device {device} (fake)")


class _Cuda:
    OutOfMemoryError = MemoryError
    _initializing = False

    @staticmethod
    def is_initialized():
        return _cuda_up and bool(_initialized)

    @staticmethod
    def _lazy_init():
        _lazy_init()

    @staticmethod
    def _lazy_call(callable):
        if _Cuda.is_initialized():
            callable()
        else:
            _queued_calls.append(callable)

    @staticmethod
    def device_count():
        return 2

    @staticmethod
    def set_device(index):
        _lazy_init()
        _initialized.add(int(index))

    @staticmethod
    def current_device():
        return min(_initialized) if _initialized else 0

    @staticmethod
    def get_allocator_backend():
        return "native"

    @staticmethod
    def get_device_properties(index):
        return SimpleNamespace(uuid=f"fake-{index}")

    @staticmethod
    def memory_stats_as_nested_dict(device=None):
        _calls.append(("memory_stats", device))
        if device not in _initialized:
            return {}
        stats = copy.deepcopy(_STATS)
        grown = int((time.monotonic() - _started) * 10)
        stats["allocated_bytes"]["all"]["current"] += grown * 512 + os.getpid() % 7 * 512
        stats["num_alloc_retries"] += grown
        override = _retries_override()
        if override is not None:
            stats["num_alloc_retries"] = override
        return stats

    @staticmethod
    def empty_cache():
        _calls.append(("empty_cache",))

    @staticmethod
    def reset_peak_memory_stats(device=None):
        _calls.append(("reset_peak", device))

    class device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class memory:
        @staticmethod
        def _snapshot():
            return {
                "segments": [
                    {
                        "device": d,
                        "total_size": 2 << 20,
                        "allocated_size": 1 << 20,
                        "active_size": 1 << 20,
                        "blocks": [],
                    }
                    for d in sorted(_initialized)
                ],
                "device_traces": [[] for _ in range(2)],
            }

        @staticmethod
        def _record_memory_history(enabled="all", **kwargs):
            _calls.append(("history", enabled))


def _memory_snapshot(_pool=None):
    """The captured segments-only snapshot, once per device this process initialized."""
    segments = [
        {**segment, "device": device}
        for device in sorted(_initialized)
        for segment in _DATA["snapshot"]["segments"]
    ]
    return {"segments": segments, "allocator_settings": _DATA["snapshot"]["allocator_settings"]}


cuda = _Cuda()
sys.modules["torch.cuda"] = cuda  # type: ignore[assignment]  # as `import torch` loads it
_C = SimpleNamespace(
    _cuda_hasPrimaryContext=lambda i: i in _initialized,
    _cuda_attach_out_of_memory_observer=_oom_observers.append,
    _cuda_memorySnapshot=_memory_snapshot,
    _cuda_isHistoryEnabled=lambda: False,
    _cuda_hostMemoryStats=lambda: copy.deepcopy(_DATA["host_memory_stats"]),
    # torch.accelerator reads the same allocator (exporter.sources.accelerator_allocator).
    _accelerator_isAllocatorInitialized=lambda: bool(_initialized),
    _accelerator_getDeviceStats=_Cuda.memory_stats_as_nested_dict,
)
accelerator = SimpleNamespace(
    current_accelerator=lambda: SimpleNamespace(type="cuda"),
    device_count=_Cuda.device_count,
)
