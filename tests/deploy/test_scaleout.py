"""The shipped rules and dashboards answer the same on a fleet sharded by node as on one
Prometheus (issue 40): bench.scaleout, small, with the real servers (Prometheus shards with
hashmod by node, VictoriaMetrics, vmalert for the global tier).

A canary rule that is wrong under sharding (a count over the cluster in the node tier) rides
along in the same run: the comparison must find it and nothing else, so the check is seen to
fail where it should."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.scaleout import GLOBAL_TIER, NODE_TIER, Tolerance, differences, run
from tests.conftest import require_tool

CANARY = "cluster:gpu_memory_total_bytes:count"


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    for tool in ("prometheus", "victoria-metrics", "vmalert"):
        require_tool(tool)
    canary = tmp_path_factory.mktemp("canary") / "canary.yaml"
    rule = {"record": CANARY, "expr": "count by (cluster) (cluster_gpu:gpu_memory_total_bytes:max)"}
    canary.write_text(yaml.safe_dump({"groups": [{"name": "canary", "rules": [rule]}]}))
    args = argparse.Namespace(
        nodes=8,
        shards=3,
        scrape_s=3,
        tick_s=40,
        warmup_s=45,
        restart_s=7200,
        evaluations=2,
        no_single=False,
        # Half the nodes alerting: the firing sets compared hold some nodes and not others.
        alerting_every=2,
        extra_node_rules=[canary],
    )
    return run(args)


def records(paths: list[Path]) -> set[str]:
    return {
        rule["record"]
        for path in paths
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if "record" in rule
    }


@pytest.mark.slow
def test_every_answer_matches_one_prometheus_but_the_canarys(result: dict[str, Any]) -> None:
    comparison = result["comparison"]
    assert [row["name"] for row in comparison["mismatches"]] == [CANARY]
    # The canary counts each shard's GPUs, not the fleet's: the check sees the wrong answer.
    assert "64.0" in str(comparison["mismatches"][0]["differences"])


@pytest.mark.slow
def test_the_comparison_covers_both_tiers_alerts_and_dashboards(result: dict[str, Any]) -> None:
    rows = result["comparison"]["rows"]
    compared = {row["name"] for row in rows if row["what"] == "recorded"}
    assert records([*NODE_TIER, *GLOBAL_TIER]) | {CANARY} == compared
    with_series = Counter(row["what"] for row in rows if row["series"])
    # Every global rule answers (none vacuous), alerts fire or wait, most panels have series.
    assert {r["name"] for r in rows if r["series"]} >= records(GLOBAL_TIER)
    assert next(r for r in rows if r["name"] == "ALERTS")["series"] > 0
    assert with_series["dashboard"] >= 60
    # rate()/increase() of raw counters, answered by the store's own engine: reported apart.
    assert with_series["engine"] >= 10


@pytest.mark.slow
def test_each_shard_holds_part_of_the_fleet(result: dict[str, Any]) -> None:
    components = result["costs"]["components"]
    shards = [components[f"shard-{i}"]["head_series"] for i in range(3)]
    assert all(series > 0 for series in shards)
    assert max(shards) < components["single"]["head_series"]
    assert result["costs"]["store_series"] >= sum(shards) * 0.9
    assert "gpumem-exporter.recording-global" in result["costs"]["ruler_group_s"]


def series(**values: float) -> dict[frozenset[tuple[str, str]], float]:
    return {frozenset({("pod", pod)}): value for pod, value in values.items()}


def test_a_top_10_of_tied_values_matches_by_its_values() -> None:
    """topk over equal values may pick any of them: the same values, other pods, match."""
    ours, theirs = series(a=1.0, b=1.0), series(c=1.0, d=1.0)
    assert differences(ours, [theirs] * 3, Tolerance(ranked=True)) == []
    assert differences(ours, [theirs] * 3) != []
    assert differences(series(a=1.0, b=2.0), [theirs] * 3, Tolerance(ranked=True)) != []


def test_an_answer_within_one_evaluation_matches() -> None:
    before, now, after = series(a=1.0), series(a=2.0), series(a=3.0)
    assert differences(series(a=3.0), [before, now, after]) == []
    assert differences(series(a=4.0), [before, now, after]) != []
    assert differences(series(a=2.0, b=1.0), [before, now, after]) != []  # an extra series


def test_increase_over_a_window_may_differ_by_its_share_of_an_interval() -> None:
    windowed = Tolerance(relative=15 / 300)
    assert differences(series(a=8.16), [series(a=8.36)] * 3, windowed) == []
    assert differences(series(a=8.16), [series(a=8.36)] * 3) != []
    assert differences(series(a=4.0), [series(a=8.36)] * 3, windowed) != []
