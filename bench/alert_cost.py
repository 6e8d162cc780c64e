"""What the slowest alert expressions cost by themselves: on an idle Prometheus holding an hour
of a fleet's series (issue 40).

bench.fleet times the rules while everything else runs; this separates the expression's own
cost from the contention. It writes one hour of the series `GpuMemExhaustionPredicted` and
`GpuMemFreeCacheShattered` read, for N GPUs shaped as bench.fleet's nodes (8 GPUs, each seen by
the server's and the node daemon's `gpu_memory_free_bytes`; the server's allocator series;
the node tier's recorded per-GPU maximum), turns it into a TSDB block with `promtool tsdb
create-blocks-from openmetrics`, starts Prometheus on it with no scrapes and no rules, and
times each alert's expression, each of its parts, and `GpuMemFreeCacheShattered` reading the
recorded maximum instead of aggregating the raw series (best of 5, as instant queries at the
block's last sample).

    python -m bench.alert_cost [--gpus 6000] [--out results.json]

Needs `prometheus` and `promtool` (apt-get install prometheus); no GPU.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import free_port, write_json
from bench.fleet import Prometheus, shipped_alert

SCRAPE_S = 15
GIB = 1 << 30

RAW_MAX = "max by (gpu_uuid) (gpu_memory_free_bytes)"
RECORDED_MAX = "cluster_gpu:gpu_memory_free_bytes:max"
# GpuMemExhaustionPredicted's three conditions, in the order its expression joins them.
EXHAUSTION_PARTS = ("free under 20% of total", "predict_linear over 1 h", "deriv over 10 min")


def expressions() -> dict[str, str]:
    """Each timed expression by name: the two alerts as shipped, the first one's conditions
    alone, the second one reading the recorded maximum."""
    exhaustion = str(shipped_alert("GpuMemExhaustionPredicted")["expr"])
    shattered = str(shipped_alert("GpuMemFreeCacheShattered")["expr"])
    parts = [part.strip() for part in exhaustion.split("\nand\n")]
    return {
        "GpuMemExhaustionPredicted": exhaustion,
        **{f"  {name}": part for name, part in zip(EXHAUSTION_PARTS, parts, strict=True)},
        "GpuMemFreeCacheShattered": shattered,
        "  reading the recorded per-GPU maximum": shattered.replace(RAW_MAX, RECORDED_MAX),
    }


def write_history(path: Path, gpus: int, end: int, history_s: int) -> None:
    """OpenMetrics text of the series the two alerts read: the free memory over `history_s`
    (the trend reads up to an hour), the others over ten minutes."""
    with path.open("w") as out:

        def family(name: str, rows: list[tuple[str, float]], span_s: int = 600) -> None:
            # Ten minutes where the expression reads instant values: only the free memory's
            # trend reads the whole hour.
            stamps = range(end - span_s + SCRAPE_S, end + 1, SCRAPE_S)
            out.write(f"# TYPE {name} gauge\n")
            for labels, base in rows:
                for i, t in enumerate(stamps):
                    # Moves like memory, without holding any alert.
                    out.write(f"{name}{{{labels}}} {base * (1 + 0.01 * (i % 7)):.0f} {t}\n")

        nvml, allocator, recorded = [], [], []
        for g in range(gpus):
            node, index = divmod(g, 8)
            gpu = f'gpu="{index}",gpu_uuid="GPU-{node:08x}-{index:04d}"'
            server = f'job="gpumem-pods",instance="node-{node}:8000",pod="llm-{node}"'
            daemon = f'job="gpumem-node",instance="node-{node}:9400"'
            nvml += [f"{server},{gpu}", f"{daemon},{gpu}"]
            allocator.append(f'{server},device="0",rank="{index}",{gpu}')
            recorded.append(f'gpu_uuid="GPU-{node:08x}-{index:04d}"')
        family("gpu_memory_free_bytes", [(s, 60 * GIB) for s in nvml], history_s)
        family("gpu_memory_total_bytes", [(s, 80 * GIB) for s in nvml])
        family("cluster_gpu:gpu_memory_free_bytes:max", [(s, 60 * GIB) for s in recorded])
        for name, value in (
            ("torch_cuda_default_pool_free_bytes", 9 * GIB),
            ("torch_cuda_largest_free_block_bytes", 2 * GIB),
            ("torch_cuda_memory_limit_bytes", 22 * GIB),
            ("torch_cuda_reserved_bytes", 21 * GIB),
        ):
            family(name, [(s, value) for s in allocator])
        out.write("# EOF\n")


def measure(gpus: int, history_s: int = 3600) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="gpumem-alert-cost-"))
    try:
        end = int(time.time()) // SCRAPE_S * SCRAPE_S
        history = folder / "history.om"
        write_history(history, gpus, end, history_s)
        server = folder / "server"  # Prometheus below keeps its TSDB in server/data
        blocks = ["promtool", "tsdb", "create-blocks-from", "openmetrics"]
        subprocess.run(
            [*blocks, str(history), str(server / "data")],
            check=True,
            capture_output=True,
        )
        history.unlink()
        prom = Prometheus(server, {"global": {"scrape_interval": "15s"}}, free_port())
        try:
            return {"gpus": gpus, "history_s": history_s, "seconds": _times(prom, end)}
        finally:
            prom.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _times(prom: Prometheus, end: int) -> dict[str, float]:
    held = prom.api("query", query="count(gpu_memory_free_bytes)", time=end)["result"]
    if not held:  # an empty answer costs nothing: the block must be where the queries look
        raise SystemExit("the written history is not where the queries look")
    found = {}
    for name, expr in expressions().items():
        runs = [prom.timed("query", query=expr, time=end) for _ in range(5)]
        errors = [r[2] for r in runs if r[2]]
        if errors:
            raise SystemExit(f"{name}: {errors[0]}")
        found[name] = round(min(r[0] for r in runs), 3)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=6000, help="GPUs of the fleet (default 6000)")
    parser.add_argument(
        "--history-s", type=int, default=3600, help="free memory's history (default one hour)"
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if args.gpus < 8 or not 600 <= args.history_s <= 86400:
        parser.error("--gpus must be at least 8, --history-s between 600 and 86400")
    result = measure(args.gpus, args.history_s)
    if args.out:
        write_json(args.out, result)
    print(f"{args.gpus} GPUs, {args.history_s} s of history, an idle Prometheus (best of 5):")
    for name, seconds in result["seconds"].items():
        print(f"  {name}: {seconds:.3f} s")


if __name__ == "__main__":
    main()
