"""Named components (exporter.components) and the ledger they join (exporter.ledger): a
component is the allocator's growth inside its block, nested ones are not counted twice, the
bad uses of the issue are a clear error or a visible count, never a wrong sum. Allocated bytes
come from a stand-in the test moves as an allocator would (the real allocator: the GPU test
tests/gpu/test_gpu.py::test_components_and_the_ledger_on_a_real_allocator)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from exporter.components import MAX_COMPONENTS, OVERFLOW, ComponentError, Components
from exporter.ledger import ledger
from exporter.sample import AllocatorReading

GiB = 1 << 30


class Allocator:
    """Allocated bytes by device, as `torch.cuda.memory_allocated` would give them."""

    def __init__(self) -> None:
        self.allocated = {0: 1 * GiB}

    def __call__(self) -> dict[int, int]:
        return dict(self.allocated)

    def alloc(self, nbytes: int, device: int = 0) -> None:
        self.allocated[device] = self.allocated.get(device, 0) + nbytes


def test_a_component_is_the_growth_inside_its_block_per_device():
    gpu = Allocator()
    components = Components(gpu)
    with components.measure("weights"):
        gpu.alloc(3 * GiB)
        gpu.alloc(2 * GiB, device=1)  # a device first used inside the block
    assert components.on_device(0) == {"weights": 3 * GiB}
    assert components.on_device(1) == {"weights": 2 * GiB}
    with components.measure("weights"):  # entered again later: it grows
        gpu.alloc(1 * GiB)
    assert components.on_device(0) == {"weights": 4 * GiB}


def test_as_a_decorator_each_call_is_a_block():
    gpu = Allocator()
    components = Components(gpu)

    @components.measure("kv_cache")
    def allocate_kv() -> None:
        gpu.alloc(GiB)

    allocate_kv()
    allocate_kv()
    assert components.on_device(0) == {"kv_cache": 2 * GiB}


def test_a_nested_component_is_taken_out_of_the_outer_one():
    gpu = Allocator()
    components = Components(gpu)
    with components.measure("model"):
        gpu.alloc(1 * GiB)
        with components.measure("embeddings"):
            gpu.alloc(2 * GiB)
        gpu.alloc(1 * GiB)
    assert components.on_device(0) == {"model": 2 * GiB, "embeddings": 2 * GiB}


def test_frees_that_outweigh_the_block_are_no_growth_and_counted():
    gpu = Allocator()
    components = Components(gpu)
    with components.measure("scratch"):
        gpu.alloc(-GiB // 2)
    assert components.on_device(0) == {}
    assert components.problems() == {"negative_growth": 1}


def test_a_component_entered_while_open_is_not_measured_twice_and_counted():
    gpu = Allocator()
    components = Components(gpu)
    started, release = threading.Event(), threading.Event()

    def loader() -> None:
        with components.measure("weights"):
            started.set()
            release.wait(5)

    other = threading.Thread(target=loader)
    other.start()
    started.wait(5)
    assert components.problems() == {"open": 1}  # a block entered and not left: visible
    with components.measure("weights"):  # the same name, while the other thread holds it
        gpu.alloc(GiB)
    release.set()
    other.join(5)
    assert components.problems() == {"reentered": 1}
    assert components.on_device(0) == {"weights": GiB}  # the open block saw it, once


def test_names_past_the_bound_go_to_other_named_and_are_counted():
    gpu = Allocator()
    components = Components(gpu)
    for i in range(1000):
        components.set(f"request-{i}", 1024)
    held = components.on_device(0)
    assert len(held) == MAX_COMPONENTS + 1
    assert held[OVERFLOW] == 1024  # set() of an overflowed name replaces: the last one
    assert components.problems() == {"overflowed": 1000 - MAX_COMPONENTS}
    components.release("request-0")
    assert "request-0" not in components.on_device(0)


@pytest.mark.parametrize(
    "name", ["", "x" * 65, "other_live", "cached_free", "outside_allocator", "a\nb", 7]
)
def test_a_name_the_ledger_cannot_take_is_a_clear_error(name):
    components = Components(Allocator())
    with pytest.raises(ComponentError):
        components.measure(name)
    with pytest.raises(ComponentError):
        components.set(name, 1)


@pytest.mark.parametrize("nbytes, device", [(-1, 0), (1.5, 0), (True, 0), (1, -1)])
def test_a_size_or_device_the_ledger_cannot_take_is_a_clear_error(nbytes, device):
    with pytest.raises(ComponentError):
        Components(Allocator()).set("kv_cache", nbytes, device)


def test_releasing_what_was_never_named_is_a_clear_error():
    with pytest.raises(ComponentError, match="no component"):
        Components(Allocator()).release("weights")


def reading(**fields: object) -> AllocatorReading:
    base = {"gauges": {"allocated_bytes": 10 * GiB, "reserved_bytes": 12 * GiB}}
    return AllocatorReading(0, "GPU-x", "native", False, **{**base, **fields})  # type: ignore[arg-type]


def test_the_ledger_sums_to_reserved_plus_outside_whatever_was_named():
    cases: list[dict[str, Any]] = [
        {},
        {"components": {"weights": 6 * GiB, "kv_cache": 3 * GiB}},
        {"components": {"weights": 6 * GiB, "kv_cache": 9 * GiB}},  # names more than allocated
        {"private_pools": {"1_0": {"reserved_bytes": 2 * GiB, "allocated_bytes": GiB}}},
    ]
    for fields in cases:
        parts = dict(ledger(reading(non_allocator_bytes=GiB // 2, **fields)))
        assert sum(parts.values()) == 12 * GiB + GiB // 2, fields
        assert all(value >= 0 for value in parts.values()), parts
        assert parts["cached_free"] == 2 * GiB and parts["outside_allocator"] == GiB // 2


def test_components_are_cut_to_what_is_still_allocated_in_the_order_named():
    parts = ledger(reading(components={"weights": 6 * GiB, "kv_cache": 9 * GiB}))
    assert parts[:4] == [
        ("weights", 6 * GiB),
        ("kv_cache", 4 * GiB),
        ("private_pools", 0),
        ("other_live", 0),
    ]
    assert [name for name, _ in parts] == [
        "weights",
        "kv_cache",
        "private_pools",
        "other_live",
        "cached_free",
    ]  # no value outside the allocator: absent, not 0


def test_an_unmodified_server_gets_pools_other_live_cached_and_outside():
    pools = {"1_0": {"reserved_bytes": 2 * GiB, "allocated_bytes": GiB}}
    parts = dict(ledger(reading(private_pools=pools, non_allocator_bytes=GiB)))
    assert parts == {
        "private_pools": GiB,
        "other_live": 9 * GiB,
        "cached_free": 2 * GiB,
        "outside_allocator": GiB,
    }


def test_the_components_captured_on_a_gpu_are_the_growth_torch_read_and_the_ledger_sums():
    """tests/data/allocator_components.json (scripts/capture_gpu_fixtures.py on an H200): the
    exporter's reading names each component with what torch.cuda.memory_allocated grew by,
    and its ledger sums to NVML's per-process used of the same moment."""
    import json

    from tests.conftest import DATA_DIR
    from tests.helpers import captured_sample

    data = json.loads((DATA_DIR / "allocator_components.json").read_text())
    sample = captured_sample("components")
    (reading,) = sample.allocators
    assert reading.components == data["truth"]["components"]
    assert set(reading.components) == {"weights", "kv_cache"}
    (entry,) = [p for p in sample.processes if p.pid == data["pid"]]
    parts = dict(ledger(reading))
    assert sum(parts.values()) == entry.used_bytes
    assert parts["other_live"] >= 0 and parts["outside_allocator"] > 0


def test_a_new_component_or_a_release_is_said_at_once_a_new_size_is_not():
    """The agent sends its full sample at the next tick for on_change: a new name (or a name
    on a new device) and a release call it; a server updating a size every step does not."""
    gpu = Allocator()
    components = Components(gpu)
    said: list[str] = []
    components.on_change.append(lambda: said.append("changed"))
    components.set("kv_cache", GiB)
    for step in range(100):
        components.set("kv_cache", GiB + step)
    assert said == ["changed"]
    components.set("kv_cache", GiB, device=1)
    with components.measure("weights"):
        gpu.alloc(GiB)
    with components.measure("weights"):
        gpu.alloc(GiB)
    assert len(said) == 3
    components.release("weights")
    assert len(said) == 4


def test_a_server_served_in_its_own_process_counts_its_component_problems_too(tmp_path):
    """Embedded without a helper (helper=False, attach()): the process's own actions carry
    its allocator source's component problems to /metrics, as an agent's full sample does
    (tests/transport/test_agent.py)."""
    from exporter.config import load_config
    from exporter.modes.embedded import local_actions
    from exporter.sources.torch_allocator import TorchAllocatorSource

    components = Components(lambda: {})
    for i in range(MAX_COMPONENTS + 1):
        components.set(f"part{i}", 1 << 20)
    source = TorchAllocatorSource(env={}, components=components)
    actions = local_actions(load_config(env={}, snapshot_dir=str(tmp_path)), [source])
    (counted,) = actions.counts()
    assert counted.counts.component_problems == {"overflowed": 1}
