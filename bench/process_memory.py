"""Cost per tick of host memory per process under `gpumem-exporter run` (launcher side).

    python -m bench.process_memory [--children 8]

Starts a parent with N children (a server with N workers), then times the tree walk and the
whole ProcessMemorySource.read() (median of 5 x 200 calls). Needs no GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from exporter.sources.process_memory import ProcessMemorySource, process_tree

SERVER = (
    "import subprocess, sys, time\n"
    "workers = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])"
    " for _ in range({n})]\n"
    "time.sleep(120)\n"
)


def median_us(fn: object, calls: int = 200, repeats: int = 5) -> float:
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()  # type: ignore[operator]
        runs.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--children", type=int, default=8)
    args = parser.parse_args()
    parent = subprocess.Popen([sys.executable, "-c", SERVER.format(n=args.children)])
    try:
        time.sleep(1.5)
        source = ProcessMemorySource(lambda: process_tree(parent.pid))
        visible = sum(1 for name in os.listdir("/proc") if name.isdigit())
        print(f"processes visible: {visible}, in the tree: {len(source.read().host_processes)}")
        print(f"tree walk: {median_us(lambda: process_tree(parent.pid)):.0f} us per tick")
        print(f"whole read: {median_us(source.read):.0f} us per tick")
    finally:
        parent.kill()


if __name__ == "__main__":
    main()
