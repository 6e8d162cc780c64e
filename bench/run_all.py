"""Run every benchmark in a fresh process and collect their JSON into one file.

On the GPU machine, from the repository root:

    python3 -m bench.run_all --out bench-results.json
    python3 -m bench.report bench-results.json > docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = {
    "sampler_cost": [],
    "footprint": [],
    "scrape_latency": [],
    "serving_impact": [],
    "stalls": [],
    "layout_stall": ["--minute", "60"],
    "freshness_cost": [],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", choices=sorted(BENCHMARKS))
    parser.add_argument("--timeout-s", type=float, default=300)
    args = parser.parse_args()
    results: dict = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python3", "-m", "bench.run_all", *sys.argv[1:]]),
    }
    for name, extra in BENCHMARKS.items():
        if args.only and name not in args.only:
            continue
        started = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", f"bench.{name}", *extra],
                capture_output=True,
                text=True,
                timeout=args.timeout_s,
            )
            lines = proc.stdout.strip().splitlines()
            if proc.returncode == 0 and lines:
                results[name] = json.loads(lines[-1])
            else:
                results[name] = {"error": f"exit {proc.returncode}", "stderr": proc.stderr[-3000:]}
        except subprocess.TimeoutExpired:
            results[name] = {"error": f"timed out after {args.timeout_s} s"}
        results[name]["wall_s"] = round(time.perf_counter() - started, 1)
        print(
            f"{name}: {results[name]['wall_s']} s"
            f"{' ERROR ' + results[name]['error'] if 'error' in results[name] else ''}",
            flush=True,
        )
        args.out.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
