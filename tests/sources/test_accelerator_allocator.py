"""The torch.accelerator allocator source (exporter/sources/accelerator_allocator.py) against
the readings captured on an H200, beside today's torch.cuda source on the same allocator: the
same numbers, the same context rules. tests/gpu/test_gpu_sources.py checks it on a GPU."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import pytest

from exporter.sample import SourceReading
from exporter.sources.accelerator_allocator import PARTS, AcceleratorAllocatorSource
from exporter.sources.torch_allocator import TorchAllocatorSource
from tests.conftest import DATA_DIR
from tests.helpers import FakeCuda, fake_torch


def core(readings) -> list[dict]:
    return [{k: asdict(r)[k] for k in PARTS} for r in readings]


@pytest.mark.parametrize("name", ["native", "expandable", "async"])
def test_it_reads_what_the_cuda_source_reads(name):
    data = json.loads((DATA_DIR / f"allocator_{name}.json").read_text())
    cuda = FakeCuda(data["memory_stats_as_nested_dict"], initialized=True, contexts={0, 1})
    cuda.get_allocator_backend = lambda: data["allocator_backend"]  # type: ignore[method-assign]
    torch = fake_torch(cuda)
    env = {"PYTORCH_CUDA_ALLOC_CONF": data["alloc_conf"]}
    accelerator = AcceleratorAllocatorSource(torch, env).read().allocators
    assert len(accelerator) == 2 and accelerator[0].gauges["allocated_bytes"] > 0
    cuda_readings = TorchAllocatorSource(torch, env, layout_interval_s=0).read().allocators
    assert core(accelerator) == core(cuda_readings)


def test_it_never_touches_a_device_this_process_did_not_initialize():
    cuda = FakeCuda({"reserved_bytes": {"all": {"peak": 1}}}, initialized=True, contexts={1})
    source = AcceleratorAllocatorSource(fake_torch(cuda), {})
    assert [r.device for r in source.read().allocators] == [1]
    assert {device for _, device in cuda.calls} == {1}
    assert source.uuids_in_use == frozenset({"GPU-0000-1"})


def test_without_a_context_check_only_devices_that_ever_reserved_memory_count():
    """A device type with no has-primary-context call: a device whose allocator never
    reserved anything is one this process never used."""
    stats = {"reserved_bytes": {"all": {"current": 0, "peak": 0}}}
    cuda = FakeCuda(stats, initialized=True, contexts=set())
    assert (
        AcceleratorAllocatorSource(fake_torch(cuda, with_context_api=False), {}).read().allocators
        == []
    )


def test_nothing_is_read_before_the_allocator_exists_or_without_torch(monkeypatch):
    cuda = FakeCuda({}, initialized=False, contexts={0})
    assert AcceleratorAllocatorSource(fake_torch(cuda), {}).read().allocators == []
    assert cuda.calls == []
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert AcceleratorAllocatorSource(None, {}).read() == SourceReading()


def test_a_torch_without_accelerator_memory_stats_is_a_stated_absence():
    cuda = FakeCuda({}, initialized=True, contexts={0})
    reading = AcceleratorAllocatorSource(fake_torch(cuda, accelerator=False), {}).read()
    assert reading.allocators == [] and "no torch.accelerator memory stats" in reading.unavailable
