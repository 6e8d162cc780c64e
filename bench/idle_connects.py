"""Idle connects against the demo server: what they cost its memory, and whether it comes back.

Rounds of TCP connects that never send a byte (no ClientHello on TLS, no request on plain
HTTP), held --hold-s, then closed; the server's RSS after each round and --after-s after the
last, as issue 64 measured them (2,000, 2,000, 2,000 then 5,000, held 4 s). One scrape per
round checks that scrapes still get in. Each --root (a checkout) in turn, TLS and plain.

    python -m bench.idle_connects --root BEFORE --root .

One JSON object per server on stderr, all of them on the last line of stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import free_port

REPO = Path(__file__).resolve().parent.parent


def _pki(folder: Path) -> tuple[Path, ssl.SSLContext]:
    """A web config serving a certificate of a fresh CA, and a client context trusting it."""
    sys.path.insert(0, str(REPO))
    from tests.support.pki import Authority, web_config

    ca = Authority(folder / "pki")
    pair = ca.issue("server")
    config = web_config(
        folder, f"tls_server_config:\n  cert_file: {pair.cert}\n  key_file: {pair.key}\n"
    )
    return config, ssl.create_default_context(cafile=str(ca.cert))


def _scrape(port: int, context: ssl.SSLContext | None) -> int:
    connection: http.client.HTTPConnection = (
        http.client.HTTPSConnection("localhost", port, context=context, timeout=10)
        if context is not None
        else http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    )
    try:
        connection.request("GET", "/metrics")
        return connection.getresponse().status
    except OSError:
        return 0
    finally:
        connection.close()


def measure(
    root: str, tls: bool, rounds: list[int], hold_s: float, after_s: float
) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="idle-connects-"))
    config, context = _pki(folder)
    port = free_port()
    args = [sys.executable, "-m", "exporter.cli", "demo", "--port", str(port)]
    if tls:
        args += ["--web-config-file", str(config)]
    server = subprocess.Popen(args, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = context if tls else None
    try:
        deadline = time.monotonic() + 30
        while _scrape(port, client) != 200:
            if time.monotonic() > deadline:
                raise SystemExit("the demo did not start")
            time.sleep(0.2)
        process = psutil.Process(server.pid)
        time.sleep(1.0)
        mb = lambda: round(process.memory_info().rss / 2**20, 1)  # noqa: E731
        result: dict[str, Any] = {"root": root, "tls": tls, "start_mb": mb(), "rounds": []}
        for count in rounds:
            held = []
            for _ in range(count):
                with contextlib.suppress(OSError):
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            time.sleep(hold_s)
            status = _scrape(port, client)
            for sock in held:
                sock.close()
            result["rounds"].append({"connects": count, "rss_mb": mb(), "scrape": status})
        time.sleep(after_s)
        result["after_mb"] = mb()
        result["grown_mb"] = round(result["after_mb"] - result["start_mb"], 1)
        return result
    finally:
        server.terminate()
        server.wait(15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", action="append", help="a checkout to measure (repeat)")
    parser.add_argument("--rounds", default="2000,2000,2000,5000")
    parser.add_argument("--hold-s", type=float, default=4.0)
    parser.add_argument("--after-s", type=float, default=8.0)
    args = parser.parse_args()
    roots = [str(Path(root).resolve()) for root in args.root or [str(REPO)]]
    rounds = [int(n) for n in args.rounds.split(",")]
    results = []
    for tls in (True, False):
        for root in roots:
            result = measure(root, tls, rounds, args.hold_s, args.after_s)
            results.append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
