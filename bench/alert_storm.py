"""What one active alert costs Prometheus per evaluation, and how much of it is the alert's text
(issue 40).

Prometheus expands every label and annotation of every active (pending or firing) alert as a Go
template on every evaluation, static text included (Debian's Prometheus 2.42), so an alert storm
costs in proportion to alerts times annotations, whatever the expression costs. This runs
promtool's rule test (Prometheus's own rule engine) on N series that all hold one of
deploy/prometheus/alerts.yaml's alerts, for as many evaluations as the alert's `for` and a few
more, three times: the rule as shipped, with only its text-free annotations (no `{{`), and with
no annotations; the differences per alert-evaluation are what the text costs.

    python -m bench.alert_storm [--alerts 1000] [--out results.json]

Needs `promtool` (apt-get install prometheus); no GPU.
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common import write_json
from bench.fleet import shipped_alert

# Values that hold GpuMemCacheGapHigh: 15 GB of a 20 GB cache unused.
CACHE_GAP_SERIES = {
    "torch_cuda_reserved_bytes": "20000000000",
    "torch_cuda_allocated_bytes": "5000000000",
    "torch_cuda_cached_free_ratio": "0.75",
}
ALERT = "GpuMemCacheGapHigh"
EVALUATIONS = 129  # 32 minutes at 15 s: past the alert's 30 minutes, so it fires


def variants(rule: dict[str, Any]) -> dict[str, dict[str, Any]]:
    static = {k: v for k, v in rule["annotations"].items() if "{{" not in v}
    found = {}
    for name, text in (("shipped", rule["annotations"]), ("static", static), ("none", {})):
        found[name] = {**copy.deepcopy(rule), "annotations": text}
    return found


def storm_test(folder: Path, rule: dict[str, Any], alerts: int, checked: str = "none") -> Path:
    """A promtool rule test of `rule` over `alerts` series that hold GpuMemCacheGapHigh,
    expecting no `checked` alert after EVALUATIONS evaluations."""
    rules = folder / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "storm", "rules": [rule]}]}))
    series = []
    for i in range(alerts):
        labels = f'{{instance="node-{i}:8000",job="gpumem-pods",device="0",gpu_uuid="GPU-{i}"}}'
        series += [
            {"series": name + labels, "values": f"{value}x{EVALUATIONS}"}
            for name, value in CACHE_GAP_SERIES.items()
        ]
    test = folder / "test.yaml"
    minutes = EVALUATIONS * 15 // 60
    test.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(rules)],
                "evaluation_interval": "15s",
                "tests": [
                    {
                        "interval": "15s",
                        "input_series": series,
                        # By default checks an alert that is not there: the run evaluates
                        # every step up to it and compares nothing large.
                        "alert_rule_test": [
                            {"eval_time": f"{minutes}m", "alertname": checked, "exp_alerts": []}
                        ],
                    }
                ],
            }
        )
    )
    return test


def rule_test(folder: Path, rule: dict[str, Any], alerts: int) -> float:
    """Seconds promtool takes to evaluate the rule EVALUATIONS times over `alerts` series."""
    test = storm_test(folder, rule, alerts)
    started = time.perf_counter()
    subprocess.run(["promtool", "test", "rules", str(test)], check=True, capture_output=True)
    return time.perf_counter() - started


def measure(alerts: int) -> dict[str, Any]:
    rule = shipped_alert(ALERT)
    with tempfile.TemporaryDirectory(prefix="gpumem-alert-storm-") as tmp:
        seconds = {name: rule_test(Path(tmp), r, alerts) for name, r in variants(rule).items()}
    per = {k: 1e3 * v / (alerts * EVALUATIONS) for k, v in seconds.items()}
    return {
        "alert": ALERT,
        "alerts": alerts,
        "evaluations": EVALUATIONS,
        "annotations": sorted(rule["annotations"]),
        "seconds": seconds,
        "ms_per_alert_evaluation": per,
        "text_share": round((per["shipped"] - per["none"]) / per["shipped"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alerts", type=int, default=1000, help="series holding the alert")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if args.alerts < 1:
        parser.error("--alerts must be positive")
    result = measure(args.alerts)
    if args.out:
        write_json(args.out, result)
    per = result["ms_per_alert_evaluation"]
    print(
        f"{ALERT}, {args.alerts} active alerts, {EVALUATIONS} evaluations: "
        + ", ".join(f"{k} {v:.3f} ms" for k, v in per.items())
        + f" per alert per evaluation; the text is {100 * result['text_share']:.0f}% of it"
    )


if __name__ == "__main__":
    main()
