"""Shared test helpers.

Tests that need an external tool (promtool, prometheus, helm, node) skip when it is missing on
a developer's machine, but CI sets GPUMEM_REQUIRE_TOOLS=1 so that a missing tool fails the run
instead of silently skipping the check.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = Path(__file__).resolve().parent / "data"


def _local_test_client() -> None:
    """Starlette's TestClient calls from the host "testclient", which is no address: the
    admin API refuses credentials in clear from any client that is not loopback
    (exporter.http.admin), so a TestClient here stands for a local caller, as the tests mean.
    A test of a remote caller passes client=(address, port) itself."""
    from starlette.testclient import TestClient

    original = TestClient.__init__

    def local(
        self: TestClient, *args: Any, client: tuple[str, int] = ("127.0.0.1", 50000), **kw: Any
    ) -> None:
        original(self, *args, client=client, **kw)  # type: ignore[misc]

    TestClient.__init__ = local  # type: ignore[method-assign]


_local_test_client()


def require_tool(name: str) -> str:
    """Return the path of an executable, skipping (or failing in CI) when it is missing."""
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} not found on PATH"
    if os.environ.get("GPUMEM_REQUIRE_TOOLS") == "1":
        pytest.fail(message + " (GPUMEM_REQUIRE_TOOLS=1)")
    pytest.skip(message)
    raise AssertionError("unreachable")


def mount_tmpfs(*args: str) -> None:
    if shutil.which("mount") is None:
        result = None
    else:
        result = subprocess.run(["mount", *args], capture_output=True, text=True)
    if result is None or result.returncode != 0:
        why = result.stderr.strip() if result is not None else "no mount command"
        message = f"cannot mount a tmpfs here ({why}); these tests need root"
        if os.environ.get("GPUMEM_REQUIRE_TOOLS") == "1":
            pytest.fail(message + " (GPUMEM_REQUIRE_TOOLS=1)")
        pytest.skip(message)


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) -> a fresh tmpfs of that size, unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        mount_tmpfs("-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where))
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A fresh folder for a run's agent socket, under /tmp: its path stays under the 107
    bytes a Unix socket's path may have (pytest's tmp_path may not)."""
    folder = Path(tempfile.mkdtemp(prefix="gr-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def repo_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child that imports the repository: REPO_ROOT put
    before the PYTHONPATH it already has (the GPU machine's packages are found through it),
    with EXTRA set."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def run_support_script(script: str, *args: str, alloc_conf: str = "") -> dict:
    """Run tests/support/SCRIPT ARGS in a fresh process (allocator settings and CUDA contexts
    are per process) and return the JSON object it prints last."""
    env = repo_env(PYTORCH_CUDA_ALLOC_CONF=alloc_conf)
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tests" / "support" / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The fast lane (pytest -m "not slow") stays fast only if slow tests say so: a run names the
# tests over this many seconds (setup, call and teardown) that are not marked `slow`.
UNMARKED_SLOW_S = 4.0
_took: dict[str, float] = {}
_slow_marked: set[str] = set()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _took[report.nodeid] = _took.get(report.nodeid, 0.0) + report.duration
    if "slow" in report.keywords:
        _slow_marked.add(report.nodeid)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    unmarked = sorted(
        (seconds, nodeid)
        for nodeid, seconds in _took.items()
        if seconds > UNMARKED_SLOW_S and nodeid not in _slow_marked
    )
    if unmarked:
        terminalreporter.write_sep("-", "slow tests not marked @pytest.mark.slow")
        for seconds, nodeid in reversed(unmarked):
            terminalreporter.write_line(f"{seconds:6.1f}s {nodeid}")
