"""A fleet on one real Prometheus: head series, memory, and the time of every rule and every
dashboard query (issue 27).

One command: builds the exposition of N nodes, each a TP=8 server under `gpumem-exporter run`
and its node daemon, shaped exactly like the exporter's own (bench.fleet_series renders both
with the exporter's collector and detectors at the default detail level; each node gets its own
GPU UUIDs, pod, namespace and pids), serves them from one asyncio HTTP server (one target per
endpoint, kept-alive connections as Prometheus keeps them), and has a real Prometheus (Debian
`prometheus`) scrape them live with this repository's recording and alert rules loaded. Gauges
move every scrape, counters grow, and each server restarts (new pids) once per restart period,
spread over the fleet. After the warm-up it reports:

- head series, series per GPU, series created per restart, samples appended per second;
- Prometheus's RSS and bytes per head series, and its CPU over the run;
- each rule group's and each rule's evaluation time (the largest over several evaluations);
- each dashboard query: instant, and over the dashboard's default range (3 h) and 1 h at the
  step Grafana would use (range / 1000 points, at least the scrape interval), with the
  history the run has (the warm-up).

    python -m bench.fleet --nodes 1000 --warmup-s 3600 --out docs/bench-fleet.json

Needs the `prometheus` binary (apt-get install prometheus); no GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.common import REPO, write_json
from bench.fleet_series import QUIET_TICKS, measure_texts

RULES = REPO / "deploy" / "prometheus"
DASHBOARDS = REPO / "dashboards"
GPUS = 8
# A label value whose number is a process id: it changes when the server restarts.
_PID = re.compile(r'pid="(\d+)"')
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$")
# Gauges that stay put on a real node: sizes, limits, states, identities.
_STEADY = re.compile(
    r"(_info|_up|total_bytes|limit_bytes|_peak_bytes|_ratio|_fds|start_time_seconds)$"
)


@dataclass(frozen=True)
class Line:
    text: str  # everything before the value ("" for a comment line: kept whole in `value`)
    value: str
    kind: str  # comment, steady, moving, counter, rare (a counter that rarely moves), clock
    has_pid: bool = False


def _kinds(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))


def template(text: str) -> list[Line]:
    """The exposition as lines, each knowing how its value moves."""
    types = _kinds(text)
    lines = []
    for raw in text.splitlines():
        match = _SAMPLE.match(raw)
        if raw.startswith("#") or match is None:
            lines.append(Line("", raw, "comment"))
            continue
        name, labels, value = match.group(1), match.group(2) or "", match.group(3)
        family = re.sub(r"_(total|created)$", "", name)
        if name.endswith("_timestamp_seconds"):
            kind = "clock"
        elif types.get(family) == "counter" or types.get(name) == "counter":
            kind = "rare" if re.search(r"ooms|retries|errors|rejected", name) else "counter"
        elif _STEADY.search(name) or float(value) in (0.0, 1.0):
            kind = "steady"
        else:
            kind = "moving"
        lines.append(Line(f"{name}{labels} ", value, kind, bool(_PID.search(labels))))
    return lines


class Fleet:
    """The expositions of N nodes, rendered on request for the moment of the request."""

    def __init__(
        self,
        nodes: int,
        run_text: str,
        node_text: str,
        restart_s: float,
        tick_s: int = 15,
        quiet: tuple[str, str] | None = None,
        alerting_every: int = 1,
    ) -> None:
        # Values move once per tick (a scrape interval by default; longer where two setups
        # that scrape at different moments must read the same values: bench.scaleout).
        self.nodes, self.restart_s, self.tick_s = nodes, restart_s, tick_s
        self.started = time.time()
        self.templates = {"run": template(run_text), "node": template(node_text)}
        # One node in `alerting_every` serves the texts above (the demo's end: a shattered
        # cache, alerts pending on every GPU); the others the quiet texts. Every node alerts
        # unless told otherwise, the worst case: an alert storm costs Prometheus per alert.
        if alerting_every > 1 and quiet is None:
            raise ValueError("quiet nodes need the quiet texts")
        self.alerting_every = alerting_every
        self.quiet_templates = (
            {"run": template(quiet[0]), "node": template(quiet[1])} if quiet else self.templates
        )

    def alerting(self, node: int) -> bool:
        return node % self.alerting_every == 0

    def namespace(self, node: int) -> str:
        return f"team-{node % 40}"

    def pod(self, node: int) -> str:
        return f"llm-{node}"

    def restarted_at(self, node: int, epoch: int) -> float:
        return self.started + epoch * self.restart_s - self.restart_s * node / self.nodes

    def restarts(self, node: int, now: float) -> int:
        """How many times the node's server has restarted: each node once per period, the
        nodes spread evenly over it."""
        offset = self.restart_s * node / self.nodes
        return int((now - self.started + offset) // self.restart_s)

    def render(self, node: int, endpoint: str, now: float) -> bytes:
        tick = int(now // self.tick_s)
        epoch = self.restarts(node, now)
        # A restarted server's counters start again from 0.
        since = tick - int(self.restarted_at(node, epoch) // self.tick_s)
        out = []
        templates = self.templates if self.alerting(node) else self.quiet_templates
        for index, line in enumerate(templates[endpoint]):
            if line.kind == "comment":
                out.append(line.value)
                continue
            text = self._identify(line.text, node)
            if line.has_pid:
                text = _PID.sub(lambda m: f'pid="{int(m.group(1)) + 100000 * epoch}"', text)
            out.append(text + self._value(line, node, index, tick, since, now))
        return ("\n".join(out) + "\n").encode()

    def _identify(self, text: str, node: int) -> str:
        text = text.replace("GPU-00000000-", f"GPU-{node:08x}-")
        return text.replace('"llama-0"', f'"{self.pod(node)}"').replace(
            'namespace="llm"', f'namespace="{self.namespace(node)}"'
        )

    @staticmethod
    def _value(line: Line, node: int, index: int, tick: int, since: int, now: float) -> str:
        base = float(line.value)
        if line.kind == "steady":
            return line.value
        if line.kind == "clock":
            return f"{now:.3f}"
        # A cheap, repeatable scramble of (node, series, tick): values that move like memory.
        jitter = ((tick * 2654435761 + index * 97 + node * 131) % 1000) / 1000
        if line.kind == "moving":
            return repr(round(base * (0.98 + 0.04 * jitter)))
        if line.kind == "counter":
            return repr(since * (1 + index % 7))
        # rare (OOMs, retries, errors): one node in 50 has one every 10 minutes.
        return repr(float(since // 40 if node % 50 == 0 else 0))


def demo_fleet(nodes: int, restart_s: float, alerting_every: int, tick_s: int = 15) -> Fleet:
    """N nodes of the demo server, one in `alerting_every` at the demo's alerting end."""
    quiet = measure_texts(GPUS, ticks=QUIET_TICKS) if alerting_every > 1 else None
    return Fleet(
        nodes, *measure_texts(GPUS), restart_s, tick_s, quiet=quiet, alerting_every=alerting_every
    )


def add_alerting_every(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--alerting-every",
        type=int,
        default=1,
        help="one node in N in the demo's alerting end state, the others quiet (default 1: all)",
    )


async def _serve_connection(fleet: Fleet, reader: Any, writer: Any) -> None:
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while True:
            request = await reader.readline()
            if not request:
                break
            while await reader.readline() not in (b"\r\n", b"\n", b""):
                pass
            parts = request.decode("latin-1").split()
            match = re.fullmatch(r"/n/(\d+)/(run|node)", parts[1] if len(parts) > 1 else "")
            if match is None:
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            else:
                body = fleet.render(int(match.group(1)), match.group(2), time.time())
                head = "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
    writer.close()


def serve(fleet: Fleet, port: int) -> threading.Thread:
    """The fleet's endpoints on 127.0.0.1:port, in a thread of its own."""
    ready = threading.Event()

    async def main() -> None:
        server = await asyncio.start_server(
            lambda r, w: _serve_connection(fleet, r, w), "127.0.0.1", port, backlog=4096
        )
        ready.set()
        async with server:
            await server.serve_forever()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    ready.wait(10)
    return thread


def prometheus_config(
    fleet: Fleet,
    port: int,
    scrape_s: int,
    folder: Path,
    rule_files: list[Path] | None = None,
    relabel: list[dict[str, Any]] | None = None,
    own_port: int | None = None,
) -> dict[str, Any]:
    """One Prometheus scraping the fleet with `rule_files` (default: every file of
    deploy/prometheus) and `relabel` added to each fleet job (a shard's hashmod)."""

    def targets(endpoint: str, node_port: int) -> list[dict[str, Any]]:
        found = []
        for node in range(fleet.nodes):
            labels = {
                "__metrics_path__": f"/n/{node}/{endpoint}",
                "instance": f"10.{node // 250}.{node % 250}.1:{node_port}",
                "cluster": "fleet",
                "node": f"node-{node}",
            }
            if endpoint == "run":
                labels |= {"namespace": fleet.namespace(node), "pod": fleet.pod(node)}
            else:
                labels |= {"namespace": "monitoring", "pod": f"gpumem-node-{node}"}
            found.append({"targets": [f"127.0.0.1:{port}"], "labels": labels})
        return found

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for source in rule_files if rule_files is not None else sorted(RULES.glob("*.yaml")):
        shutil.copy(source, folder / source.name)
        names.append(source.name)
    sharding = {"relabel_configs": relabel} if relabel else {}
    return {
        "global": {
            "scrape_interval": f"{scrape_s}s",
            "scrape_timeout": f"{min(scrape_s, 10)}s",
            "evaluation_interval": f"{scrape_s}s",
        },
        "rule_files": names,
        "scrape_configs": [
            {"job_name": "gpumem-pods", "static_configs": targets("run", 9445), **sharding},
            # The chart's node daemon monitor keeps the kubelet's namespace/pod labels.
            {
                "job_name": "gpumem-node",
                "honor_labels": True,
                "static_configs": targets("node", 9446),
                **sharding,
            },
            # Prometheus itself: samples appended, series created.
            {
                "job_name": "prometheus",
                "static_configs": [{"targets": [f"127.0.0.1:{own_port or port + 1}"]}],
            },
        ],
    }


class Service:
    """A server process of the benchmark with a Prometheus-compatible HTTP API (Prometheus,
    VictoriaMetrics, vmalert): started, waited for, asked, measured and stopped."""

    def __init__(
        self, name: str, argv: list[str], port: int, ready: str, cwd: Path, wait: bool = True
    ) -> None:
        binary = shutil.which(argv[0])
        if binary is None:
            raise SystemExit(f"{argv[0]} not found: apt-get install {PACKAGES[argv[0]]}")
        self.name, self.url, self.ready = name, f"http://127.0.0.1:{port}", ready
        self.process = subprocess.Popen([binary, *argv[1:]], cwd=cwd)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.process.returncode} at start")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(self.url + self.ready, timeout=2).close()
                return
            time.sleep(0.3)
        self.stop()
        raise SystemExit(f"{self.name} did not become ready")

    def api(self, path: str, timeout: float = 150, **params: Any) -> Any:
        url = f"{self.url}/api/v1/{path}?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = json.loads(response.read())
        if body.get("status") != "success":
            raise RuntimeError(body)
        return body["data"]

    def timed(self, path: str, **params: Any) -> tuple[float, int, str]:
        """(seconds, series in the answer, error) of one query, as a client waits for it."""
        started = time.perf_counter()
        try:
            data = self.api(path, **params)
        except Exception as exc:  # a timeout or an error answer: reported, not fatal
            return time.perf_counter() - started, 0, str(exc)[:200]
        return time.perf_counter() - started, len(data["result"]), ""

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)


# The Debian package of each server binary.
PACKAGES = {
    "prometheus": "prometheus",
    "victoria-metrics": "victoria-metrics",
    "vmalert": "victoria-metrics",
}


class Prometheus(Service):
    def __init__(
        self,
        folder: Path,
        config: dict[str, Any],
        port: int,
        name: str = "prometheus",
        wait: bool = True,
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        argv = [
            "prometheus",
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ]
        super().__init__(name, argv, port, "/-/ready", folder, wait)


# -- dashboards -------------------------------------------------------------------------------


def panel_queries(path: Path) -> Iterator[tuple[str, str, bool]]:
    """(panel title, PromQL, instant) of every query of the dashboard."""

    def walk(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str, bool]]:
        for panel in panels:
            yield from walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                if target.get("expr"):
                    yield panel.get("title", ""), target["expr"], bool(target.get("instant"))

    yield from walk(json.loads(path.read_text())["panels"])


def substitute(expr: str, fleet: Fleet, range_s: int, step_s: int, scrape_s: int) -> str:
    values = {
        "cluster": ".*",  # All (the variable's allValue)
        "namespace": fleet.namespace(0),  # the pod dashboard's one pod
        "pod": fleet.pod(0),
        "device": ".*",
        "__rate_interval": f"{max(4 * scrape_s, step_s + scrape_s)}s",
        "__range": f"{range_s}s",
        "__interval": f"{step_s}s",
    }
    # The fleet dashboard's namespace variable is multi-value with All: `=~".*"`.
    expr = expr.replace('namespace=~"$namespace"', 'namespace=~".*"')
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    return expr


def grafana_step(range_s: int, scrape_s: int, points: int = 1000) -> int:
    return max(scrape_s, -(-range_s // points))


def time_queries(prom: Service, fleet: Fleet, scrape_s: int) -> list[dict[str, Any]]:
    """Each dashboard query as Grafana would send it: instant panels once at now, range panels
    over the dashboard's default 3 h and over 1 h. The slower of two runs is kept."""
    now = time.time()
    results = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for title, expr, instant in panel_queries(path):
            row: dict[str, Any] = {"dashboard": path.stem, "panel": title, "expr": expr}
            for range_s in (3 * 3600, 3600):
                step = grafana_step(range_s, scrape_s)
                query = substitute(expr, fleet, range_s, step, scrape_s)
                if instant:
                    runs = [prom.timed("query", query=query, time=str(now)) for _ in range(2)]
                    key = "instant" if range_s == 3 * 3600 else "instant_1h"
                else:
                    params = {"start": str(now - range_s), "end": str(now), "step": str(step)}
                    runs = [prom.timed("query_range", query=query, **params) for _ in range(2)]
                    key = f"range_{range_s // 3600}h"
                row[key] = max(r[0] for r in runs)
                row[f"{key}_series"] = runs[-1][1]
                if runs[-1][2]:
                    row[f"{key}_error"] = runs[-1][2]
            results.append(row)
    return results


def alert_rules() -> list[dict[str, Any]]:
    """The shipped alert rules (deploy/prometheus/alerts.yaml), every group's, in file order."""
    groups = yaml.safe_load((RULES / "alerts.yaml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def shipped_alert(name: str) -> dict[str, Any]:
    return next(rule for rule in alert_rules() if rule["alert"] == name)


def time_alert_expressions(prom: Service) -> list[dict[str, Any]]:
    """Each alert's expression as an instant query: what its rule pays per evaluation."""
    found = []
    for rule in alert_rules():
        runs = [prom.timed("query", query=rule["expr"]) for _ in range(2)]
        found.append({"alert": rule["alert"], "instant": max(r[0] for r in runs)})
    return found


def rule_times(prom: Service, evaluations: int, interval_s: int) -> dict[str, Any]:
    """The largest evaluation time of every group and rule over several evaluations."""
    groups: dict[str, list[float]] = {}
    rules: dict[str, list[float]] = {}
    seen: set[tuple[str, str]] = set()
    deadline = time.monotonic() + evaluations * interval_s * 3
    while len(seen) < evaluations * max(len(groups), 1) and time.monotonic() < deadline:
        for group in prom.api("rules")["groups"]:
            stamp = (group["name"], group.get("lastEvaluation", ""))
            if stamp in seen:
                continue
            seen.add(stamp)
            groups.setdefault(group["name"], []).append(group["evaluationTime"])
            for rule in group["rules"]:
                name = rule.get("name", "")
                rules.setdefault(name, []).append(rule.get("evaluationTime", 0.0))
        time.sleep(interval_s / 3)
    return {
        "groups": {k: {"max": max(v), "median": statistics.median(v)} for k, v in groups.items()},
        "rules": {k: {"max": max(v), "median": statistics.median(v)} for k, v in rules.items()},
    }


def query_value(prom: Prometheus, expr: str) -> float:
    result = prom.api("query", query=expr)["result"]
    return float(result[0]["value"][1]) if result else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    fleet = demo_fleet(args.nodes, args.restart_s, args.alerting_every)
    port = args.port
    serve(fleet, port)
    folder = Path(tempfile.mkdtemp(prefix="gpumem-fleet-"))
    prom = Prometheus(folder, prometheus_config(fleet, port, args.scrape_s, folder), port + 1)
    try:
        # This process's CPU is the fleet's generator (and the polling below): on a small
        # machine it shares the cores with Prometheus, so the report says how much it took.
        started, cpu0, own0 = time.monotonic(), prom.cpu_s(), time.process_time()
        while time.monotonic() - started < args.warmup_s:
            time.sleep(min(30.0, args.warmup_s))
            series = prom.api("status/tsdb")["headStats"]["numSeries"]
            print(f"{time.monotonic() - started:7.0f} s: {series} head series", flush=True)
        cpu_s, own_s = prom.cpu_s() - cpu0, time.process_time() - own0
        elapsed = time.monotonic() - started
        head = prom.api("status/tsdb")["headStats"]
        rss = prom.rss_bytes()
        gpus = args.nodes * GPUS
        window = f"{min(int(elapsed), 300)}s"
        result: dict[str, Any] = {
            "nodes": args.nodes,
            "gpus": gpus,
            "scrape_interval_s": args.scrape_s,
            "history_s": round(elapsed),
            "restart_period_s": args.restart_s,
            "alerting_every": args.alerting_every,
            "head_series": head["numSeries"],
            "series_per_gpu": round(head["numSeries"] / gpus, 1),
            "rss_bytes": rss,
            "bytes_per_series": round(rss / head["numSeries"]),
            "cpu_cores": round(cpu_s / elapsed, 2),
            "generator_cpu_cores": round(own_s / elapsed, 2),
            "samples_per_s": round(
                query_value(prom, f"rate(prometheus_tsdb_head_samples_appended_total[{window}])")
            ),
            "restarts": sum(fleet.restarts(n, time.time()) for n in range(args.nodes)),
        }
        result["series_created"] = query_value(prom, "prometheus_tsdb_head_series_created_total")
        # What the head holds: the exporters' series, each target's own (up, scrape_*), the
        # recording rules' results and the alerts' states.
        result["head_by_kind"] = {
            "run endpoints": query_value(
                prom, 'count({job="gpumem-pods", __name__!~"up|scrape_.*"})'
            ),
            "node daemons": query_value(
                prom, 'count({job="gpumem-node", __name__!~"up|scrape_.*"})'
            ),
            "per target (up, scrape_*)": query_value(prom, 'count({__name__=~"up|scrape_.*"})'),
            "recording rules": query_value(prom, 'count({__name__=~".+:.+"})'),
            "alerts (ALERTS, ALERTS_FOR_STATE)": query_value(prom, 'count({__name__=~"ALERTS.*"})'),
        }
        result["rules"] = rule_times(prom, args.evaluations, args.scrape_s)
        result["alerts"] = time_alert_expressions(prom)
        result["queries"] = time_queries(prom, fleet, args.scrape_s)
        return result
    finally:
        prom.stop()
        shutil.rmtree(folder, ignore_errors=True)


def report(result: dict[str, Any]) -> str:
    """The headline numbers and the slowest rules and queries, as markdown."""
    lines = [
        f"{result['nodes']} nodes, {result['gpus']} GPUs, {result['scrape_interval_s']} s "
        f"scrapes, {result['history_s']} s of history: {result['head_series']} head series "
        f"({result['series_per_gpu']} per GPU), {result['rss_bytes'] / 2**30:.2f} GiB RSS "
        f"({result['bytes_per_series']} B per series), {result['cpu_cores']} cores "
        f"(the generator beside it: {result.get('generator_cpu_cores', '?')}), "
        f"{result['samples_per_s']} samples/s",
        "",
        "| rule group | largest evaluation (s) |",
        "| --- | ---: |",
    ]
    for name, times in sorted(result["rules"]["groups"].items()):
        lines.append(f"| {name} | {times['max']:.3f} |")
    slowest = sorted(result["rules"]["rules"].items(), key=lambda kv: -kv[1]["max"])[:5]
    lines += ["", "| slowest rules | largest evaluation (s) |", "| --- | ---: |"]
    lines += [f"| {name} | {t['max']:.3f} |" for name, t in slowest]
    lines += [
        "",
        "| dashboard | panel | instant (s) | 1 h (s) | 3 h (s) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for row in sorted(result["queries"], key=lambda r: -max(_times(r)))[:15]:
        cells = [
            f"{row.get(k, 0):.3f}" if k in row else "" for k in ("instant", "range_1h", "range_3h")
        ]
        lines.append(f"| {row['dashboard']} | {row['panel']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _times(row: dict[str, Any]) -> list[float]:
    return [row[k] for k in ("instant", "instant_1h", "range_1h", "range_3h") if k in row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000, help="nodes of 8 GPUs (default 1000)")
    parser.add_argument("--scrape-s", type=int, default=15, help="scrape and rule interval")
    parser.add_argument("--warmup-s", type=float, default=3600, help="scraping before measuring")
    parser.add_argument(
        "--restart-s", type=float, default=7200, help="each server restarts once per"
    )
    parser.add_argument("--evaluations", type=int, default=6, help="rule evaluations to observe")
    add_alerting_every(parser)
    parser.add_argument("--port", type=int, default=19400, help="fleet port (Prometheus: +1)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if args.nodes < 1 or args.scrape_s < 1 or args.alerting_every < 1 or args.warmup_s < 0:
        parser.error(
            "--nodes, --scrape-s and --alerting-every must be positive, --warmup-s not negative"
        )
    result = run(args)
    if args.out:
        write_json(args.out, result)
    print(report(result))


if __name__ == "__main__":
    main()
