"""The rules' two tiers stay correct when a fleet is sharded by node (issue 40).

A shard scrapes every target of its nodes and nothing else, so a node-tier rule (recording.yaml,
alerts.yaml) is exact on it only if it never combines series of two nodes: every aggregation
keeps, and every join matches on, a label whose value lives on one node. A global-tier rule
(recording-global.yaml) runs where every shard's results meet, so it must read only the node
tier's results: a raw series there is either missing (a store fed only recorded series) or far
too many to read each evaluation, and a global rule's own result would be one evaluation stale.
The expressions are parsed as PromQL (promql-parser, Prometheus's grammar), not matched as text.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser as promql
import pytest
import yaml

from tests.conftest import REPO_ROOT

RULES_DIR = REPO_ROOT / "deploy" / "prometheus"
# A file named *-global.yaml is the global tier, any other rule file the node tier (the Helm
# chart's prometheusRule.tiers picks files the same way).
GLOBAL_FILES = sorted(RULES_DIR.glob("*-global.yaml"))
NODE_FILES = sorted(set(RULES_DIR.glob("*.yaml")) - set(GLOBAL_FILES))
# Labels whose every value lives on one node: the node itself, a scrape target, a GPU; and a
# pod (namespace and pod together), which Kubernetes runs on exactly one node.
ON_ONE_NODE = ({"node"}, {"instance"}, {"gpu_uuid"}, {"namespace", "pod"})


def rules(paths: list[Path]) -> list[dict[str, Any]]:
    return [
        rule
        for path in paths
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]
        for rule in group["rules"]
    ]


def name_of(rule: dict[str, Any]) -> str:
    return str(rule.get("record") or rule.get("alert"))


def nodes(expr: Any) -> Iterator[Any]:
    """Every node of a parsed expression, the expression first."""
    yield expr
    for child in ("expr", "lhs", "rhs", "vector_selector", "param"):
        inner = getattr(expr, child, None)
        if inner is not None and not isinstance(inner, str | float | int):
            yield from nodes(inner)
    for arg in getattr(expr, "args", None) or []:
        yield from nodes(arg)


def keeps_one_node(labels: set[str]) -> bool:
    return any(key <= labels for key in ON_ONE_NODE)


def crossings(expr_text: str) -> list[str]:
    """The places where an expression combines series of several nodes."""
    found = []
    for node in nodes(promql.parse(expr_text)):
        if isinstance(node, promql.AggregateExpr):
            modifier = node.modifier
            if modifier is None:
                found.append(f"{node.op} over everything")
            elif modifier.type == promql.AggModifierType.By:
                if not keeps_one_node(set(modifier.labels)):
                    found.append(f"{node.op} by ({', '.join(modifier.labels)})")
            elif all(key & set(modifier.labels) for key in ON_ONE_NODE):
                found.append(f"{node.op} without ({', '.join(modifier.labels)})")
        elif isinstance(node, promql.BinaryExpr) and node.modifier is not None:
            matching = node.modifier.matching
            if matching is None:
                continue
            labels = set(matching.labels)
            on = matching.type == promql.LabelModifierType.Include
            if on and not keeps_one_node(labels):
                found.append(f"{node.op} on ({', '.join(matching.labels)})")
            if not on and all(key & labels for key in ON_ONE_NODE):
                found.append(f"{node.op} ignoring ({', '.join(matching.labels)})")
    return found


def series_read(expr_text: str) -> set[str]:
    return {
        node.name or ""
        for node in nodes(promql.parse(expr_text))
        if isinstance(node, promql.VectorSelector)
    }


def test_both_tiers_have_rules() -> None:
    assert [p.name for p in GLOBAL_FILES] == ["recording-global.yaml"]
    assert {p.name for p in NODE_FILES} == {"alerts.yaml", "recording.yaml"}
    assert rules(GLOBAL_FILES) and rules(NODE_FILES)


@pytest.mark.parametrize("rule", rules(NODE_FILES), ids=name_of)
def test_no_node_rule_combines_series_of_two_nodes(rule: dict[str, Any]) -> None:
    assert crossings(rule["expr"]) == []


@pytest.mark.parametrize("rule", rules(GLOBAL_FILES), ids=name_of)
def test_every_global_rule_reads_only_the_node_tiers_results(rule: dict[str, Any]) -> None:
    node_results = {r["record"] for r in rules(NODE_FILES) if "record" in r}
    read = series_read(rule["expr"])
    assert read and read <= node_results, read - node_results


def test_no_node_rule_reads_a_global_result() -> None:
    global_results = {r["record"] for r in rules(GLOBAL_FILES)}
    assert [name_of(r) for r in rules(NODE_FILES) if series_read(r["expr"]) & global_results] == []


@pytest.mark.parametrize(
    ("expr", "crossing"),
    [
        ("sum by (cluster, namespace) (x)", "sum by (cluster, namespace)"),
        ("quantile by (cluster) (0.9, x)", "quantile by (cluster)"),
        ("max(x)", "max over everything"),
        ("count without (node, instance, gpu_uuid, pod) (x)", "count without"),
        ("a * on (cluster, namespace) group_left b", "* on (cluster, namespace)"),
        ("a and ignoring (node, instance, gpu_uuid, pod) b", "and ignoring"),
    ],
)
def test_the_check_sees_a_crossing(expr: str, crossing: str) -> None:
    """The check itself can fail: each of these combines several nodes' series."""
    assert [c for c in crossings(expr) if c.startswith(crossing)]


@pytest.mark.parametrize(
    "expr",
    [
        "sum by (cluster, namespace, pod) (x)",
        "max by (cluster, gpu_uuid) (x)",
        "a * on (cluster, gpu_uuid) group_left b",
        "a > ignoring (pid, rank) group_left 0.5 * b",
        "sum without (pid) (x)",
        "rate(x[5m]) > 0",
    ],
)
def test_the_check_passes_what_stays_on_one_node(expr: str) -> None:
    assert crossings(expr) == []
