"""The assembly (exporter/runtime.py): each mode's sources come from one table."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.config import load_config
from exporter.modes import MODES
from exporter.runtime import build_runtime, sources_for
from exporter.sources import CAPABILITIES, provides, providing
from exporter.sources.kinds import SOURCE_KINDS


def names(mode: str, **settings: Any) -> list[str]:
    sources = sources_for(mode, load_config(env={}, **settings))
    try:
        return [source.name for source in sources]
    finally:
        for source in sources:
            source.close()


def test_each_mode_reads_the_sources_declared_for_it(tmp_path) -> None:
    socket = str(tmp_path / "kubelet.sock")
    assert names("embedded") == ["torch", "nvml", "host"]
    assert names("node", kubelet_socket=socket) == ["nvml", "host", "kubelet"]
    # The node daemon reads GPU processes' host memory only to serve it at the full level.
    full = names("node", kubelet_socket=socket, detail="full")
    assert full == ["nvml", "host", "process_memory", "kubelet"]
    assert names("run") == ["nvml", "host"]  # and the launcher's agents and process tree
    assert names("demo") == []  # its replay is the command's own


def test_a_setting_turns_its_source_off(tmp_path) -> None:
    assert names("embedded", torch=False, nvml=False) == ["host"]
    assert names("node", host_memory=False, kubelet_socket="off") == ["nvml"]


def test_the_allocator_setting_picks_the_allocator_source() -> None:
    assert names("embedded", allocator_api="accelerator") == ["accelerator", "nvml", "host"]
    assert names("run", allocator_api="accelerator") == ["nvml", "host"]


def test_every_source_kind_provides_what_its_source_says_and_every_mode_reads_known_things(
    tmp_path,
) -> None:
    """A kind's declaration and its source's class agree on what it provides (neighbours find
    it by that); every mode reads only declared capabilities, each provided by some kind."""
    provided = set().union(*(kind.provides for kind in SOURCE_KINDS))
    assert provided <= set(CAPABILITIES)
    for mode in MODES.values():
        assert set(mode.reads) <= provided, mode.name
    socket = str(tmp_path / "kubelet.sock")
    for api in ("cuda", "accelerator"):
        config = load_config(env={}, kubelet_socket=socket, detail="full", allocator_api=api)
        made = sources_for("embedded", config) + sources_for("node", config)
        try:
            by_name = {kind.name: kind for kind in SOURCE_KINDS}
            for source in made:
                assert provides(source) == by_name[source.name].provides, source.name
            assert {s.name for s in made} == {
                "nvml",
                "host",
                "process_memory",
                "kubelet",
                "torch" if api == "cuda" else "accelerator",
            }
        finally:
            for source in made:
                source.close()


def test_neighbours_find_a_source_by_what_it_provides() -> None:
    """The NVML source reads the GPUs of whatever allocator source was made; the kubelet and
    process-memory sources follow whatever source provides per-process GPU memory."""
    config = load_config(env={}, allocator_api="accelerator")
    made = sources_for("embedded", config)
    try:
        allocator: Any
        nvml: Any
        (allocator,) = providing(made, "allocator")
        (nvml,) = providing(made, "device_memory")
        allocator.uuids_in_use = frozenset({"GPU-x"})
        assert nvml._only_uuids() == frozenset({"GPU-x"})
    finally:
        for source in made:
            source.close()


def test_a_run_runtime_needs_its_launchers_fan_out() -> None:
    """`run` acts through the agents of its server: no runtime of it acts on this process."""
    with pytest.raises(ValueError, match="caller passes its actions"):
        build_runtime(load_config(env={}), mode="run", sources=[])
