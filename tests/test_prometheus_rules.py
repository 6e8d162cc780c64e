"""The Prometheus rules in deploy/prometheus/: promtool checks and tests, and the contract
between alerts, their promtool tests and docs/runbooks.md."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO_ROOT, require_tool

RULES_DIR = REPO_ROOT / "deploy" / "prometheus"
ALERTS_FILE = RULES_DIR / "alerts.yaml"
RECORDING_FILE = RULES_DIR / "recording.yaml"
RULE_FILES = [ALERTS_FILE, RECORDING_FILE]
RULE_TEST_FILES = sorted((RULES_DIR / "tests").glob("*.yaml"))
RUNBOOKS = REPO_ROOT / "docs" / "runbooks.md"
RUNBOOK_BASE = "https://github.com/gpumem-exporter/gpumem-exporter/blob/main/docs/runbooks.md#"
SEVERITIES = {"warning", "critical"}
REQUIRED_ANNOTATIONS = ("summary", "description", "runbook_url")
# level:metric:operations (https://prometheus.io/docs/practices/rules/)
RECORD_NAME = re.compile(r"^[a-z][a-z0-9_]*:[a-z][a-z0-9_]*:[a-z][a-z0-9_]*$")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _rules(path: Path) -> list[dict[str, Any]]:
    return [rule for group in _load(path)["groups"] for rule in group["rules"]]


def _alerts() -> list[dict[str, Any]]:
    return [rule for rule in _rules(ALERTS_FILE) if "alert" in rule]


def _run_promtool(*args: str) -> None:
    promtool = require_tool("promtool")
    result = subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=120, check=False
    )
    if result.returncode != 0:
        pytest.fail(
            f"promtool {' '.join(args)} exited {result.returncode}:\n"
            f"{result.stdout}\n{result.stderr}",
            pytrace=False,
        )


# --------------------------------------------------------------------------- promtool


@pytest.mark.parametrize("rule_file", RULE_FILES, ids=_rel)
def test_promtool_check_rules(rule_file: Path) -> None:
    _run_promtool("check", "rules", str(rule_file))


@pytest.mark.parametrize("test_file", RULE_TEST_FILES, ids=_rel)
def test_promtool_test_rules(test_file: Path) -> None:
    _run_promtool("test", "rules", str(test_file))


def test_rule_test_files_exist() -> None:
    assert RULE_TEST_FILES, "no promtool test files in deploy/prometheus/tests/"


# ------------------------------------------------------------------- alert annotations


def test_alert_names_are_unique() -> None:
    names = Counter(rule["alert"] for rule in _alerts())
    assert [name for name, count in names.items() if count > 1] == []


@pytest.mark.parametrize("alert", _alerts(), ids=lambda rule: rule["alert"])
def test_alert_has_severity_and_annotations(alert: dict[str, Any]) -> None:
    assert alert.get("labels", {}).get("severity") in SEVERITIES
    annotations = alert.get("annotations", {})
    for key in REQUIRED_ANNOTATIONS:
        assert str(annotations.get(key, "")).strip(), f"{alert['alert']}: no {key}"
    assert annotations["runbook_url"].startswith(RUNBOOK_BASE)


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


def test_github_anchor() -> None:
    assert github_anchor("GpuMemFragmentationHigh") == "gpumemfragmentationhigh"
    assert (
        github_anchor("Returning cache to the driver (`POST /empty-cache`)")
        == "returning-cache-to-the-driver-post-empty-cache"
    )
    assert markdown_anchors("# A\n```sh\n# not a heading\n```\n## A\n") == {"a", "a-1"}


def test_runbook_urls_point_at_headings() -> None:
    anchors = markdown_anchors(RUNBOOKS.read_text(encoding="utf-8"))
    missing = {
        rule["alert"]: rule["annotations"]["runbook_url"]
        for rule in _alerts()
        if rule["annotations"]["runbook_url"].removeprefix(RUNBOOK_BASE) not in anchors
    }
    assert missing == {}, f"runbook_url anchors with no heading in {_rel(RUNBOOKS)}"


def test_runbook_table_lists_every_alert() -> None:
    """The table at the top of docs/runbooks.md: one row per alert, with its severity."""
    rows = re.findall(
        r"^\| \[(\w+)\]\(#([^)]+)\) \| (\w+) \|", RUNBOOKS.read_text(encoding="utf-8"), re.M
    )
    table = {name: (anchor, severity) for name, anchor, severity in rows}
    assert len(rows) == len(table), "an alert is listed twice"
    expected = {
        rule["alert"]: (
            rule["annotations"]["runbook_url"].removeprefix(RUNBOOK_BASE),
            rule["labels"]["severity"],
        )
        for rule in _alerts()
    }
    assert table == expected


def test_runbook_internal_links_resolve() -> None:
    markdown = RUNBOOKS.read_text(encoding="utf-8")
    anchors = markdown_anchors(markdown)
    links = set(re.findall(r"\]\(#([^)]+)\)", markdown))
    assert sorted(links - anchors) == []


# ------------------------------------------------------------------------ rule tests


def _alert_cases() -> list[tuple[str, str, str, list[dict[str, Any]]]]:
    """(test file, test name, alertname, exp_alerts) for every alert_rule_test case."""
    cases = []
    for path in RULE_TEST_FILES:
        for test in _load(path).get("tests", []):
            for case in test.get("alert_rule_test") or []:
                exp_alerts = case.get("exp_alerts") or []
                cases.append((path.name, test.get("name", "?"), case["alertname"], exp_alerts))
    return cases


def test_every_alert_has_firing_and_non_firing_cases() -> None:
    names = {rule["alert"] for rule in _alerts()}
    cases = _alert_cases()
    firing = {name for _, _, name, exp in cases if exp}
    quiet = {name for _, _, name, exp in cases if not exp}
    assert sorted(names - firing) == [], "alerts with no firing promtool case"
    assert sorted(names - quiet) == [], "alerts with no non-firing promtool case"
    # A misspelt alertname would make a non-firing case pass for nothing.
    assert sorted({name for _, _, name, _ in cases} - names) == []


def test_firing_cases_assert_labels_and_annotations() -> None:
    required = {rule["alert"]: rule for rule in _alerts()}
    problems = []
    for file, test, name, exp_alerts in _alert_cases():
        rule = required.get(name)
        for alert in exp_alerts:
            labels = alert.get("exp_labels") or {}
            annotations = alert.get("exp_annotations") or {}
            if rule is None:
                continue
            if labels.get("severity") != rule["labels"]["severity"]:
                problems.append(f"{file}: {test}: {name}: exp_labels lacks severity")
            if set(annotations) != set(rule["annotations"]):
                problems.append(f"{file}: {test}: {name}: exp_annotations incomplete")
    assert problems == []


# ------------------------------------------------------------------- recording rules


def test_recording_rule_names_follow_convention() -> None:
    names = [rule["record"] for rule in _rules(RECORDING_FILE)]
    assert names, "no recording rules"
    assert [name for name in names if not RECORD_NAME.match(name)] == []
    assert [name for name, count in Counter(names).items() if count > 1] == []


def test_every_recording_rule_is_tested() -> None:
    exprs = [
        case["expr"]
        for path in RULE_TEST_FILES
        for test in _load(path).get("tests", [])
        for case in test.get("promql_expr_test") or []
    ]
    untested = [
        rule["record"]
        for rule in _rules(RECORDING_FILE)
        if not any(re.search(rf"(?<![\w:]){re.escape(rule['record'])}(?![\w:])", e) for e in exprs)
    ]
    assert untested == []


def test_rule_files_are_plain() -> None:
    """The Helm chart includes these files verbatim: no Helm templating in them."""
    for path in RULE_FILES:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\{\{-?\s*(\.Values|\.Release|include|template)\b", text), path
