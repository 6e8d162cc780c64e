"""End to end with a real Prometheus server (Debian package `prometheus`).

Prometheus scrapes `gpumem-exporter demo` replaying the incident recorded on an H200
(fragmentation climb, allocation retries, OOMs) at 3x speed, evaluates deploy/prometheus/ rules
every second, and we check:
- the expected alerts reach firing in /api/v1/alerts, and the in-process detectors fire on the
  same data (gpumem_exporter_alert_firing as scraped);
- every dashboard panel, annotation and variable query returns data.

The rules' `for:` durations (5 to 30 minutes) are shortened to 3 s in a copy, since the trace
lasts 2.5 minutes; the durations themselves are covered by promtool's unit tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.conftest import REPO_ROOT
from tests.helpers import (
    free_port,
    iter_annotation_queries,
    iter_panel_queries,
    names_detail_family,
    needs_kubelet,
    prometheus_api,
    prometheus_server,
    start_prometheus,
    stop_processes,
    wait_http,
    write_prometheus_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TARGET_LABELS = {"cluster": "e2e", "namespace": "demo", "pod": "demo-0"}
# The recorded server retries allocations and runs out of memory under its cap; its
# fragmentation (a fifth of reserved at most) stays under GpuMemFragmentationHigh's 0.3.
EXPECTED_FIRING = {"GpuMemAllocRetries", "GpuMemOutOfMemory", "GpuMemOomFragmentation"}
EXPECTED_QUIET = {
    "GpuMemHeadroomLow",
    "HostMemoryPressure",
    "HostSwapGrowing",
    "HostMemoryHeldByProcess",
    "GpuMemExporterDown",
    "GpuMemExporterStale",
    "GpuMemExporterSourceFailing",
    "GpuMemoryHeldOutsideAnyPod",
    "GpuNodeDaemonBlind",
    "GpuMemKubeletUnreachable",
}


@dataclass
class Stack:
    prometheus: str
    exporter: str

    def api(self, path: str, **params: str) -> dict:
        data: dict = prometheus_api(self.prometheus, path, **params)
        return data


@pytest.fixture(scope="module", params=[2, 3], ids=["prometheus2", "prometheus3"])
def stack(request, tmp_path_factory) -> Iterator[Stack]:
    """The whole chain under Prometheus 2 (Debian's 2.42) and 3 (Debian sid's 3.5): 3.0
    changed what a range selects, which the rules and dashboards must not depend on."""
    prometheus = prometheus_server(request.param)
    tmp = tmp_path_factory.mktemp("e2e")
    exporter_port, prometheus_port = free_port(), free_port()
    env = dict(
        os.environ, GPUMEM_DETECT_FRAGMENTATION_FOR_S="3", GPUMEM_DETECT_COUNTER_WINDOW_S="60"
    )
    exporter = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exporter.cli",
            "demo",
            "--speed",
            "3",
            "--interval-s",
            "0.5",
            "--port",
            str(exporter_port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    write_prometheus_config(tmp, "gpumem-demo", exporter_port, TARGET_LABELS)
    server = start_prometheus(prometheus, tmp, prometheus_port)
    try:
        wait_http(f"http://127.0.0.1:{exporter_port}/readyz", exporter)
        wait_http(f"http://127.0.0.1:{prometheus_port}/-/ready", server)
        yield Stack(f"http://127.0.0.1:{prometheus_port}", f"http://127.0.0.1:{exporter_port}")
    finally:
        stop_processes((server, exporter))
        shutil.rmtree(tmp, ignore_errors=True)


def _firing(stack: Stack) -> set[str]:
    return {
        a["labels"]["alertname"] for a in stack.api("alerts")["alerts"] if a["state"] == "firing"
    }


def test_the_recorded_incident_fires_the_expected_alerts(stack):
    seen: set[str] = set()
    labels: dict[str, dict] = {}
    deadline = time.monotonic() + 180  # a loop of the trace at 3x lasts ~74 s
    while time.monotonic() < deadline and not seen >= EXPECTED_FIRING:
        for alert in stack.api("alerts")["alerts"]:
            if alert["state"] == "firing":
                seen.add(alert["labels"]["alertname"])
                labels[alert["labels"]["alertname"]] = alert
        time.sleep(1)
    assert seen >= EXPECTED_FIRING, f"fired: {sorted(seen)}"
    assert not EXPECTED_QUIET & seen, f"fired: {sorted(seen)}"
    oom = labels["GpuMemOutOfMemory"]
    assert oom["labels"]["severity"] == "critical"
    assert oom["labels"]["pod"] == "demo-0" and oom["labels"]["device"] == "0"
    # No base configured (the plain rule files): the section to read, no link to nowhere.
    assert oom["annotations"]["runbook"] == "docs/runbooks.md#gpumemoutofmemory"
    assert "demo/demo-0" in oom["annotations"]["description"]


def test_in_process_detectors_fire_on_the_same_data(stack):
    deadline = time.monotonic() + 120
    fired: set[str] = set()
    while time.monotonic() < deadline and not fired >= EXPECTED_FIRING:
        result = stack.api("query", query="max_over_time(gpumem_exporter_alert_firing[5m]) == 1")
        fired = {r["metric"]["alert"] for r in result["result"]}
        time.sleep(1)
    assert fired >= EXPECTED_FIRING, f"in-process detectors fired: {sorted(fired)}"
    assert not {"GpuMemHeadroomLow", "HostMemoryPressure"} & fired


VARIABLES = {
    "$__rate_interval": "30s",
    "$__range": "5m",
    "$cluster": TARGET_LABELS["cluster"],
    "$namespace": TARGET_LABELS["namespace"],
    "$pod": TARGET_LABELS["pod"],
    "$device": "0",
}


def substitute(expr: str) -> str:
    for name in sorted(VARIABLES, key=len, reverse=True):
        expr = expr.replace("${" + name[1:] + "}", VARIABLES[name]).replace(name, VARIABLES[name])
    assert "$" not in expr, expr
    return expr


PROBLEM_FILTER = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*[0-9.]+\s*$")


def dashboard_queries() -> list[tuple[str, str, str]]:
    queries = []
    for path in sorted((REPO_ROOT / "dashboards").glob("*.json")):
        for title, expr in [*iter_panel_queries(path), *iter_annotation_queries(path)]:
            queries.append((path.stem, title, expr))
    return queries


def test_every_dashboard_query_returns_data(stack):
    # Let the trace play through its incident once so that rates and increases have data,
    # the OOM's verdict (a series from the OOM on) included.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        result = stack.api("query", query="increase(torch_cuda_ooms_total[1m]) > 0")
        verdicts = stack.api(
            "query", query="count_over_time(torch_cuda_ooms_by_verdict_total[1m]) >= 3"
        )
        if result["result"] and verdicts["result"]:
            break
        time.sleep(1)
    now = time.time()

    def has_data(expr: str) -> bool:
        data = stack.api(
            "query_range", query=substitute(expr), start=str(now - 120), end=str(now), step="2"
        )
        return any(series["values"] for series in data["result"])

    empty = []
    for dashboard, title, expr in dashboard_queries():
        if needs_kubelet(expr):
            continue  # no kubelet in the demo: tests/e2e/test_e2e_kubernetes.py
        if has_data(expr):
            continue
        if names_detail_family(expr, "demo"):
            continue  # served at GPUMEM_DETAIL=full; the demo runs at the default level
        # A "problems only" panel (e.g. `... == 0` for failing sources) is rightly empty on a
        # healthy demo: then what it filters must have data.
        unfiltered = PROBLEM_FILTER.sub("", expr)
        if unfiltered != expr and has_data(unfiltered):
            continue
        empty.append(f"{dashboard}: {title}: {expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_every_dashboard_variable_has_values(stack):
    for path in sorted((REPO_ROOT / "dashboards").glob("*.json")):
        for variable in json.loads(path.read_text())["templating"]["list"]:
            if variable["type"] != "query":
                continue
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", substitute(query))
            assert match, f"{path.name}: unsupported variable query {query}"
            values = stack.api(f"label/{match.group(2)}/values", **{"match[]": match.group(1)})
            assert values, f"{path.name}: variable {variable['name']} has no values"
