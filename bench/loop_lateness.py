"""What an embedded exporter costs an asyncio serving loop: the loop's lateness and the exporter
threads' CPU, before and after a change, in one run.

The serving process runs an asyncio loop that wakes every 1 ms (as vLLM's and SGLang's API
servers do) beside a thread that allocates and frees GPU memory; a scraper process reads
`/metrics` once a second over a kept-alive connection, as Prometheus does. Arms: `off` (no
exporter), `1Hz` and `10Hz` (`exporter.start()`), each in a fresh process, with the exporter
package taken from `--root` (a checkout of the code to measure), in alternating rounds so that
drift falls on every arm alike.

    python -m bench.loop_lateness --root /path/to/before --root . --seconds 20 --rounds 3

Lateness: how much later than asked each 1 ms sleep woke (p99, p99.9, max). CPU: the exporter's
threads (named gpumem-*) by their CPU clocks, and the whole process, per second of the run. One
JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ARMS = {"off": None, "1Hz": 1.0, "10Hz": 0.1}


def _thread_cpu_s(prefix: str) -> float:
    """CPU seconds of this process's Python threads named prefix* (their CPU clocks, as
    bench/serving_impact.py reads them)."""
    import threading
    import time

    total = 0.0
    for thread in threading.enumerate():
        if not thread.name.startswith(prefix) or thread.ident is None:
            continue
        try:
            total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except OSError:
            continue  # exited meanwhile
    return total


def serve(arm: str, seconds: float, port: int) -> dict[str, Any]:
    """One arm in this process (the `--serve` entry): the loop, the allocating thread, and the
    exporter at the arm's interval."""
    import asyncio
    import threading
    import time
    import urllib.request

    import torch

    torch.empty(1, device="cuda:0")
    stop = threading.Event()

    def allocate() -> None:
        while not stop.is_set():
            kept = [torch.empty(4 << 20, dtype=torch.uint8, device="cuda:0") for _ in range(8)]
            del kept
            time.sleep(0.005)

    worker = threading.Thread(target=allocate, name="allocator", daemon=True)
    worker.start()
    handle = None
    interval = ARMS[arm]
    if interval is not None:
        import exporter

        handle = exporter.start(port=port, interval_s=interval)
    scraper = None
    if handle is not None:
        scraper = subprocess.Popen(
            [sys.executable, "-c", _SCRAPER, f"http://127.0.0.1:{port}/metrics", str(seconds)]
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the first sample is in
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1).read()
                break
            except OSError:
                time.sleep(0.05)
    late: list[float] = []

    async def loop() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            asked = time.perf_counter()
            await asyncio.sleep(0.001)
            late.append(time.perf_counter() - asked - 0.001)

    cpu_before, process_before = _thread_cpu_s("gpumem"), time.process_time()
    started = time.perf_counter()
    asyncio.run(loop())
    wall = time.perf_counter() - started
    cpu = _thread_cpu_s("gpumem") - cpu_before
    process_cpu = time.process_time() - process_before
    stop.set()
    if scraper is not None:
        scraper.wait(timeout=seconds + 30)
    if handle is not None:
        handle.stop()
    late.sort()
    n = len(late)
    return {
        "arm": arm,
        "wakeups": n,
        "lateness_ms": {
            "p99": late[int(n * 0.99)] * 1000,
            "p99.9": late[int(n * 0.999)] * 1000,
            "max": late[-1] * 1000,
        },
        "exporter_cpu_ms_per_s": cpu / wall * 1000,
        # The whole serving process (loop, allocating thread, exporter): its difference from
        # the `off` arm is what the exporter costs, threads it starts included.
        "process_cpu_ms_per_s": process_cpu / wall * 1000,
    }


_SCRAPER = """
import http.client, sys, time, urllib.parse
url = urllib.parse.urlsplit(sys.argv[1]); end = time.monotonic() + float(sys.argv[2])
conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
while time.monotonic() < end:
    conn.request("GET", url.path); conn.getresponse().read(); time.sleep(1.0)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", action="append", required=True, help="code to measure")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=9471)
    args = parser.parse_args()
    if args.serve:
        print(json.dumps(serve(args.serve, args.seconds, args.port)), flush=True)
        return
    results: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for root in args.root:
            for arm in ARMS:
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, str(REPO)]))
                command = [sys.executable, __file__, "--root", root, "--serve", arm]
                out = subprocess.run(
                    [*command, "--seconds", str(args.seconds), "--port", str(args.port)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                result = json.loads(out.stdout.strip().splitlines()[-1])
                results.append({"round": round_, "root": root, **result})
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
