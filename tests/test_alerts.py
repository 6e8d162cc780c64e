"""Each in-process alert is declared once (exporter/alerts.py), and each declaration is held
equal to its Prometheus rule in deploy/prometheus/alerts.yaml: severity, labels, duration, every
threshold's number, summary and runbook; its settings exist and each is read by an alert."""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

import pytest
import yaml

from exporter.alerts import ALERTS, BY_NAME, ON, UNITS, Alert
from exporter.config import Config
from tests.conftest import REPO_ROOT

RULES = REPO_ROOT / "deploy/prometheus/alerts.yaml"
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def rules() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def duration_s(text: str) -> float:
    return sum(int(n) * UNIT_S[u] for n, u in re.findall(r"(\d+)([smhd])", text))


def numbers_in(expr: str) -> set[float]:
    """The numbers an expression compares with: its literals, and its ranges and offsets in
    seconds ([10m], offset 10m)."""
    found = {float(n) for n in re.findall(r"(?<![\w.])(\d+(?:\.\d+)?)(?![\w.\[])", expr)}
    found |= {duration_s(d) for d in re.findall(r"\[(\w+)\]|offset (\w+)", expr) for d in d if d}
    return found


def defaults() -> dict[str, Any]:
    return {f.name: f.default for f in fields(Config)}


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: a.name)
def test_each_declaration_equals_its_prometheus_rule(alert: Alert) -> None:
    rule = rules()[alert.name]
    assert rule["labels"] == {"severity": alert.severity}
    hold = defaults()[alert.hold] if alert.hold else 0
    assert duration_s(rule.get("for", "0s")) == hold
    assert rule["annotations"]["summary"] == alert.summary
    assert rule["annotations"]["runbook"] == f"docs/runbooks.md#{alert.runbook}"
    numbers = numbers_in(rule["expr"])
    for threshold in alert.thresholds:
        assert float(defaults()[threshold]) in numbers, (threshold, sorted(numbers))


def test_every_declaration_is_well_formed_and_its_settings_are_read() -> None:
    settings = {f.name: f for f in fields(Config)}
    assert len(BY_NAME) == len(ALERTS)
    read = set()
    for alert in ALERTS:
        assert alert.on in ON and alert.unit in UNITS and alert.severity in ("warning", "critical")
        named = (*alert.thresholds, *([alert.hold] if alert.hold else []))
        assert set(named) <= set(settings), alert.name
        read |= set(named)
    detect = {name for name in settings if name.startswith("detect_")}
    # The hysteresis margin is every alert's, and in no rule (Prometheus has none).
    assert detect - read == {"detect_clear_margin"}


def test_the_numbers_a_rule_compares_with_are_read() -> None:
    """The reader the declaration test relies on: literals, ranges and offsets."""
    expr = "increase(x[10m]) > 0 or (x > 0.25 * y unless x offset 1h) and z > 1073741824"
    assert numbers_in(expr) == {0.0, 0.25, 600.0, 3600.0, 1073741824.0}
