"""The Prometheus rules in deploy/prometheus/: promtool checks and tests, and the contract
between alerts, their promtool tests and docs/runbooks.md."""

from __future__ import annotations

import re
import shlex
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO_ROOT, require_tool
from tests.helpers import github_anchor, markdown_anchors, promtool

RULES_DIR = REPO_ROOT / "deploy" / "prometheus"
ALERTS_FILE = RULES_DIR / "alerts.yaml"
# The node tier and the global tier (tests/deploy/test_rule_tiers.py).
RECORDING_FILES = [RULES_DIR / "recording.yaml", RULES_DIR / "recording-global.yaml"]
RULE_FILES = [ALERTS_FILE, *RECORDING_FILES]
RULE_TEST_FILES = sorted((RULES_DIR / "tests").glob("*.yaml"))
RUNBOOKS = REPO_ROOT / "docs" / "runbooks.md"
# Each alert names its runbook section by path; the Helm chart turns it into a runbook_url only
# when told where the runbooks are hosted (runbookUrlBase).
RUNBOOK = re.compile(r"^docs/runbooks\.md#([a-z0-9-]+)$")
SEVERITIES = {"warning", "critical"}
REQUIRED_ANNOTATIONS = ("summary", "description", "runbook")
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


def _run_promtool(*args: str, major: int = 2) -> None:
    result = subprocess.run(
        [promtool(major), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(
            f"promtool {' '.join(args)} exited {result.returncode}:\n"
            f"{result.stdout}\n{result.stderr}",
            pytrace=False,
        )


# --------------------------------------------------------------------------- promtool


@pytest.mark.parametrize("major", [2, 3])
@pytest.mark.parametrize("rule_file", RULE_FILES, ids=_rel)
def test_promtool_check_rules(rule_file: Path, major: int) -> None:
    _run_promtool("check", "rules", str(rule_file), major=major)


@pytest.mark.slow
@pytest.mark.parametrize("major", [2, 3])
@pytest.mark.parametrize("test_file", RULE_TEST_FILES, ids=_rel)
def test_promtool_test_rules(test_file: Path, major: int) -> None:
    _run_promtool("test", "rules", str(test_file), major=major)


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
    assert RUNBOOK.match(annotations["runbook"]), annotations["runbook"]
    # No shipped link may point somewhere that does not exist: the project hosts no runbooks.
    assert "runbook_url" not in annotations
    assert not [value for value in annotations.values() if "://" in value]


def runbook_anchor(alert: dict[str, Any]) -> str:
    match = RUNBOOK.match(alert["annotations"]["runbook"])
    assert match, f"{alert['alert']}: runbook is not docs/runbooks.md#<anchor>"
    return match.group(1)


def test_github_anchor() -> None:
    assert github_anchor("GpuMemFragmentationHigh") == "gpumemfragmentationhigh"
    assert (
        github_anchor("Returning cache to the driver (`POST /empty-cache`)")
        == "returning-cache-to-the-driver-post-empty-cache"
    )
    assert markdown_anchors("# A\n```sh\n# not a heading\n```\n## A\n") == {"a", "a-1"}


def test_runbook_anchors_point_at_headings() -> None:
    assert RUNBOOKS.is_file()
    anchors = markdown_anchors(RUNBOOKS.read_text(encoding="utf-8"))
    missing = {
        rule["alert"]: rule["annotations"]["runbook"]
        for rule in _alerts()
        if runbook_anchor(rule) not in anchors
    }
    assert missing == {}, f"runbook anchors with no heading in {_rel(RUNBOOKS)}"


def test_documented_runbook_url_rewrite(tmp_path: Path) -> None:
    """docs/deploy.md's sed command gives every alert of the plain file a runbook_url."""
    deploy_doc = (REPO_ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    line = next(
        block.replace("\\\n", " ")
        for block in re.findall(r"```sh\n(.*?)```", deploy_doc, re.S)
        if "runbook_url" in block
    )
    sed, flag, script, source, redirect, _ = shlex.split(line)
    assert (sed, flag, source, redirect) == ("sed", "-E", _rel(ALERTS_FILE), ">")
    rewritten = subprocess.run(
        [require_tool("sed"), flag, script, str(ALERTS_FILE)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (tmp_path / "alerts.yaml").write_text(rewritten)
    _run_promtool("check", "rules", str(tmp_path / "alerts.yaml"))
    alerts = [r for g in yaml.safe_load(rewritten)["groups"] for r in g["rules"] if "alert" in r]
    base = "https://git.example.com/ml/gpumem-exporter/blob/main/docs/runbooks.md#"
    assert [a["annotations"]["runbook_url"] for a in alerts] == [
        base + runbook_anchor(rule) for rule in _alerts()
    ]
    assert not [a for a in alerts if "runbook" in a["annotations"]]


def test_runbook_table_lists_every_alert() -> None:
    """The table at the top of docs/runbooks.md: one row per alert, with its severity."""
    rows = re.findall(
        r"^\| \[(\w+)\]\(#([^)]+)\) \| (\w+) \|", RUNBOOKS.read_text(encoding="utf-8"), re.M
    )
    table = {name: (anchor, severity) for name, anchor, severity in rows}
    assert len(rows) == len(table), "an alert is listed twice"
    expected = {
        rule["alert"]: (runbook_anchor(rule), rule["labels"]["severity"]) for rule in _alerts()
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
    names = [rule["record"] for path in RECORDING_FILES for rule in _rules(path)]
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
        for path in RECORDING_FILES
        for rule in _rules(path)
        if not any(re.search(rf"(?<![\w:]){re.escape(rule['record'])}(?![\w:])", e) for e in exprs)
    ]
    assert untested == []


def test_rule_files_are_plain() -> None:
    """The Helm chart includes these files verbatim: no Helm templating in them."""
    for path in RULE_FILES:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\{\{-?\s*(\.Values|\.Release|include|template)\b", text), path
