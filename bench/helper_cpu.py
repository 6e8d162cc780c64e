"""What exporter.start()'s helper process costs: its CPU per second while it serves one process
at 1 Hz and answers one kept-alive `/metrics` scrape a second with Prometheus 3's headers
(OpenMetrics, gzip), as Prometheus does. Each `--root` (a checkout) in alternating rounds.

    python -m bench.helper_cpu --root BEFORE --root . --rounds 3 --seconds 30

On the GPU machine the served process allocates on cuda:0 (real torch, NVML); elsewhere it uses
the torch double of the CPU tests (tests/support/fake_torch: its allocator stats move, there is
no NVML), a check of the helper's own Python, not a GPU figure. CPU is the helper's user and
system time over the window (psutil), ms per second. One JSON object on the last line.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
PATH = os.environ.get("PYTHONPATH", "")  # carried packages (the GPU machine's), after the root

_SERVER = """
import sys, threading, time
if sys.argv[3] == "fake":
    sys.path.insert(0, sys.argv[2] + "/tests/support/fake_torch")
import torch
if sys.argv[3] == "fake":
    torch.cuda.set_device(0)
else:
    def allocate():
        while True:
            kept = [torch.empty(4 << 20, dtype=torch.uint8, device="cuda:0") for _ in range(8)]
            del kept
            time.sleep(0.005)
    threading.Thread(target=allocate, daemon=True).start()
import exporter
handle = exporter.start(port=int(sys.argv[1]), interval_s=1.0)
print(handle.url, flush=True)
sys.stdin.read()
"""
_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
    "Accept-Encoding": "gzip",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _helper(port: int) -> psutil.Process:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for conn in psutil.net_connections("tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
                return psutil.Process(conn.pid)
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def measure(root: str, seconds: float, torch_kind: str) -> dict[str, Any]:
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(port), root, torch_kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, PATH]))},
    )
    try:
        assert server.stdout is not None
        server.stdout.readline()
        helper = _helper(port)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

        def scrape() -> None:
            conn.request("GET", "/metrics", headers=_HEADERS)
            conn.getresponse().read()

        for _ in range(3):  # past the first samples (imports, NVML's start)
            scrape()
            time.sleep(1.0)
        before, started = helper.cpu_times(), time.monotonic()
        scrapes = 0
        while time.monotonic() - started < seconds:
            scrape()
            scrapes += 1
            time.sleep(1.0)
        after, wall = helper.cpu_times(), time.monotonic() - started
        cpu = after.user + after.system - before.user - before.system
        return {"root": root, "helper_cpu_ms_per_s": cpu / wall * 1000, "scrapes": scrapes}
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", action="append", help="a checkout to measure (repeat)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    roots = [str(Path(root).resolve()) for root in args.root or [str(REPO)]]
    try:
        import torch

        kind = "real" if torch.cuda.is_available() else "fake"
    except ImportError:
        kind = "fake"
    results = []
    for round_ in range(args.rounds):
        for root in roots:
            result = {"round": round_, "torch": kind, **measure(root, args.seconds, kind)}
            results.append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
