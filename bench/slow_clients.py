"""Slow and hostile clients against the scrape path (docs/reliability.md).

Starts the demo exporter and one kept-alive client that alternates /metrics and /healthz at
10 Hz (reconnecting after a failure, as Prometheus does; /healthz on a new connection each
time, as the kubelet does), and meanwhile:

- half-sent: opens --count connections that send half a request head and never the rest;
- slow-readers: opens --count connections that pipeline 400 requests for a 51 KB static file
  (the vendored uPlot; the figures in docs/reliability.md were taken with the page's script
  when it was one 35 KB file) and never read an answer;
- burst: --tries times, --count connections at once, each asking for /metrics; every
  connection's status line is kept (none: reset or closed without an answer).

It reports the probes answered and failed (and the first ten after the attack began), their
latency, and how many connections the server held (from its file descriptors).

    python -m bench.slow_clients half-sent [--count 1100] [--seconds 20]
    python -m bench.slow_clients slow-readers [--count 70]
    python -m bench.slow_clients burst [--count 300] [--tries 5]

--root DIR runs the exporter package found in DIR (an older version, for before/after).
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import psutil

from bench.common import free_port, read_status_line, wait_listening

HOST = b"Host: 127.0.0.1\r\n"


def held(server: psutil.Process, port: int) -> int:
    return sum(
        1
        for c in server.net_connections(kind="tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


class Prober:
    """Prometheus and the kubelet, alternating at 10 Hz: /metrics on one kept-alive
    connection (reconnecting after a failure), /healthz on a new connection each time."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.results: list[tuple[float, str, float]] = []  # (time, outcome, latency)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        scraper = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        while not self.stop.is_set():
            health = len(self.results) % 2 == 1
            connection = (
                http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                if health
                else scraper
            )
            began = time.perf_counter()
            try:
                connection.request("GET", "/healthz" if health else "/metrics")
                response = connection.getresponse()
                response.read()
                outcome = f"HTTP {response.status}"
            except (OSError, http.client.HTTPException) as exc:
                outcome = type(exc).__name__
                connection.close()  # the scraper reconnects on its next request
            if health:
                connection.close()
            self.results.append((time.monotonic(), outcome, time.perf_counter() - began))
            time.sleep(0.1)

    def summary(self, since: float) -> dict[str, Any]:
        after = [r for r in self.results if r[0] >= since]
        latencies = sorted(r[2] for r in after if r[1] == "HTTP 200")
        return {
            "probes": len(after),
            "probes_answered_200": len(latencies),
            "first_ten_answered_200": sum(r[1] == "HTTP 200" for r in after[:10]),
            "outcomes": dict(Counter(r[1] for r in after)),
            "p50_ms": round(latencies[len(latencies) // 2] * 1e3, 2) if latencies else None,
            "max_ms": round(latencies[-1] * 1e3, 2) if latencies else None,
        }


def status_line(port: int) -> str:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n" + HOST + b"Connection: close\r\n\r\n")
            line = read_status_line(sock)
        return line.decode(errors="replace") or "closed, no answer"
    except OSError as exc:
        return type(exc).__name__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["half-sent", "slow-readers", "burst"])
    parser.add_argument("--count", type=int, help="connections (1100, 70, 300 by mode)")
    parser.add_argument("--seconds", type=float, default=15.0, help="how long to probe")
    parser.add_argument("--tries", type=int, default=5, help="bursts")
    parser.add_argument("--root", help="run the exporter package in this folder")
    args = parser.parse_args()
    count = args.count or {"half-sent": 1100, "slow-readers": 70, "burst": 300}[args.mode]
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "exporter.cli", "demo", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=args.root or None,
    )
    result: dict[str, Any] = {"mode": args.mode, "count": count, "root": args.root or "."}
    try:
        wait_listening(port)
        process = psutil.Process(server.pid)
        prober = Prober(port)
        prober.thread.start()
        time.sleep(1.0)
        attack_began = time.monotonic()
        held_open: list[socket.socket] = []
        if args.mode == "burst":
            answers: Counter[str] = Counter()
            for _ in range(args.tries):
                lines: list[str] = []
                barrier = threading.Barrier(count)

                def client(lines: list[str] = lines, barrier: threading.Barrier = barrier) -> None:
                    barrier.wait()
                    lines.append(status_line(port))

                threads = [threading.Thread(target=client) for _ in range(count)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                answers.update(lines)
                time.sleep(1.0)
            result["burst_answers"] = dict(answers)
        else:
            request = (
                b"GET /metrics HTTP/1.1\r\n" + HOST
                if args.mode == "half-sent"
                else (b"GET /static/uplot/uPlot.iife.min.js HTTP/1.1\r\n" + HOST + b"\r\n") * 400
            )
            refused = 0
            for _ in range(count):
                try:
                    sock = socket.socket()
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                    sock.settimeout(5)
                    sock.connect(("127.0.0.1", port))
                    sock.sendall(request)
                    held_open.append(sock)
                except OSError:
                    refused += 1
            result["connections_opened"] = len(held_open)
            result["connections_refused"] = refused
            time.sleep(1.0)
            result["server_held_1s_after"] = held(process, port)
            time.sleep(max(args.seconds - 1.0, 0))
            result["server_held_at_end"] = held(process, port)
        prober.stop.set()
        prober.thread.join()
        result.update(prober.summary(attack_began))
        for sock in held_open:
            sock.close()
        print(json.dumps(result, indent=2))
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
