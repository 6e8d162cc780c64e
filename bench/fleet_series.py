"""Series per GPU and identities a restart changes: the baseline of a fleet's cost (issue 27).

Builds, with the exporter's own collector and detectors, the exposition of one node of a
vLLM-like tensor-parallel server under `gpumem-exporter run`: an API process, an engine core
and one worker per GPU (TP=8 by default), each worker's readings the H100 demo trace's own
(exporter/data/demo_trace.jsonl.gz) replayed in step, alert states from the detectors evaluated
over the whole trace; and the node daemon beside it (NVML, host memory of each GPU process, the
kubelet's attribution of the pod). Then the same server restarted (every pid new) and counts:

- series per GPU at each endpoint, by family, and those that carry a pid;
- how many series identities (name and labels) the restart changes.

    python -m bench.fleet_series [--gpus 8] [--out results.json]

No GPU is needed: the values are recorded ones, and the count of series does not depend on them.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.catalog import DETAIL_LEVELS
from exporter.config import Config
from exporter.detectors import Detectors
from exporter.fill.render import ActionStats
from exporter.metrics import SampleCollector
from exporter.modes import MODES
from exporter.sample import (
    ExporterState,
    GpuReading,
    HostProcessReading,
    KubeletReading,
    PodDevice,
    ProcessContainerReading,
    ProcessCounts,
    ProcessGpuReading,
    Sample,
    SourceStatus,
)
from exporter.sources.kinds import SOURCE_KINDS
from exporter.sources.replay import demo_trace_path
from exporter.trace import read_trace

API_PID_OFFSET, ENGINE_PID_OFFSET, WORKER_PID_OFFSET = 0, 1, 2
_CLIENT_PYTHON = re.compile(r"^(process_(?!resident_memory_peak)|python_)")


def _uuid(gpu: int) -> str:
    return f"GPU-00000000-0000-0000-0000-{gpu:012d}"


def server_sample(recorded: Sample, gpus: int, pid0: int) -> Sample:
    """One tick of the TP server under `run`: each worker reads the recorded allocator."""
    (allocator,) = recorded.allocators[:1]
    sample = Sample(timestamp=recorded.timestamp, host=recorded.host)
    for rank in range(gpus):
        pid = str(pid0 + WORKER_PID_OFFSET + rank)
        process = {"pid": pid, "rank": str(rank), "local_rank": str(rank), "role": "VllmWorker"}
        reading = copy.deepcopy(allocator)
        reading.gpu_uuid, reading.device, reading.process = _uuid(rank), 0, process
        sample.allocators.append(reading)
        for pinned in recorded.pinned_host[:1]:
            sample.pinned_host.append(dataclasses.replace(pinned, process=dict(process)))
        gpu = copy.deepcopy(recorded.gpus[0]) if recorded.gpus else GpuReading(rank, "")
        gpu.index, gpu.uuid = rank, _uuid(rank)
        sample.gpus.append(gpu)
        used = recorded.processes[0].used_bytes if recorded.processes else 0
        sample.processes.append(ProcessGpuReading(rank, _uuid(rank), int(pid), used))
    rss = recorded.host_processes[0] if recorded.host_processes else None
    roles = [("api", API_PID_OFFSET, ""), ("EngineCore", ENGINE_PID_OFFSET, "")]
    roles += [("VllmWorker", WORKER_PID_OFFSET + rank, str(rank)) for rank in range(gpus)]
    for role, offset, rank_label in roles:
        resident = rss.resident_bytes if rss else 1 << 30
        sample.host_processes.append(HostProcessReading(pid0 + offset, role, rank_label, resident))
    return sample


def node_sample(server: Sample, recorded: Sample) -> Sample:
    """The node daemon beside it: NVML, the GPU processes' host memory, the kubelet's view."""
    sample = Sample(timestamp=server.timestamp, gpus=server.gpus, processes=server.processes)
    sample.host = recorded.host
    workers = [p for p in server.host_processes if p.role == "VllmWorker"]
    sample.host_processes = [dataclasses.replace(p, role="python", rank="") for p in workers]
    sample.kubelet = KubeletReading(
        "/var/lib/kubelet/pod-resources/kubelet.sock",
        up=True,
        last_success_s=server.timestamp,
        asked_s=server.timestamp,  # after the processes were first seen
        devices=[
            PodDevice("llm", "llama-0", "vllm", "nvidia.com/gpu", g.uuid) for g in server.gpus
        ],
        # The kubelet's container log links name each worker's pod and container.
        log_pods={"pod-uid": ("llm", "llama-0")},
        log_containers={"container-id": "vllm"},
        logs_folder="/var/log/containers",
    )
    sample.process_containers = [
        ProcessContainerReading(p.pid, "container", "pod-uid", "container-id") for p in workers
    ]
    return sample


def source_names(mode: str, config: Config) -> list[str]:
    """The sources a real endpoint of this mode reads with this config."""
    reads = set(MODES[mode].reads)
    names = [k.name for k in SOURCE_KINDS if k.provides & reads and k.enabled(config)]
    return ["agents", *names] if mode == "run" else names


def exposition(
    sample: Sample,
    mode: str,
    detectors: Detectors | None,
    counts: list[ProcessCounts],
    config: Config | None = None,
) -> str:
    config = config or Config()
    sources = {name: SourceStatus(True) for name in source_names(mode, config)}
    state = ExporterState(sample, sources)
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    registry.register(
        SampleCollector(
            lambda: state,
            const_labels={},
            version="bench",
            traits=MODES[mode].traits,
            alerts=detectors,
            actions=lambda: ActionStats(processes=counts),
            detail=config.detail,
        )
    )
    return generate_latest(registry).decode()


def identities(text: str) -> dict[str, set[tuple[str, tuple[tuple[str, str], ...]]]]:
    """Series identities by family: (name, sorted labels)."""
    found: dict[str, set[tuple[str, tuple[tuple[str, str], ...]]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(family.name, set()).add((s.name, tuple(sorted(s.labels.items()))))
    return found


def endpoint(server_restarts: Iterable[str], gpus: int) -> dict[str, Any]:
    before, after = (identities(text) for text in server_restarts)
    ours = {f: ids for f, ids in before.items() if not _CLIENT_PYTHON.match(f)}
    every_before = {i for ids in before.values() for i in ids}
    every_after = {i for ids in after.values() for i in ids}
    series = sum(len(ids) for ids in ours.values())
    with_pid = sum(1 for ids in ours.values() for _, labels in ids if dict(labels).get("pid"))
    by_family = Counter({f: len(ids) for f, ids in ours.items()})
    return {
        "series": series,
        "series_with_client_python": len(every_before),
        "series_per_gpu": round(series / gpus, 1),
        "series_with_pid": with_pid,
        "changed_by_restart": len(every_after - every_before),
        "changed_by_restart_share": round(len(every_after - every_before) / len(every_after), 3),
        "by_family": dict(by_family.most_common()),
    }


# The demo server still serving well: its KV cache and weights loaded, 2.5 GiB of its 9.2 GiB
# cache free, no OOM or retry yet; the next ticks' large allocation shatters the cache and the
# trace ends in the fragmentation OOMs. A fleet's quiet nodes stop here (bench.fleet
# --alerting-every), so that no alert of deploy/prometheus/alerts.yaml holds for them.
QUIET_TICKS = 72


def expositions(gpus: int, detail: str = "basic", ticks: int | None = None) -> dict[str, list[str]]:
    """The run endpoint's and the node daemon's text, before and after a restart: the state the
    whole demo trace leaves, or its first `ticks` ticks'."""
    config = Config(detail=detail)
    _, trace = read_trace(demo_trace_path())
    trace = trace[:ticks]
    texts: dict[str, list[str]] = {"run": [], "node": []}
    for pid0 in (1000, 5000):  # the server, then the same server restarted
        detectors = Detectors(config, log_events=False)
        node_detectors = Detectors(config, log_events=False)
        for recorded in trace:  # alert states as a day of this trace leaves them
            server = server_sample(recorded, gpus, pid0)
            detectors(server)
            node_detectors(node_sample(server, recorded))
        counts = [ProcessCounts(a.process) for a in server.allocators]
        texts["run"].append(exposition(server, "run", detectors, counts, config))
        node = node_sample(server, recorded)
        node_counts = [ProcessCounts()]
        texts["node"].append(exposition(node, "node", node_detectors, node_counts, config))
    return texts


def measure_texts(gpus: int, detail: str = "basic", ticks: int | None = None) -> tuple[str, str]:
    """One node's run endpoint and node daemon texts (bench.fleet serves them per node)."""
    texts = expositions(gpus, detail, ticks)
    return texts["run"][0], texts["node"][0]


def measure(gpus: int, detail: str = "basic") -> dict[str, Any]:
    texts = expositions(gpus, detail)
    results = {name: endpoint(pair, gpus) for name, pair in texts.items()}
    trace_name = str(demo_trace_path().name)
    return {"gpus": gpus, "detail": detail, "trace": trace_name, "endpoints": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the node (TP degree)")
    parser.add_argument("--detail", choices=DETAIL_LEVELS, default="basic", help="GPUMEM_DETAIL")
    parser.add_argument("--out", type=Path, help="write the results as JSON here too")
    args = parser.parse_args()
    result = measure(args.gpus, args.detail)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    for name, r in result["endpoints"].items():
        print(
            f"{name}: {r['series']} series ({r['series_per_gpu']} per GPU; "
            f"{r['series_with_client_python']} with client_python's), {r['series_with_pid']} "
            f"with a pid; a restart changes {r['changed_by_restart']} identities "
            f"({100 * r['changed_by_restart_share']:.0f}%)"
        )


if __name__ == "__main__":
    main()
