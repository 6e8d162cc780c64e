"""Past one Prometheus: the fleet on Prometheus shards writing to VictoriaMetrics, the global
rule tier on vmalert, compared answer by answer with one Prometheus (issue 40).

One command brings up, beside bench.fleet's generator (N nodes, each a TP=8 server under
`gpumem-exporter run` and its node daemon, shaped exactly like the exporter's own):

- one Prometheus scraping every target with every rule file (the default deployment);
- S Prometheus shards, each keeping the targets of its nodes (`hashmod` of the `node` label),
  evaluating the node tier (recording.yaml, alerts.yaml) and remote-writing everything to
- VictoriaMetrics (single node), the horizontally scaled store's stand-in (Debian
  `victoria-metrics`), queried through its Prometheus API, and
- vmalert evaluating the global tier (recording-global.yaml) against VictoriaMetrics and
  writing its results back there.

Then, at one moment, it compares every recorded series (both tiers), every alert's state and
every dashboard query's answer of the sharded setup (read from VictoriaMetrics) with one
Prometheus's, and measures what each component costs. Values move once per tick (--tick-s),
and the comparison is made late in a tick, once both setups have scraped it and evaluated
their rules on it: an answer matches if it equals the single Prometheus's within one
evaluation (at the same moment, or one interval before or after).

    python -m bench.scaleout --nodes 100 --shards 2 --warmup-s 300 --out scaleout.json

Needs `prometheus`, `victoria-metrics` and `vmalert` (apt-get install prometheus
victoria-metrics); no GPU. tests/deploy/test_scaleout.py runs a small one in CI.
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.common import free_ports, write_json
from bench.fleet import (
    DASHBOARDS,
    GPUS,
    RULES,
    Fleet,
    Prometheus,
    Service,
    add_alerting_every,
    demo_fleet,
    panel_queries,
    prometheus_config,
    rule_times,
    serve,
    substitute,
    time_alert_expressions,
    time_queries,
)

GLOBAL_TIER = sorted(RULES.glob("*-global.yaml"))
NODE_TIER = sorted(set(RULES.glob("*.yaml")) - set(GLOBAL_TIER))
Labels = frozenset[tuple[str, str]]


def shard_relabeling(shard: int, shards: int) -> list[dict[str, Any]]:
    """Keep the targets of this shard's nodes: every target of a node lands on one shard,
    which is what makes the node tier exact there."""
    return [
        {
            "source_labels": ["node"],
            "modulus": shards,
            "target_label": "__tmp_shard",
            "action": "hashmod",
        },
        {"source_labels": ["__tmp_shard"], "regex": str(shard), "action": "keep"},
    ]


class VictoriaMetrics(Service):
    def __init__(self, folder: Path, port: int) -> None:
        argv = [
            "victoria-metrics",
            f"-storageDataPath={folder / 'vm'}",
            f"-httpListenAddr=127.0.0.1:{port}",
            "-retentionPeriod=1d",
            # Answer with the newest samples: the default hides the last 30 s from queries.
            "-search.latencyOffset=0s",
            "-loggerLevel=ERROR",
        ]
        super().__init__("victoria-metrics", argv, port, "/health", folder)

    def api(self, path: str, timeout: float = 150, **params: Any) -> Any:
        # No answer from the rollup cache: every comparison reads the stored samples.
        return super().api(path, timeout, nocache="1", **params)

    def series_count(self) -> int:
        return int(self.api("series/count")[0])


class VmAlert(Service):
    def __init__(
        self, folder: Path, port: int, store: str, rules: list[Path], interval_s: int
    ) -> None:
        for path in rules:
            shutil.copy(path, folder / path.name)
        argv = [
            "vmalert",
            *[f"-rule={folder / path.name}" for path in rules],
            f"-datasource.url={store}",
            f"-remoteWrite.url={store}",
            f"-evaluationInterval={interval_s}s",
            "-remoteWrite.flushInterval=1s",
            f"-httpListenAddr=127.0.0.1:{port}",
            "-loggerLevel=ERROR",
        ]
        super().__init__("vmalert", argv, port, "/health", folder)

    def group_times(self) -> dict[str, float]:
        """Each group's mean evaluation time in seconds so far (vmalert's own metrics)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vmalert_iteration_duration_seconds_sum":
                    sums[sample.labels["group"]] = sample.value
                elif sample.name == "vmalert_iteration_duration_seconds_count":
                    counts[sample.labels["group"]] = sample.value
        return {group: sums[group] / n for group, n in counts.items() if n and group in sums}


@dataclass
class Sharded:
    shards: list[Prometheus]
    store: VictoriaMetrics
    ruler: VmAlert

    @property
    def services(self) -> list[Service]:
        return [*self.shards, self.store, self.ruler]


def start_sharded(
    stack: ExitStack,
    fleet: Fleet,
    fleet_port: int,
    shards: int,
    scrape_s: int,
    folder: Path,
    node_tier: list[Path],
) -> Sharded:
    store_port, ruler_port, *shard_ports = free_ports(2 + shards)
    (folder / "store").mkdir(parents=True)
    store = VictoriaMetrics(folder / "store", store_port)
    stack.callback(store.stop)
    write = {
        "url": f"{store.url}/api/v1/write",
        # Small batches sent often: the comparison reads the store a few intervals after a
        # scrape.
        "queue_config": {"batch_send_deadline": "1s"},
    }
    members = []
    for shard, port in enumerate(shard_ports):
        home = folder / f"shard-{shard}"
        config = prometheus_config(
            fleet,
            fleet_port,
            scrape_s,
            home,
            rule_files=node_tier,
            relabel=shard_relabeling(shard, shards),
            own_port=port,
        )
        config["remote_write"] = [write]
        # Started together with the single Prometheus and waited for after (run): alerts that
        # wait for history (`offset 10m`) change state at the same moment in both setups.
        member = Prometheus(home, config, port, name=f"shard-{shard}", wait=False)
        stack.callback(member.stop)
        members.append(member)
    (folder / "ruler").mkdir()
    ruler = VmAlert(folder / "ruler", ruler_port, store.url, GLOBAL_TIER, scrape_s)
    stack.callback(ruler.stop)
    return Sharded(members, store, ruler)


# -- the comparison ----------------------------------------------------------------------------


def answer(server: Service, query: str, at: float) -> dict[Labels, float]:
    data = server.api("query", query=query, time=f"{at:.3f}")
    if data["resultType"] == "scalar":
        return {frozenset(): float(data["result"][1])}
    return {frozenset(item["metric"].items()): float(item["value"][1]) for item in data["result"]}


@dataclass(frozen=True)
class Tolerance:
    """How far two answers may be apart: `absolute` for clocks (each setup scrapes at its own
    moment); `relative` for increase() over a window, which Prometheus extrapolates from the
    samples inside it, so two servers evaluating at different moments of a scrape interval
    differ by up to one interval's share of the window; `ranked` for topk and bottomk, where
    equal values tie and either engine may pick any of them (the values are compared)."""

    absolute: float = 0.0
    relative: float = 1e-9
    ranked: bool = False


EXACT = Tolerance()


def same(a: float, b: float, tolerance: Tolerance) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= max(tolerance.absolute, tolerance.relative * max(abs(a), abs(b)))


def differences(
    sharded: dict[Labels, float], single: list[dict[Labels, float]], tolerance: Tolerance = EXACT
) -> list[str]:
    """What the sharded answer has that none of the single Prometheus's answers (one
    evaluation before, at, after) has: a series missing or extra, or a value that differs."""
    if tolerance.ranked:
        ours = sorted(sharded.values())
        for theirs in single:
            pairs = zip(ours, sorted(theirs.values()), strict=False)
            if len(theirs) == len(ours) and all(same(a, b, tolerance) for a, b in pairs):
                return []
        return [f"ranked values {ours[:5]} vs {sorted(single[1].values())[:5]}"]
    found = []
    if not any(sharded.keys() == s.keys() for s in single):
        missing = set(single[1]) - set(sharded)
        extra = set(sharded) - set(single[1])
        found += [f"missing {dict(sorted(m))}" for m in sorted(missing, key=sorted)[:3]]
        found += [f"extra {dict(sorted(e))}" for e in sorted(extra, key=sorted)[:3]]
    for labels, value in sharded.items():
        seen = [s[labels] for s in single if labels in s]
        if seen and not any(same(value, v, tolerance) for v in seen):
            found.append(f"{dict(sorted(labels))}: {value} vs {seen}")
    return found[:6]


# PromQL functions over a window of a counter's samples, and the records made of them.
_RAW_WINDOWED = re.compile(r"\b(increase|rate)\(")
_WINDOWED = re.compile(rf"{_RAW_WINDOWED.pattern}|:increase5m\b|:rate5m\b")


def comparisons(
    fleet: Fleet, scrape_s: int, rule_files: list[Path]
) -> list[tuple[str, str, str, Tolerance]]:
    """(what, name, PromQL, tolerance) of everything compared: each recorded series of both
    tiers, the alerts' states, each dashboard query as an instant query. `what` is
    "recorded", "alerts", "dashboard", or "engine" for a dashboard query that applies rate()
    or increase() to raw counters: the store's query engine answers it by its own rules
    (MetricsQL's differ from Prometheus's; Thanos and Mimir run Prometheus's), so it is
    reported beside the comparison, not counted in it."""
    windowed = Tolerance(relative=scrape_s / 300)  # the rules' windows are 5 minutes
    found = []
    records = {}
    for path in rule_files:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "record" in rule:
                    records[rule["record"]] = rule["expr"]
    for name, expr in records.items():
        found.append(("recorded", name, name, windowed if _WINDOWED.search(expr) else EXACT))
    found.append(("alerts", "ALERTS", "ALERTS", EXACT))
    for path in sorted(DASHBOARDS.glob("*.json")):
        for title, expr, _ in panel_queries(path):
            query = substitute(expr, fleet, 3600, scrape_s, scrape_s)
            what = "engine" if _RAW_WINDOWED.search(expr) else "dashboard"
            tolerance = Tolerance(
                # A sample's age is the scrape's moment: the setups scrape at their own.
                absolute=2.0 * scrape_s if "_timestamp_seconds" in expr else 0.0,
                relative=windowed.relative if _WINDOWED.search(expr) else EXACT.relative,
                ranked=bool(re.search(r"\b(topk|bottomk)\(", expr)),
            )
            found.append((what, f"{path.stem}: {title}", query, tolerance))
    return found


def compare(
    single: Prometheus,
    store: VictoriaMetrics,
    fleet: Fleet,
    scrape_s: int,
    at: float,
    rule_files: list[Path],
) -> dict[str, Any]:
    rows = []
    for what, name, query, tolerance in comparisons(fleet, scrape_s, rule_files):
        ours = answer(store, query, at)
        theirs = [answer(single, query, at + shift * scrape_s) for shift in (-1, 0, 1)]
        rows.append(
            {
                "what": what,
                "name": name,
                "series": len(theirs[1]),
                "differences": differences(ours, theirs, tolerance),
            }
        )
    return {
        "at": at,
        "compared": len(rows),
        "series": sum(r["series"] for r in rows),
        "rows": rows,
        "mismatches": [r for r in rows if r["differences"] and r["what"] != "engine"],
        "engine_differences": [r for r in rows if r["differences"] and r["what"] == "engine"],
    }


def settled_moment(tick_s: int, settle_s: float) -> float:
    """A moment late in the current tick (or the next), once both setups have scraped the
    tick's values and evaluated both tiers on them. The caller waits until one interval after
    it has passed: the single Prometheus is also asked one interval later."""
    now = time.time()
    start = now - now % tick_s
    if now - start > tick_s - 1:
        start += tick_s
    at = max(start + settle_s, now)
    if at > start + tick_s - 1:
        raise SystemExit(f"--tick-s {tick_s} leaves no settled moment after {settle_s} s")
    return at


# -- costs ---------------------------------------------------------------------------------------


def costs(
    servers: list[Service],
    single: Prometheus | None,
    sharded: Sharded,
    fleet: Fleet,
    scrape_s: int,
    evaluations: int,
) -> dict[str, Any]:
    result: dict[str, Any] = {"components": {}}
    for server in servers:
        row: dict[str, Any] = {"rss_bytes": server.rss_bytes(), "cpu_s": server.cpu_s()}
        if isinstance(server, Prometheus):
            row["head_series"] = server.api("status/tsdb")["headStats"]["numSeries"]
        result["components"][server.name] = row
    result["store_series"] = sharded.store.series_count()
    result["ruler_group_s"] = sharded.ruler.group_times()
    result["shard_rules"] = {
        shard.name: rule_times(shard, evaluations, scrape_s) for shard in sharded.shards
    }
    result["shard_alerts"] = time_alert_expressions(sharded.shards[0])
    result["store_queries"] = time_queries(sharded.store, fleet, scrape_s)
    if single is not None:
        result["single_rules"] = rule_times(single, evaluations, scrape_s)
        result["single_queries"] = time_queries(single, fleet, scrape_s)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    fleet = demo_fleet(args.nodes, args.restart_s, args.alerting_every, args.tick_s)
    fleet_port, single_port = free_ports(2)
    serve(fleet, fleet_port)
    folder = Path(tempfile.mkdtemp(prefix="gpumem-scaleout-"))
    node_tier = [*NODE_TIER, *args.extra_node_rules]
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, folder, True)
        single = None
        if not args.no_single:
            config = prometheus_config(
                fleet,
                fleet_port,
                args.scrape_s,
                folder / "single",
                rule_files=[*node_tier, *GLOBAL_TIER],
                own_port=single_port,
            )
            single = Prometheus(folder / "single", config, single_port, "single", wait=False)
            stack.callback(single.stop)
        sharded = start_sharded(
            stack, fleet, fleet_port, args.shards, args.scrape_s, folder, node_tier
        )
        servers = [*sharded.services, *([single] if single else [])]
        for server in servers:
            server.wait_ready()
        cpu0 = {s.name: s.cpu_s() for s in servers}
        started = time.monotonic()
        while time.monotonic() - started < args.warmup_s:
            time.sleep(min(30.0, args.warmup_s - (time.monotonic() - started)) + 0.01)
            print(f"{time.monotonic() - started:6.0f} s", flush=True)
        result: dict[str, Any] = {
            "nodes": args.nodes,
            "gpus": args.nodes * GPUS,
            "shards": args.shards,
            "scrape_interval_s": args.scrape_s,
            "tick_s": args.tick_s,
            "history_s": round(time.monotonic() - started),
        }
        if single is not None:
            at = settled_moment(args.tick_s, 4 * args.scrape_s + 6)
            while time.time() < at + args.scrape_s + 1:
                time.sleep(0.2)
            result["comparison"] = compare(
                single, sharded.store, fleet, args.scrape_s, at, [*node_tier, *GLOBAL_TIER]
            )
        elapsed = time.monotonic() - started
        result["costs"] = costs(servers, single, sharded, fleet, args.scrape_s, args.evaluations)
        for name, row in result["costs"]["components"].items():
            row["cores"] = round((row.pop("cpu_s") - cpu0[name]) / elapsed, 3)
        return result


def report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['nodes']} nodes, {result['gpus']} GPUs, {result['shards']} shards, "
        f"{result['scrape_interval_s']} s scrapes, {result['history_s']} s of history",
    ]
    comparison = result.get("comparison")
    if comparison:
        lines.append(
            f"compared {comparison['compared']} answers ({comparison['series']} series) with "
            f"one Prometheus: {len(comparison['mismatches'])} differ"
        )
        for row in comparison["mismatches"]:
            lines.append(f"  {row['what']} {row['name']}: {row['differences'][:2]}")
        lines.append(
            f"rate()/increase() of raw counters answered by the store's engine: "
            f"{len(comparison['engine_differences'])} differ"
        )
        for row in comparison["engine_differences"]:
            lines.append(f"  {row['name']}: {row['differences'][:1]}")
    lines += ["", "| component | head series | RSS (MiB) | cores |", "| --- | ---: | ---: | ---: |"]
    for name, row in result["costs"]["components"].items():
        lines.append(
            f"| {name} | {row.get('head_series', '')} | {row['rss_bytes'] / 2**20:.0f} | "
            f"{row['cores']} |"
        )
    lines.append(f"| (store series) | {result['costs']['store_series']} | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100, help="nodes of 8 GPUs (default 100)")
    parser.add_argument("--shards", type=int, default=2, help="Prometheus shards (default 2)")
    parser.add_argument("--scrape-s", type=int, default=15, help="scrape and rule interval")
    parser.add_argument("--tick-s", type=int, default=120, help="values move once per tick")
    parser.add_argument("--warmup-s", type=float, default=300, help="scraping before comparing")
    parser.add_argument(
        "--restart-s", type=float, default=7200, help="each server restarts once per"
    )
    parser.add_argument("--evaluations", type=int, default=4, help="rule evaluations to observe")
    parser.add_argument("--no-single", action="store_true", help="only the sharded setup")
    add_alerting_every(parser)
    parser.add_argument(
        "--extra-node-rules",
        type=Path,
        action="append",
        default=[],
        help="a rule file of your own added to the node tier of both setups: its recorded "
        "series are compared too",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if min(args.nodes, args.shards, args.scrape_s, args.alerting_every) < 1 or args.warmup_s < 0:
        parser.error(
            "--nodes, --shards, --scrape-s and --alerting-every must be positive, "
            "--warmup-s not negative"
        )
    for path in args.extra_node_rules:
        if not path.is_file():
            parser.error(f"--extra-node-rules {path}: no such file")
    if args.tick_s < 4 * args.scrape_s + 8:
        parser.error("--tick-s must leave room for four scrapes and the ruler: >= 4 x scrape + 8")
    result = run(args)
    if args.out:
        write_json(args.out, result)
    print(report(result))


if __name__ == "__main__":
    main()
