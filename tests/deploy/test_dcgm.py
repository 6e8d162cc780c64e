"""What README.md says of running beside dcgm-exporter holds: its join query answers under
Prometheus 2 and 3 (promtool's rule tests, on series shaped as each exporter labels them), and
the panels it says need the node daemon are exactly those whose queries read a family only
the daemon serves (directly or through a recording rule)."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from exporter import catalog
from exporter.modes import MODES
from tests.conftest import REPO_ROOT
from tests.helpers import promtool

README = REPO_ROOT / "README.md"


def _join_query() -> str:
    text = README.read_text()
    section = text[text.index("To join with dcgm-exporter's series") :]
    return re.search(r"```promql\n(.*?)```", section, re.S).group(1).strip()  # type: ignore[union-attr]


DCGM_HOST = 'Hostname="n1",modelName="NVIDIA H100 80GB HBM3"'


def _series(name: str, labels: str, value: int) -> dict[str, str]:
    return {"series": f"{name}{{{labels}}}", "values": f"{value}x3"}


@pytest.mark.parametrize("major", [2, 3])
def test_the_readmes_dcgm_join_answers(tmp_path, major):
    rule = {"record": "readme:join", "expr": _join_query()}
    rules = {"groups": [{"name": "join", "rules": [rule]}]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    gib = 1 << 30
    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    # Two processes of one server on GPU-a (as under `run`), one on GPU-b.
                    _series("torch_cuda_reserved_bytes", 'gpu_uuid="GPU-a",pid="1"', 2 * gib),
                    _series("torch_cuda_reserved_bytes", 'gpu_uuid="GPU-a",pid="2"', gib),
                    _series("torch_cuda_reserved_bytes", 'gpu_uuid="GPU-b",pid="3"', gib),
                    # dcgm-exporter's labels, framebuffer used in MiB.
                    _series("DCGM_FI_DEV_FB_USED", f'UUID="GPU-a",gpu="0",{DCGM_HOST}', 6144),
                    _series("DCGM_FI_DEV_FB_USED", f'UUID="GPU-b",gpu="1",{DCGM_HOST}', 4096),
                ],
                "promql_expr_test": [
                    {
                        "expr": "readme:join",
                        "eval_time": "2m",
                        "exp_samples": [
                            {"labels": 'readme:join{gpu_uuid="GPU-a"}', "value": 0.5},
                            {"labels": 'readme:join{gpu_uuid="GPU-b"}', "value": 0.25},
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    result = subprocess.run(
        [promtool(major), "test", "rules", str(tmp_path / "test.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _daemon_only() -> set[str]:
    def served(mode: str) -> set[str]:
        has = MODES[mode].traits.has
        return {f.name for f in catalog.FAMILIES if f.served(has)}

    return served("node") - served("embedded") - served("helper")


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def test_the_panels_the_readme_says_need_the_daemon_are_those_that_do():
    only = _daemon_only()
    recorded = {
        rule["record"]: rule["expr"]
        for path in (REPO_ROOT / "deploy" / "prometheus").glob("*.yaml")
        for group in yaml.safe_load(path.read_text()).get("groups", [])
        for rule in group["rules"]
        if "record" in rule
    }

    def needs(expr: str, seen: frozenset[str] = frozenset()) -> bool:
        names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
        if any(n in only or re.sub(r"_(total|info)$", "", n) in only for n in names):
            return True
        return any(
            n in recorded and n not in seen and needs(recorded[n], seen | {n}) for n in names
        )

    needing = set()
    for path in sorted((REPO_ROOT / "dashboards").glob("*.json")):
        for panel in _panels(json.loads(path.read_text()).get("panels", [])):
            if any(needs(t.get("expr", "")) for t in panel.get("targets", [])):
                needing.add(panel["title"])
    assert len(needing) >= 5
    text = README.read_text()
    start, end = text.index("Without the daemon the dashboards"), text.index("To join with dcgm")
    section = text[start:end]
    said = set(re.findall(r"\*([^*]+)\*", " ".join(section.split())))
    assert said == needing
