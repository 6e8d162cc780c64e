"""bench.fleet serves each node exactly the exporter's own exposition, with the node's own
identities: what Prometheus stores in the fleet benchmark is what a fleet of this exporter
would send it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.fleet import RULES, Fleet, alert_rules, grafana_step, substitute
from bench.fleet_series import QUIET_TICKS, measure_texts
from tests.conftest import require_tool


def ids(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {
        (s.name, tuple(sorted(s.labels.items())))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.slow
def test_each_node_is_the_exporters_exposition_with_its_own_identities() -> None:
    run_text, node_text = measure_texts(8)
    fleet = Fleet(10, run_text, node_text, restart_s=7200)
    now = fleet.started + 60
    for endpoint, text in (("run", run_text), ("node", node_text)):
        three, four = (fleet.render(n, endpoint, now).decode() for n in (3, 4))
        assert len(ids(three)) == len(ids(text))  # every series, none added
        assert {n for n, _ in ids(three)} == {n for n, _ in ids(text)}
        # A GPU's series are the node's own (the rest differ by the target's labels).
        gpus = {i for i in ids(three) if "gpu_uuid" in dict(i[1])}
        assert gpus and gpus.isdisjoint(ids(four))
        assert "GPU-00000003-" in three and "GPU-00000000-" not in three
    node = fleet.render(3, "node", now).decode()
    assert 'pod="llm-3"' in node and 'namespace="team-3"' in node


@pytest.mark.slow
def test_a_restart_changes_only_the_pids_and_restarts_the_counters() -> None:
    run_text, node_text = measure_texts(8)
    fleet = Fleet(10, run_text, node_text, restart_s=600)
    node = 5  # restarts 300 s into the run
    before = fleet.render(node, "run", fleet.started + 290).decode()
    after = fleet.render(node, "run", fleet.started + 310).decode()
    changed = ids(after) - ids(before)
    assert changed and {name for name, _ in changed} == {"gpumem_exporter_process_info"}
    assert len(changed) / len(ids(after)) <= 0.10

    def counter(text: str) -> float:
        (value,) = [
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "torch_cuda_device_malloc_total" and s.labels["rank"] == "0"
        ]
        return value

    assert counter(after) < counter(before)


@pytest.mark.slow
def test_the_served_text_is_valid_exposition() -> None:
    run_text, node_text = measure_texts(8)
    fleet = Fleet(2, run_text, node_text, restart_s=7200)
    promtool = require_tool("promtool")
    for endpoint in ("run", "node"):
        text = fleet.render(1, endpoint, fleet.started + 30).decode()
        proc = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
        )
        # Lint notes on client_python's own families are fine; errors are not.
        assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_queries_are_sent_as_grafana_would() -> None:
    fleet = Fleet(2, *measure_texts(8), restart_s=7200)
    assert grafana_step(3 * 3600, 15) == 15 and grafana_step(24 * 3600, 15) == 87
    expr = 'sum(increase(x{cluster=~"$cluster", namespace=~"$namespace"}[$__range])) by (pod)'
    assert substitute(expr, fleet, 10800, 15, 15) == (
        'sum(increase(x{cluster=~".*", namespace=~".*"}[10800s])) by (pod)'
    )


def quiet_fleet_rule_test(
    fleet: Fleet, node: int, folder: Path
) -> subprocess.CompletedProcess[str]:
    """promtool's rule test of one node's texts held for 40 minutes: no alert may fire."""
    lines = []
    for endpoint, instance in (("run", f"node-{node}:8000"), ("node", f"node-{node}:9400")):
        text = fleet.render(node, endpoint, fleet.started + 30).decode()
        job = "gpumem-pods" if endpoint == "run" else "gpumem-node"
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = {**s.labels, "job": job, "instance": instance}
                body = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
                lines.append({"series": f"{s.name}{{{body}}}", "values": f"{s.value}x160"})
    names = [rule["alert"] for rule in alert_rules()]
    test = {
        "rule_files": [str(RULES / "alerts.yaml")],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": lines,
                "alert_rule_test": [
                    {"eval_time": "40m", "alertname": name, "exp_alerts": []} for name in names
                ],
            }
        ],
    }
    path = folder / "quiet_test.yaml"
    path.write_text(yaml.safe_dump(test))
    promtool = require_tool("promtool")
    return subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_quiet_nodes_hold_no_alert_and_alerting_nodes_do(tmp_path: Path) -> None:
    quiet = measure_texts(8, ticks=QUIET_TICKS)
    fleet = Fleet(4, *measure_texts(8), restart_s=7200, quiet=quiet, alerting_every=2)
    assert [fleet.alerting(n) for n in range(4)] == [True, False, True, False]
    assert fleet.render(1, "run", fleet.started + 30) != fleet.render(0, "run", fleet.started + 30)
    held = quiet_fleet_rule_test(fleet, 1, tmp_path)
    assert held.returncode == 0, held.stdout + held.stderr
    # The same check of an alerting node fails: it can tell the two apart.
    storm = quiet_fleet_rule_test(fleet, 0, tmp_path)
    assert storm.returncode != 0 and "GpuMemCacheGapHigh" in storm.stdout + storm.stderr


@pytest.mark.slow
def test_quiet_nodes_need_the_quiet_texts() -> None:
    """Else they would silently serve the alerting texts and the fleet would be a storm."""
    with pytest.raises(ValueError, match="quiet texts"):
        Fleet(4, *measure_texts(8), restart_s=7200, alerting_every=2)
