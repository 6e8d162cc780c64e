"""What exporter.start()'s helper process costs: its CPU per second while it serves one process
at 1 Hz and answers one kept-alive `/metrics` scrape a second with Prometheus 3's headers
(OpenMetrics, gzip), as Prometheus does. Each `--root` (a checkout) in alternating rounds.

    python -m bench.helper_cpu --root BEFORE --root . --rounds 3 --seconds 30

On the GPU machine the served process allocates on cuda:0 (real torch, NVML); elsewhere it uses
the torch double of the CPU tests (tests/support/fake_torch: its allocator stats move, there is
no NVML), a check of the helper's own Python, not a GPU figure. CPU is the helper's user and
system time over the window, ms per second, from the kernel's nanosecond count of each of
its threads (/proc/PID/task/TID/schedstat), with how many times each ran (a wake-up costs
~0.1 ms of CPU on a VM). One JSON object on the last line.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from bench.common import free_port

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


def listening_process(port: int) -> psutil.Process | None:
    """The process listening on `port` (a helper, or `run`'s launcher), or None."""
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            return psutil.Process(conn.pid) if conn.pid else None
    return None


def _helper(port: int) -> psutil.Process:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        found = listening_process(port)
        if found is not None:
            return found
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def _threads(pid: int) -> dict[str, tuple[int, int]]:
    """Each thread's CPU in ns and how many times it ran (/proc/PID/task/TID/schedstat), by
    its order of start (threads of one role start in the same order in every checkout)."""
    found: dict[str, tuple[int, int]] = {}
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        try:
            ns, _, runs = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except (OSError, ValueError):
            continue  # ended meanwhile
        found[f"thread{len(found)}"] = (int(ns), int(runs))
    return found


@contextmanager
def served(
    root: str, torch_kind: str, first: str = "", env: dict[str, str] | None = None
) -> Iterator[tuple[psutil.Process, Callable[[], None]]]:
    """A server of `root`'s exporter.start() on a free port: its helper, and a kept-alive
    scrape as Prometheus 3 makes it. `first`: a folder put first on the path (a
    sitecustomize); `env`: more variables. The server is killed and reaped after."""
    port = free_port()
    path = os.pathsep.join(filter(None, [first, root, PATH]))
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(port), root, torch_kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=root,
        env={**os.environ, **(env or {}), "PYTHONPATH": path},
    )
    try:
        assert server.stdout is not None
        server.stdout.readline()
        helper = _helper(port)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

        def scrape() -> None:
            conn.request("GET", "/metrics", headers=_HEADERS)
            conn.getresponse().read()

        yield helper, scrape
        conn.close()
    finally:
        server.kill()
        server.wait()
        for pipe in (server.stdin, server.stdout):
            if pipe is not None:
                pipe.close()


def measure(root: str, seconds: float, torch_kind: str) -> dict[str, Any]:
    with served(root, torch_kind) as (helper, scrape):
        for _ in range(3):  # past the first samples (imports, NVML's start)
            scrape()
            time.sleep(1.0)
        before, threads_before = helper.cpu_times(), _threads(helper.pid)
        started = time.monotonic()
        scrapes = 0
        while time.monotonic() - started < seconds:
            scrape()
            scrapes += 1
            time.sleep(1.0)
        after, threads_after = helper.cpu_times(), _threads(helper.pid)
        wall = time.monotonic() - started
    cpu = after.user + after.system - before.user - before.system
    by_thread = {
        name: (
            round((ns - threads_before.get(name, (0, 0))[0]) / wall / 1e6, 3),
            round((runs - threads_before.get(name, (0, 0))[1]) / wall, 2),
        )
        for name, (ns, runs) in threads_after.items()
    }
    return {
        "root": root,
        # The kernel's nanosecond count of every thread (schedstat); the clock-tick
        # figure (psutil, 10 ms steps: +-0.5 ms/s over 20 s) beside it.
        "helper_cpu_ms_per_s": (
            sum(ms for ms, _ in by_thread.values()) if by_thread else cpu / wall * 1000
        ),
        "helper_cpu_ticks_ms_per_s": cpu / wall * 1000,
        "wakeups_per_s": round(sum(runs for _, runs in by_thread.values()), 2),
        "threads_ms_per_s_and_runs_per_s": by_thread,
        "scrapes": scrapes,
    }


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
