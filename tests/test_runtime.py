"""The assembly (exporter/runtime.py): each mode's sources come from one table."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.config import load_config
from exporter.modes import MODES
from exporter.runtime import SOURCE_KINDS, build_runtime, sources_for


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


def test_every_source_kind_is_read_by_declared_modes() -> None:
    for kind in SOURCE_KINDS:
        assert set(kind.modes) <= set(MODES), kind.name


def test_a_run_runtime_needs_its_launchers_fan_out() -> None:
    """`run` acts through the agents of its server: no runtime of it acts on this process."""
    with pytest.raises(ValueError, match="caller passes its actions"):
        build_runtime(load_config(env={}), mode="run", sources=[])
