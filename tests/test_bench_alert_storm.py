"""bench.alert_storm times the shipped alert against itself with less text: the variants must
differ only in their annotations, and the shipped one must hold on the series it is given."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.alert_storm import ALERT, storm_test, variants
from bench.fleet import shipped_alert as shipped_rule
from tests.conftest import require_tool


def test_the_variants_differ_only_in_their_text() -> None:
    rule = shipped_rule(ALERT)
    found = variants(rule)
    assert found["shipped"] == rule
    assert found["none"]["annotations"] == {}
    static = found["static"]["annotations"]
    assert static and all("{{" not in v for v in static.values())
    assert set(static) < set(rule["annotations"])
    for variant in found.values():
        assert {k: v for k, v in variant.items() if k != "annotations"} == {
            k: v for k, v in rule.items() if k != "annotations"
        }


@pytest.mark.slow
def test_the_series_hold_the_alert_past_its_for(tmp_path: Path) -> None:
    """Else the bench would time an alert that never became active."""
    test = storm_test(tmp_path, shipped_rule(ALERT), 1, checked=ALERT)
    proc = subprocess.run(
        [require_tool("promtool"), "test", "rules", str(test)], capture_output=True, text=True
    )
    # Expecting no alert fails: the alert fires on these series.
    assert proc.returncode != 0 and f'alertname="{ALERT}"' in proc.stdout + proc.stderr


def test_the_recorded_variant_replaces_the_raw_aggregation() -> None:
    """Else bench.alert_cost would time the shipped expression twice."""
    from bench.alert_cost import RAW_MAX, RECORDED_MAX, expressions

    EXPRESSIONS = expressions()
    SHATTERED = EXPRESSIONS["GpuMemFreeCacheShattered"]
    variant = EXPRESSIONS["  reading the recorded per-GPU maximum"]
    assert RAW_MAX in SHATTERED and RAW_MAX not in variant and RECORDED_MAX in variant


@pytest.mark.slow
def test_the_alert_cost_bench_times_queries_over_its_written_history() -> None:
    require_tool("prometheus")
    require_tool("promtool")
    from bench.alert_cost import expressions, measure

    result = measure(16)
    assert set(result["seconds"]) == set(expressions())
    assert all(0 < s < 30 for s in result["seconds"].values())
