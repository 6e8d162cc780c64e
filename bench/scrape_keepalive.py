"""/metrics latency over one kept-alive connection, as Prometheus scrapes, before and after a
change, in one run. Needs no GPU: each tree serves the demo (`gpumem-exporter demo`, the
packaged H100 trace) in a process of its own, sampling at 1 Hz; a client asks with
Prometheus 3's headers (OpenMetrics, gzip) every `--every-s`, so a tenth of the scrapes at
0.1 s find a new tick to render. Trees alternate in rounds.

    python -m bench.scrape_keepalive --root /path/to/before --root . --rounds 3

One JSON object on stdout: per tree, the latency's p50, p99 and max (ms) of each round, and the
server's CPU per scrape (us): its CPU time while scraped, less its CPU time over as long a
time unscraped just after (the sampler's ticks and the idle loop), over the scrapes.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import free_port, summary
from bench.loop_lateness import PROMETHEUS_ACCEPT

REPO = Path(__file__).resolve().parent.parent


def measure(root: str, scrapes: int, every_s: float) -> dict[str, Any]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, str(REPO)]))
    server = subprocess.Popen(
        [sys.executable, "-m", "exporter.cli", "demo", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/readyz")
                response = conn.getresponse()
                response.read()
                if response.status == 200:
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        headers = {"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"}
        process = psutil.Process(server.pid)
        times = []
        phase_started, cpu_started = time.perf_counter(), _cpu_s(process)
        for _ in range(scrapes):
            started = time.perf_counter()
            conn.request("GET", "/metrics", headers=headers)
            conn.getresponse().read()
            times.append(time.perf_counter() - started)
            time.sleep(every_s)
        scraped_s = time.perf_counter() - phase_started
        scraped_cpu_s = _cpu_s(process) - cpu_started
        cpu_started = _cpu_s(process)
        time.sleep(scraped_s)  # as long again, unscraped (the connection kept)
        idle_cpu_s = _cpu_s(process) - cpu_started
        conn.close()
        result = summary(times[10:], 1e3)
        result["cpu_per_scrape_us"] = round((scraped_cpu_s - idle_cpu_s) / scrapes * 1e6, 1)
        return result
    finally:
        server.terminate()
        server.wait(timeout=30)


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", action="append", required=True, help="code to measure")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scrapes", type=int, default=300)
    parser.add_argument("--every-s", type=float, default=0.1)
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {root: [] for root in args.root}
    for _ in range(args.rounds):
        for root in args.root:
            results[root].append(measure(root, args.scrapes, args.every_s))
            print(json.dumps({root: results[root][-1]}), file=sys.stderr, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
