"""Digests of /metrics for every sample of the recorded traces, in every mode and format.

    python scripts/exposition_digests.py > tests/data/exposition_digests.json

tests/test_exposition_digests.py renders the same and compares: a redesign that is meant to
change nothing proves it byte for byte. Run this on the tree before a change (it takes the
older collector's signature too) to record what the change must keep.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any
from unittest import mock

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from exporter.detectors import Detectors
from exporter.metrics import ExporterState, SampleCollector
from exporter.sample import SourceStatus
from exporter.trace import read_trace

ROOT = Path(__file__).resolve().parent.parent
TRACES = ("exporter/data/demo_trace.jsonl.gz", "tests/data/h200_oom_storm_trace.jsonl.gz")
MODES = ("embedded", "run", "node", "demo")
CONST = {"cluster": "c1", "node": "n1"}
SOURCES = {"torch": SourceStatus(True, 0.001, 0), "nvml": SourceStatus(True, 0.002, 1)}


def collector(
    state: ExporterState, mode: str, alerts: Detectors, detail: str = "full"
) -> SampleCollector:
    options: dict[str, Any] = {
        "const_labels": CONST,
        "version": "0.1.0",
        "torch_version": "2.11.0",
        "alerts": alerts,
        "detail": detail,
    }
    try:
        from exporter.modes import MODES as DECLARED  # type: ignore[import-not-found,unused-ignore]

        options["traits"] = DECLARED[mode].traits
    except ImportError:  # the tree before exporter/modes: the mode by name
        options.update(mode=mode, own_process=mode != "demo")
    return SampleCollector(lambda: state, **options)


def digests(path: str, mode: str) -> list[str]:
    """One sha256 per sample: of the text format, then of OpenMetrics."""
    _, samples = read_trace(ROOT / path)
    alerts = Detectors(log_events=False)
    found = []
    for sample in samples:
        alerts(sample)
        registry = CollectorRegistry()
        registry.register(collector(ExporterState(sample, SOURCES), mode, alerts))
        both = generate_latest(registry) + b"\0" + generate_openmetrics(registry)
        found.append(hashlib.sha256(both).hexdigest()[:16])
    return found


def replayed(path: str) -> list[str]:
    """The demo's own path: the replay source read by the sampler, twice through the trace
    (the second loop's counters carry on), at the basic detail level (no read durations)."""
    from exporter.sampler import Sampler
    from exporter.sources.replay import ReplaySource

    _, samples = read_trace(ROOT / path)
    now = [0.0]
    source = ReplaySource(ROOT / path, clock=lambda: now[0])
    sampler = Sampler([source], clock=lambda: 1.7e9 + now[0])
    alerts = Detectors(log_events=False)
    found = []
    for loop in range(2):
        for sample in samples:
            now[0] = loop * source.duration_s + sample.timestamp - samples[0].timestamp + 1e-3
            # The replay dates a recorded OOM by the wall clock: the same one, every run.
            with mock.patch("time.time", lambda: 1.7e9 + now[0]):
                alerts(sampler.tick())
            registry = CollectorRegistry()
            state = sampler.state()
            registry.register(collector(state, "demo", alerts, detail="basic"))
            found.append(hashlib.sha256(generate_latest(registry)).hexdigest()[:16])
    return found


def main() -> int:
    table = {f"{path} {mode}": digests(path, mode) for path in TRACES for mode in MODES}
    table |= {f"{path} replayed": replayed(path) for path in TRACES}
    json.dump(table, sys.stdout, indent=0, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
