"""The Grafana dashboards in dashboards/*.json.

Structure: the JSON type-checks against @grafana/schema (Grafana's own TypeScript types for the
dashboard model and the core panel plugins; `npm ci --prefix tests/js`), with misspelt or
unknown keys rejected. Content, in plain Python: every panel queries through the `datasource`
variable, every query is non-empty, and every metric and label a query names is one the
exporter serves (docs/metrics.md) or a recording rule defines (deploy/prometheus/*.yaml).

Import: `__inputs` asks for the Prometheus data source (DS_PROMETHEUS), which lands in the
`datasource` variable; panels use the variable, so the Helm chart's copy, which Grafana's sidecar
loads without an import, works too. Alert panels link their runbooks through the
`runbook_url_base` variable. The `cluster` variable's default matches series without a `cluster`
label: checked against a real Prometheus scraping the demo, some series with the label and some
without. That every query returns data is tested in test_e2e_prometheus.py; use
iter_panel_queries() to get at the queries.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO_ROOT, require_tool
from tests.helpers import (
    free_port,
    iter_annotation_queries,
    iter_panel_queries,
    iter_panels,
    load_json,
    markdown_anchors,
    names_detail_family,
    needs_kubelet,
    run_tsc,
    short_rules,
    start_prometheus,
    stop_processes,
    wait_http,
)
from tests.helpers import prometheus_api as prometheus_get

DASHBOARDS_DIR = REPO_ROOT / "dashboards"
DASHBOARDS = sorted(DASHBOARDS_DIR.glob("*.json"))
METRICS_DOC = REPO_ROOT / "docs" / "metrics.md"
RULES_DIR = REPO_ROOT / "deploy" / "prometheus"
RUNBOOKS = REPO_ROOT / "docs" / "runbooks.md"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# The import input Grafana asks for, and where its answer goes: the datasource variable.
DS_INPUT = {
    "name": "DS_PROMETHEUS",
    "label": "Prometheus",
    "type": "datasource",
    "pluginId": "prometheus",
    "pluginName": "Prometheus",
}
RUNBOOK_LINK = re.compile(r"^\$\{runbook_url_base:raw\}#([a-z0-9-]+)$")
# Alerts no panel shows: GpuMemExporterDown is about `up`, which Prometheus records.
ALERTS_WITHOUT_PANEL = {"GpuMemExporterDown"}

# Series Prometheus makes itself, and client_python's process collector, which
# docs/metrics.md lists as `process_*`.
PROMETHEUS_BUILTIN_METRICS = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
# Labels that come from Prometheus and Kubernetes service discovery rather than the exporter:
# the PodMonitor/ServiceMonitor target labels, the chart's "node" relabeling and the usual
# external "cluster" label.
TARGET_LABELS = {
    "cluster",
    "namespace",
    "pod",
    "container",
    "instance",
    "job",
    "node",
    "service",
    "endpoint",
    "__name__",
}
# Grafana's built-in variables.
GRAFANA_VARIABLES = {
    "__interval",
    "__interval_ms",
    "__rate_interval",
    "__range",
    "__range_s",
    "__range_ms",
    "__url_time_range",
    "__data",
    "__field",
    "__series",
    "__value",
    "__dashboard",
    "__org",
    "__user",
    "timeFilter",
    "__from",
    "__to",
    "__all",  # the value of a variable's "All" option
}
PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
    "start",
    "end",
}


# --- walking a dashboard --------------------------------------------------------------------


def iter_variable_queries(path: Path) -> Iterator[tuple[str, str]]:
    """(variable name, query) for every query variable (label_values(...) and the like)."""
    for variable in load_json(path)["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        yield variable["name"], query["query"] if isinstance(query, dict) else query


def all_queries(path: Path) -> Iterator[tuple[str, str]]:
    yield from iter_panel_queries(path)
    yield from iter_annotation_queries(path)
    yield from iter_variable_queries(path)


# --- what the exporter serves ------------------------------------------------------------------


def _expand_braces(token: str) -> list[str]:
    """torch_cuda_pool_{allocated,reserved}_bytes -> the names it stands for."""
    match = re.search(r"\{([a-z0-9_,]+)\}", token)
    if not match or "," not in match.group(1):
        return [token]
    head, tail = token[: match.start()], token[match.end() :]
    return [
        name for part in match.group(1).split(",") for name in _expand_braces(head + part + tail)
    ]


def documented_metrics() -> tuple[set[str], set[str]]:
    """Metric names in docs/metrics.md, and the prefixes it documents with a wildcard."""
    names: set[str] = set()
    prefixes: set[str] = set()
    for code in re.findall(r"`([^`]+)`", METRICS_DOC.read_text()):
        token = code.strip()
        if re.fullmatch(r"[a-z_]+_\*", token):  # `process_*`
            prefixes.add(token[:-1])
            continue
        token = re.sub(r"\{[^{}]*\}$", "", token)  # `family{label,...}`: the labels
        for name in _expand_braces(token):  # `pool_{allocated,reserved}_bytes`
            if re.fullmatch(r"[a-z][a-z0-9_]*_[a-z0-9_]+", name):
                names.add(name)
    return names, prefixes


def documented_labels() -> set[str]:
    """Label names in docs/metrics.md: its Labels table and `family{label,...}` mentions."""
    text = METRICS_DOC.read_text()
    labels: set[str] = set()
    section = text.split("## Labels", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        if line.startswith("|"):
            labels.update(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    for code in re.findall(r"`([^`]+)`", text):
        match = re.search(r"[a-z]\{([^{}]*)\}$", code.strip())
        for part in match.group(1).split(",") if match else []:
            name = part.split("=")[0].strip()
            if re.fullmatch(r"[a-z_]+", name):
                labels.add(name)
    return labels


def recording_rules() -> set[str]:
    names: set[str] = set()
    for path in RULES_DIR.glob("*.yaml"):
        doc = yaml.safe_load(path.read_text())
        for group in (doc or {}).get("groups", []) if isinstance(doc, dict) else []:
            names.update(rule["record"] for rule in group.get("rules", []) if "record" in rule)
    return names


# --- reading PromQL, enough to find names ---------------------------------------------------------


def _strip_strings(expr: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (functions, keywords and labels left out)."""
    text = _strip_strings(expr)
    # Grafana's label_values(metric_selector, label): only the selector is PromQL.
    text = re.sub(r"label_values\((.*),\s*[A-Za-z_]\w*\s*\)", r"(\1)", text)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery selectors
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w:.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", text):
        word, call = match.group(1), match.group(2)
        if call or word.lower() in PROMQL_KEYWORDS:
            continue
        names.add(word)
    return names


def promql_label_names(expr: str) -> set[str]:
    """Label names in matchers and in by/without/on/ignoring/group_x clauses."""
    text = _strip_strings(expr)
    labels = set()
    for matchers in re.findall(r"\{([^}]*)\}", text):
        labels.update(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    for clause in re.findall(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text
    ):
        labels.update(name.strip() for name in clause.split(",") if name.strip())
    # label_values(metric, label)
    labels.update(re.findall(r"label_values\([^)]*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)", text))
    return labels


def grafana_variables(text: str) -> set[str]:
    return set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text))


# --- tests ----------------------------------------------------------------------------------------


def test_dashboards_exist() -> None:
    assert {p.name for p in DASHBOARDS} >= {"gpumem-pod.json", "gpumem-fleet.json"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_model(path: Path) -> None:
    dashboard = load_json(path)
    assert dashboard["uid"] and len(dashboard["uid"]) <= 40
    assert dashboard["title"]
    assert dashboard["schemaVersion"] >= 36, "Grafana 10/11 JSON model"
    assert dashboard.get("id") is None, "export for sharing: no instance-specific id"
    ids = [p["id"] for p in dashboard["panels"]] + [
        p["id"] for p in iter_panels(dashboard) if p not in dashboard["panels"]
    ]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_uids_are_unique() -> None:
    uids = [load_json(p)["uid"] for p in DASHBOARDS]
    assert len(uids) == len(set(uids))


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_no_external_resources(path: Path) -> None:
    """Dashboards must work where Grafana cannot reach the internet."""
    text = path.read_text()
    assert not re.search(r"https?://", text), "links and images must be relative"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_datasource_is_a_variable(path: Path) -> None:
    dashboard = load_json(path)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    datasource = variables["datasource"]
    assert datasource["type"] == "datasource"
    assert datasource["query"] == "prometheus"
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE, variable["name"]
    for panel in iter_panels(dashboard):
        assert panel.get("datasource") == DATASOURCE, panel.get("title")
        for target in panel.get("targets", []):
            assert target.get("datasource", DATASOURCE) == DATASOURCE, panel.get("title")
    for annotation in dashboard["annotations"]["list"]:
        if not annotation.get("builtIn"):
            assert annotation["datasource"] == DATASOURCE, annotation["name"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_has_queries(path: Path) -> None:
    for panel in iter_panels(load_json(path)):
        targets = panel.get("targets", [])
        assert targets, f"{panel.get('title')}: no queries"
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), f"{panel.get('title')}: duplicate refId"
        for target in targets:
            assert target.get("expr", "").strip(), f"{panel.get('title')}: empty query"
    for name, expr in list(iter_annotation_queries(path)) + list(iter_variable_queries(path)):
        assert expr.strip(), f"{name}: empty query"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_queries_are_balanced(path: Path) -> None:
    pairs = {")": "(", "]": "[", "}": "{"}
    for title, expr in all_queries(path):
        stack: list[str] = []
        for char in _strip_strings(expr):
            if char in "([{":
                stack.append(char)
            elif char in pairs:
                assert stack and stack.pop() == pairs[char], f"{title}: unbalanced {expr}"
        assert not stack, f"{title}: unbalanced {expr}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_metric_names_exist(path: Path) -> None:
    documented, prefixes = documented_metrics()
    known = documented | recording_rules() | PROMETHEUS_BUILTIN_METRICS
    unknown = {
        (title, name)
        for title, expr in all_queries(path)
        for name in promql_metric_names(expr)
        if name not in known and not any(name.startswith(p) for p in prefixes)
    }
    assert not unknown, f"metrics in neither docs/metrics.md nor the recording rules: {unknown}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_label_names_exist(path: Path) -> None:
    known = documented_labels() | TARGET_LABELS
    unknown = {
        (title, label)
        for title, expr in all_queries(path)
        for label in promql_label_names(expr)
        if label not in known
    }
    assert not unknown, f"labels the exporter does not serve: {unknown}"
    dashboard = load_json(path)
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []):
            for label in re.findall(
                r"\{\{\s*([a-zA-Z_]\w*)\s*\}\}", target.get("legendFormat", "")
            ):
                assert label in known, f"{panel['title']}: legend uses unknown label {label}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_template_variables_are_defined(path: Path) -> None:
    dashboard = load_json(path)
    defined = {v["name"] for v in dashboard["templating"]["list"]} | GRAFANA_VARIABLES
    defined |= {i["name"] for i in dashboard["__inputs"]}
    used = grafana_variables(json.dumps(dashboard["panels"]))
    used |= grafana_variables(json.dumps(dashboard["annotations"]))
    used |= grafana_variables(json.dumps(dashboard["templating"]))
    assert used - defined == set()


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panels_of_detail_families_say_so(path: Path) -> None:
    """A panel reading a family served only at GPUMEM_DETAIL=full tells the user, who would
    otherwise find it empty at the default level; the fleet dashboard reads none."""
    unsaid = []
    for panel in iter_panels(load_json(path)):
        exprs = [t.get("expr", "") for t in panel.get("targets", [])]
        # A server's endpoint (embedded, run); the node daemon's families where only it
        # serves them (host_process_* is the server's at every level).
        if any(
            names_detail_family(e, "embedded")
            or names_detail_family(e, "run")
            or names_detail_family(e, "node", only=True)
            for e in exprs
        ):
            if "GPUMEM_DETAIL=full" not in panel.get("description", ""):
                unsaid.append(panel.get("title"))
            assert path.name != "gpumem-fleet.json", panel.get("title")
    assert unsaid == []


def test_pod_dashboard_content() -> None:
    path = DASHBOARDS_DIR / "gpumem-pod.json"
    dashboard = load_json(path)
    variables = [v["name"] for v in dashboard["templating"]["list"]]
    assert variables == ["datasource", "cluster", "namespace", "pod", "device", "runbook_url_base"]
    panels = {p["title"]: p for p in iter_panels(dashboard)}

    # The reserved-vs-allocated gap at a glance: one stacked panel per GPU.
    breakdown = next(p for t, p in panels.items() if t.startswith("GPU memory breakdown"))
    assert breakdown["repeat"] == "device"
    assert breakdown["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    legends = [t["legendFormat"] for t in breakdown["targets"]]
    assert legends[:5] == [
        "allocated",
        "cached free (reserved − allocated)",
        "non-allocator (CUDA context, NCCL, libraries)",
        "other processes + driver reserved",
        "free",
    ]
    exprs = " ".join(expr for _, expr in iter_panel_queries(path))
    for metric in (
        "torch_cuda_fragmentation_ratio",
        "torch_cuda_alloc_retries_total",
        "torch_cuda_ooms_total",
        "torch_cuda_allocated_peak_bytes",
        "torch_cuda_reserved_peak_bytes",
        "gpu_process_memory_used_bytes",
        "process_resident_memory_bytes",
        "host_swap_used_bytes",
        "gpumem_exporter_source_up",
        "gpumem_exporter_last_sample_timestamp_seconds",
    ):
        assert metric in exprs, f"the pod dashboard shows no {metric}"
    annotations = " ".join(expr for _, expr in iter_annotation_queries(path))
    assert "torch_cuda_ooms_total" in annotations
    assert "torch_cuda_alloc_retries_total" in annotations


def test_fleet_dashboard_content() -> None:
    path = DASHBOARDS_DIR / "gpumem-fleet.json"
    dashboard = load_json(path)
    assert [v["name"] for v in dashboard["templating"]["list"]][:2] == ["datasource", "cluster"]
    queries = dict(iter_panel_queries(path))
    titles = set(queries)
    assert {
        "Highest fragmentation",
        "Least headroom",
        "OOMs by pod",
        "Allocation retries by pod",
        "GPUs nearest exhaustion",
    } <= titles
    assert "topk" in queries["Highest fragmentation"]
    assert "bottomk" in queries["Least headroom"]


def test_iter_panel_queries_keeps_variables() -> None:
    queries = list(iter_panel_queries(DASHBOARDS_DIR / "gpumem-pod.json"))
    assert queries
    assert all(title and expr for title, expr in queries)
    assert any("$__rate_interval" in expr for _, expr in queries)
    assert any('pod="$pod"' in expr for _, expr in queries)


def test_promql_name_extraction() -> None:
    expr = (
        'sum by (gpu_uuid) (rate(torch_cuda_ooms_total{pod="$pod", job=~"a|b"}[5m]))'
        " / on (gpu_uuid) group_left max by (gpu_uuid) (gpu_memory_total_bytes)"
        " and topk(3, x:y:sum) > bool 0 or vector(0) unless up offset 5m"
    )
    assert promql_metric_names('label_values(gpu_info{node="$node"}, gpu_uuid)') == {"gpu_info"}
    assert promql_metric_names(expr) == {
        "torch_cuda_ooms_total",
        "gpu_memory_total_bytes",
        "x:y:sum",
        "up",
    }
    assert promql_label_names(expr) == {"gpu_uuid", "pod", "job"}


def test_documented_names_are_read() -> None:
    names, prefixes = documented_metrics()
    assert {
        "torch_cuda_reserved_bytes",
        "torch_cuda_pool_inactive_split_bytes",
        "gpu_memory_free_bytes",
        "gpumem_exporter_build_info",
    } <= names
    assert "process_" in prefixes
    assert {"device", "gpu_uuid", "gpu", "pool", "pid", "source", "backend", "mode"} <= (
        documented_labels()
    )


@pytest.mark.slow
def test_schema_types(tmp_path: Path) -> None:
    """Every dashboard type-checks against @grafana/schema (tests/js/types/dashboard.ts)."""
    sources = {}
    for path in DASHBOARDS:
        sources[path.stem + ".ts"] = (
            'import type { StrictDashboard } from "./types/dashboard.js";\n'
            f"export const dashboard: StrictDashboard = {path.read_text()};\n"
        )
    output = run_tsc(tmp_path, sources)
    assert output == "", output


# --- import: the data source input maps onto the datasource variable ----------------------------


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_import_asks_for_the_data_source(path: Path) -> None:
    dashboard = load_json(path)
    assert [{k: v for k, v in i.items() if k != "description"} for i in dashboard["__inputs"]] == [
        DS_INPUT
    ]
    # Grafana's import writes the chosen data source over ${DS_PROMETHEUS}: the variable's
    # current value is the only place it may stand, so that panels keep using the variable
    # (which is what makes the sidecar's copy, never imported, work).
    variable = next(v for v in dashboard["templating"]["list"] if v["type"] == "datasource")
    assert variable["name"] == "datasource"
    assert variable["current"]["value"] == "${DS_PROMETHEUS}"
    rest = dict(
        dashboard,
        templating={"list": [v for v in dashboard["templating"]["list"] if v is not variable]},
    )
    assert "DS_PROMETHEUS}" not in json.dumps(rest)
    requires = {(r["type"], r["id"]) for r in dashboard["__requires"]}
    panel_types = {p["type"] for p in iter_panels(dashboard)}
    assert requires == {("grafana", "grafana"), ("datasource", "prometheus")} | {
        ("panel", t) for t in panel_types
    }


# --- runbook links ----------------------------------------------------------------------------


def alert_names() -> set[str]:
    return {
        rule["alert"]
        for group in yaml.safe_load((RULES_DIR / "alerts.yaml").read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }


def runbook_links(panel: dict[str, Any]) -> list[dict[str, Any]]:
    return [link for link in panel.get("links", []) if link["title"].startswith("Runbook")]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_alert_panels_link_their_runbooks(path: Path) -> None:
    anchors = markdown_anchors(RUNBOOKS.read_text(encoding="utf-8"))
    alerts = {name.lower(): name for name in alert_names()}
    dashboard = load_json(path)
    base = next(v for v in dashboard["templating"]["list"] if v["name"] == "runbook_url_base")
    # No URL ships: the base is the user's (or the chart's runbookUrlBase).
    assert base["type"] == "textbox" and base["query"] == ""
    linking = 0
    for panel in iter_panels(dashboard):
        linked = set()
        for link in runbook_links(panel):
            match = RUNBOOK_LINK.match(link["url"])
            assert match, f"{panel['title']}: {link['url']}"
            anchor = match.group(1)
            assert anchor in anchors, f"{panel['title']}: no #{anchor} in docs/runbooks.md"
            assert link["title"] == f"Runbook: {alerts[anchor]}"
            assert link.get("targetBlank") is True
            # Where to look while the base is empty.
            assert f"docs/runbooks.md#{anchor}" in panel["description"], panel["title"]
            linked.add(alerts[anchor])
        description = panel.get("description", "")
        named = {name for name in alerts.values() if name in description}
        named |= {alerts[a] for a in re.findall(r"docs/runbooks\.md#([a-z0-9-]+)", description)}
        assert named <= linked, f"{panel['title']} names {named - linked} without a runbook link"
        linking += bool(linked)
    assert linking >= 5


def test_every_alert_has_a_runbook_link() -> None:
    linked = {
        link["title"].removeprefix("Runbook: ")
        for path in DASHBOARDS
        for panel in iter_panels(load_json(path))
        for link in runbook_links(panel)
    }
    assert alert_names() - linked == ALERTS_WITHOUT_PANEL


# --- cluster: works with and without the label -------------------------------------------------


def cluster_matchers(expr: str) -> list[str]:
    return re.findall(r'cluster\s*(?:=~|!~|!=|=)\s*"[^"]*"', expr)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_cluster_is_matched_by_the_variable_regex(path: Path) -> None:
    variable = next(v for v in load_json(path)["templating"]["list"] if v["name"] == "cluster")
    assert variable["includeAll"] is True
    assert variable["current"]["value"] == "$__all"
    for title, expr in all_queries(path):
        if title == "cluster":
            continue
        assert set(cluster_matchers(expr)) == {'cluster=~"$cluster"'}, f"{title}: {expr}"


class PrometheusAPI:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        return prometheus_get(self.url, path, **params)


# Two scrape jobs on one demo exporter: one adds a cluster label (a relabeled or federated
# cluster), the other does not (a single Prometheus without one). Namespaces differ so that a
# filter dropping either is visible.
PLAIN = {"namespace": "plain", "pod": "plain-0"}
# At the full detail level, so that every panel has data (the e2e test runs the default level).
DEMO = [
    *(sys.executable, "-m", "exporter.cli", "demo", "--speed", "3", "--interval-s", "0.5"),
    *("--detail", "full"),
]
LABELLED = {"cluster": "east", "namespace": "east", "pod": "east-0"}


@pytest.fixture(scope="module")
def mixed_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusAPI]:
    prometheus = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("cluster")
    exporter_port, prometheus_port = free_port(), free_port()
    target = [f"127.0.0.1:{exporter_port}"]
    config = {
        # The recording rules the dashboards read, evaluated every second.
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": short_rules(tmp),
        "scrape_configs": [
            {"job_name": "gpumem-plain", "static_configs": [{"targets": target, "labels": PLAIN}]},
            {
                "job_name": "gpumem-east",
                "static_configs": [{"targets": target, "labels": LABELLED}],
            },
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    procs = [
        subprocess.Popen(
            [*DEMO, "--port", str(exporter_port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
        start_prometheus(prometheus, tmp, prometheus_port),
    ]
    try:
        wait_http(f"http://127.0.0.1:{exporter_port}/readyz", procs[0])
        wait_http(f"http://127.0.0.1:{prometheus_port}/-/ready", procs[1])
        prometheus_api = PrometheusAPI(f"http://127.0.0.1:{prometheus_port}")
        # Both jobs scraped a few times, so that rate() over 30 s has two samples.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            counts = prometheus_api.get(
                "query", query="count_over_time(gpumem_exporter_build_info[30s])"
            )
            # ... and the demo has reached its CUDA-graph phase (45 s into the trace, 15 s at
            # 3x), so that the private-pool panel has data.
            pools = prometheus_api.get("query", query="torch_cuda_private_pool_reserved_bytes")
            # ... and its OOM (55 s in, 18 s at 3x), whose verdict is a series from then on.
            verdicts = prometheus_api.get(
                "query", query="count_over_time(torch_cuda_ooms_by_verdict_total[30s]) >= 4"
            )
            if (
                len(counts["result"]) == 2
                and all(float(r["value"][1]) >= 4 for r in counts["result"])
                and pools["result"]
                and len(verdicts["result"]) == 2
            ):
                break
            time.sleep(0.5)
        else:
            raise AssertionError("Prometheus did not scrape both jobs through the demo's OOM")
        yield prometheus_api
    finally:
        stop_processes(procs)


def grafana_default(variable: dict[str, Any], values: list[str]) -> str:
    """What Grafana substitutes for a single-value query variable left at its default."""
    if variable.get("includeAll") and variable.get("current", {}).get("value") in (None, "$__all"):
        # "All": the custom all value, else a regex of every value.
        return variable.get("allValue") or "(" + "|".join(re.escape(v) for v in values) + ")"
    return sorted(values)[0] if values else ""


def _substitute(expr: str, values: dict[str, str]) -> str:
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    assert "$" not in expr, expr
    return expr


PROBLEM_FILTER = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*[0-9.]+\s*$")


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_queries_see_series_without_a_cluster_label(
    mixed_prometheus: PrometheusAPI, path: Path
) -> None:
    """At its default, $cluster filters nothing: every query returns what it returns with no
    cluster matcher at all, also for the series that have no cluster label."""
    api = mixed_prometheus
    dashboard = load_json(path)
    variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "cluster")
    selector = re.fullmatch(r"label_values\((.*),\s*cluster\)", variable["query"]["query"])
    assert selector, variable["query"]
    clusters = api.get("label/cluster/values", **{"match[]": selector.group(1)})
    assert clusters == ["east"], "series without the label must not add a value"
    values = {
        "cluster": grafana_default(variable, clusters),
        "namespace": PLAIN["namespace"],
        "pod": PLAIN["pod"],
        "device": "0",
        "__rate_interval": "30s",
        "__range": "5m",
    }
    now = time.time()

    def run(expr: str) -> list[Any]:
        data = api.get("query_range", query=expr, start=str(now - 20), end=str(now), step="2")
        return sorted(data["result"], key=lambda series: json.dumps(series["metric"]))

    def without_cluster(expr: str) -> str:
        return re.sub(r'cluster=~"\$cluster"\s*,?\s*', "", expr)

    for title, expr in [*iter_panel_queries(path), *iter_annotation_queries(path)]:
        if needs_kubelet(expr):
            continue  # no kubelet in the demo: tests/e2e/test_e2e_kubernetes.py
        unfiltered = run(_substitute(without_cluster(expr), values))
        if not unfiltered and PROBLEM_FILTER.search(expr):
            # A problems-only query (`... == 0`) is rightly empty on the healthy demo.
            expr = PROBLEM_FILTER.sub("", expr)
            unfiltered = run(_substitute(without_cluster(expr), values))
        assert unfiltered, f"{title}: no data for the pod without a cluster label: {expr}"
        assert run(_substitute(expr, values)) == unfiltered, f"{title}: {expr}"
    for name, query in iter_variable_queries(path):
        match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query)
        assert match, f"{name}: {query}"
        label = match.group(2)
        got = api.get(f"label/{label}/values", **{"match[]": _substitute(match.group(1), values)})
        plain = api.get(
            f"label/{label}/values",
            **{"match[]": _substitute(without_cluster(match.group(1)), values) or "{}"},
        )
        assert got == plain, f"variable {name}: {query}"
