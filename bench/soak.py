"""A soak at the network edge: the demo server (TLS and basic auth) and a helper of
`exporter.start()` under a mix of abuse for --minutes, their fds, threads and RSS sampled
every --every-s, and every answer to the honest clients checked.

Honest clients: Prometheus (a kept-alive `/metrics` with the right password every 0.5 s over
TLS, reconnecting after a failure), the kubelet (`/healthz` on a new connection every 0.5 s)
and a kept-alive scraper of the helper. Abuse, all the time: clients that send a request line
and wait (half requests, reconnecting), idle TLS connects in bursts, wrong passwords, plain
HTTP to the TLS port, and idle connects to the helper.

    python -m bench.soak --minutes 5

Each line on stderr is one sample; the last line of stdout is the summary (first, last and
highest of each figure per process, answers checked and wrong).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import free_port, wait_listening
from bench.helper_cpu import _SERVER as HELPER_HOST
from bench.helper_cpu import _helper

REPO = Path(__file__).resolve().parent.parent
USER, PASSWORD = "prometheus", "right-password"


def _web_config(folder: Path) -> tuple[Path, ssl.SSLContext]:
    sys.path.insert(0, str(REPO))
    import bcrypt

    from tests.support.pki import Authority, web_config

    ca = Authority(folder / "pki")
    pair = ca.issue("server")
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
    config = web_config(
        folder,
        f"tls_server_config:\n  cert_file: {pair.cert}\n  key_file: {pair.key}\n"
        f"basic_auth_users:\n  {USER}: {hashed}\n",
    )
    return config, ssl.create_default_context(cafile=str(ca.cert))


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.checked = 0
        self.wrong: dict[str, int] = {}

    def add(self, what: str, ok: bool) -> None:
        with self.lock:
            self.checked += 1
            if not ok:
                self.wrong[what] = self.wrong.get(what, 0) + 1


def _auth(password: str) -> dict[str, str]:
    token = base64.b64encode(f"{USER}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def prometheus(port: int, context: ssl.SSLContext, stop: threading.Event, tally: Tally) -> None:
    conn = None
    while not stop.wait(0.5):
        try:
            if conn is None:
                conn = http.client.HTTPSConnection("localhost", port, context=context, timeout=10)
            conn.request("GET", "/metrics", headers=_auth(PASSWORD))
            answer = conn.getresponse()
            body = answer.read()
            tally.add("server /metrics", answer.status == 200 and b"gpumem_exporter_build" in body)
        except (OSError, http.client.HTTPException):
            tally.add("server /metrics", False)
            conn = None


def kubelet(port: int, context: ssl.SSLContext, stop: threading.Event, tally: Tally) -> None:
    while not stop.wait(0.5):
        conn = http.client.HTTPSConnection("localhost", port, context=context, timeout=10)
        try:
            conn.request("GET", "/healthz")
            answer = conn.getresponse()
            tally.add("server /healthz", answer.status == 200 and b'"ok"' in answer.read())
        except (OSError, http.client.HTTPException):
            tally.add("server /healthz", False)
        finally:
            conn.close()


def helper_scraper(port: int, stop: threading.Event, tally: Tally) -> None:
    conn = None
    while not stop.wait(1.0):
        try:
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/metrics")
            answer = conn.getresponse()
            body = answer.read()
            tally.add("helper /metrics", answer.status == 200 and b"torch_cuda" in body)
        except (OSError, http.client.HTTPException):
            tally.add("helper /metrics", False)
            conn = None


def half_requests(port: int, stop: threading.Event, count: int) -> None:
    """`count` clients that send a request line, wait to be closed, and come back at once."""

    def one() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as s:
                s.settimeout(15)
                s.sendall(b"GET /metrics HTTP/1.1\r\n")
                s.recv(1024)

    for _ in range(count):
        threading.Thread(target=one, daemon=True).start()


def idle_bursts(port: int, stop: threading.Event, size: int, hold_s: float) -> None:
    while not stop.is_set():
        held = []
        for _ in range(size):
            with contextlib.suppress(OSError):
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        stop.wait(hold_s)
        for sock in held:
            sock.close()


def wrong_passwords(port: int, context: ssl.SSLContext, stop: threading.Event) -> None:
    n = 0
    while not stop.wait(0.05):
        n += 1
        conn = http.client.HTTPSConnection("localhost", port, context=context, timeout=10)
        with contextlib.suppress(OSError, http.client.HTTPException):
            conn.request("GET", "/metrics", headers=_auth(f"wrong-{n}"))
            conn.getresponse().read()
        conn.close()
        # And plain HTTP to the TLS port, told so in HTTP.
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as s:
            s.settimeout(5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            s.recv(1024)


def figures(process: psutil.Process) -> dict[str, float]:
    with process.oneshot():
        return {
            "fds": process.num_fds(),
            "threads": process.num_threads(),
            "rss_mb": round(process.memory_info().rss / 2**20, 1),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--every-s", type=float, default=15.0)
    parser.add_argument("--half", type=int, default=150, help="half-request clients")
    parser.add_argument(
        "--abuse", default="half,idle,wrong,helper-idle", help="which abuse (comma-separated)"
    )
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="soak-"))
    config, context = _web_config(folder)
    port, helper_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    demo = [sys.executable, "-m", "exporter.cli", "demo", "--port", str(port)]
    server = subprocess.Popen(
        [*demo, "--web-config-file", str(config)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    host = subprocess.Popen(
        [sys.executable, "-c", HELPER_HOST, str(helper_port), str(REPO), "fake"],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    stop = threading.Event()
    tally = Tally()
    samples: dict[str, list[dict[str, float]]] = {"server": [], "helper": []}
    try:
        assert host.stdout is not None
        host.stdout.readline()
        helper = _helper(helper_port)
        wait_listening(port)
        time.sleep(2.0)
        processes = {"server": psutil.Process(server.pid), "helper": helper}
        honest = [
            threading.Thread(target=prometheus, args=(port, context, stop, tally)),
            threading.Thread(target=kubelet, args=(port, context, stop, tally)),
            threading.Thread(target=helper_scraper, args=(helper_port, stop, tally)),
        ]
        chosen = args.abuse.split(",")
        abuse = {
            "idle": (idle_bursts, (port, stop, 1000, 4.0)),
            "helper-idle": (idle_bursts, (helper_port, stop, 300, 4.0)),
            "wrong": (wrong_passwords, (port, context, stop)),
        }
        for thread in honest:
            thread.start()
        for name, (target, targs) in abuse.items():
            if name in chosen:
                threading.Thread(target=target, args=targs, daemon=True).start()
        if "half" in chosen:
            half_requests(port, stop, args.half)
        end = time.monotonic() + args.minutes * 60
        while True:
            line: dict[str, Any] = {"t": round(args.minutes * 60 - (end - time.monotonic()))}
            for name, process in processes.items():
                samples[name].append(figures(process))
                line[name] = samples[name][-1]
            print(json.dumps(line), file=sys.stderr, flush=True)
            if time.monotonic() >= end:
                break
            time.sleep(min(args.every_s, max(0.0, end - time.monotonic())))
        stop.set()
        for thread in honest:
            thread.join(20)
    finally:
        stop.set()
        server.terminate()
        host.kill()
        server.wait(15)
        host.wait(15)
    summary: dict[str, Any] = {"minutes": args.minutes, "checked": tally.checked}
    summary["wrong"] = tally.wrong
    for name, rows in samples.items():
        summary[name] = {
            key: {"first": rows[0][key], "last": rows[-1][key], "max": max(r[key] for r in rows)}
            for key in rows[0]
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
