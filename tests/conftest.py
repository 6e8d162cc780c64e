"""Shared test helpers.

Tests that need an external tool (promtool, prometheus, helm, node) skip when it is missing on
a developer's machine, but CI sets GPUMEM_REQUIRE_TOOLS=1 so that a missing tool fails the run
instead of silently skipping the check.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = Path(__file__).resolve().parent / "data"


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
