"""Slow and hostile clients against the scrape path (docs/reliability.md).

Starts the demo exporter, keeps one kept-alive scraper going (as Prometheus does) at 10 Hz,
and meanwhile opens SLOW connections that send half a request head and never the rest. It
reports how many scrapes answered, their latency, and how many connections the server held
(from its file descriptors), during and after the flood.

    python -m bench.slow_clients [--slow 1100] [--seconds 20]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

import psutil


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def held(server: psutil.Process, port: int) -> int:
    return sum(
        1
        for c in server.net_connections(kind="tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slow", type=int, default=1100, help="slow connections to open")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to scrape")
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "exporter.cli", "demo", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ},
    )
    latencies: list[float] = []
    failures: list[str] = []
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("the demo did not start") from None
                time.sleep(0.1)

        def scrape() -> None:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            while not stop.is_set():
                began = time.perf_counter()
                try:
                    connection.request("GET", "/metrics")
                    response = connection.getresponse()
                    response.read()
                    if response.status != 200:
                        failures.append(f"HTTP {response.status}")
                    latencies.append(time.perf_counter() - began)
                except (OSError, http.client.HTTPException) as exc:
                    failures.append(type(exc).__name__)
                    connection.close()  # reconnect, as Prometheus does
                    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                time.sleep(0.1)

        scraper = threading.Thread(target=scrape)
        scraper.start()
        slow, refused = [], 0
        for _ in range(args.slow):
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                slow.append(sock)
            except OSError:
                refused += 1
        time.sleep(1.0)
        process = psutil.Process(server.pid)
        held_during = held(process, port)
        time.sleep(max(args.seconds - 1.0, 0))
        stop.set()
        scraper.join()
        held_after = held(process, port)
        for sock in slow:
            sock.close()
        latencies.sort()
        print(
            json.dumps(
                {
                    "slow_connections_opened": len(slow),
                    "slow_connections_refused": refused,
                    "server_connections_held_1s_after_flood": held_during,
                    "server_connections_held_at_end": held_after,
                    "scrapes": len(latencies) + len(failures),
                    "scrapes_failed": len(failures),
                    "failure_kinds": sorted(set(failures)),
                    "scrape_p50_ms": round(latencies[len(latencies) // 2] * 1e3, 2),
                    "scrape_p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1e3, 2),
                    "scrape_max_ms": round(latencies[-1] * 1e3, 2),
                },
                indent=2,
            )
        )
    finally:
        stop.set()
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
