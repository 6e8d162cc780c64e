"""Helpers shared by the benchmarks: statistics, a Python-bound decoder loop, a scraper."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def summary(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """Median, p99, min, max (times scale), and the count."""
    ordered = sorted(v * scale for v in values)
    if not ordered:
        return {"n": 0}
    return {
        "n": len(ordered),
        "median": statistics.median(ordered),
        "p50": ordered[len(ordered) // 2],
        "p99": ordered[min(int(len(ordered) * 0.99), len(ordered) - 1)],
        "min": ordered[0],
        "max": ordered[-1],
    }


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as exc:
        info["torch_error"] = str(exc)
    try:
        import pynvml

        pynvml.nvmlInit()
        info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        info["nvml"] = pynvml.nvmlSystemGetNVMLVersion()
    except Exception as exc:
        info["nvml_error"] = str(exc)
    info["cpus"] = os.cpu_count()
    return info


class Decoder:
    """A small bf16 decoder stepped token by token: many small kernels, Python-bound, the way
    naive inference servers run."""

    def __init__(self, hidden: int = 1024, layers: int = 8, device: str = "cuda:0") -> None:
        import torch

        self.torch = torch
        self.device = device
        g = torch.Generator(device=device).manual_seed(0)

        def w(*shape: int) -> Any:
            return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g) * 0.02

        self.layers = [
            {
                "qkv": w(hidden, 3 * hidden),
                "o": w(hidden, hidden),
                "up": w(hidden, 4 * hidden),
                "down": w(4 * hidden, hidden),
            }
            for _ in range(layers)
        ]
        self.hidden = hidden

    def request(self, batch: int, prompt: int, new_tokens: int, step_times: list[float]) -> int:
        """Generate new_tokens for a batch; append each step's wall time; return tokens made."""
        torch, h = self.torch, self.hidden
        x = torch.randn(batch, prompt, h, device=self.device, dtype=torch.bfloat16)
        kv = [x[..., :h] for _ in self.layers]
        step = x[:, -1:, :]
        for _ in range(new_tokens):
            started = time.perf_counter()
            for i, layer in enumerate(self.layers):
                qkv = step @ layer["qkv"]
                kv[i] = torch.cat([kv[i], qkv[..., h : 2 * h]], dim=1)
                attn = torch.softmax((qkv[..., :h] @ kv[i].transpose(1, 2)) / 32.0, dim=-1)
                step = (attn @ kv[i]) @ layer["o"] + step
                step = torch.nn.functional.gelu(step @ layer["up"]) @ layer["down"] + step
            step = step / (step.float().norm(dim=-1, keepdim=True).to(step.dtype) + 1)
            torch.cuda.synchronize(self.device)  # a server returns each token to its client
            step_times.append(time.perf_counter() - started)
        return batch * new_tokens


class Scraper:
    """Scrapes a URL every interval from a separate process as Prometheus does: one kept-alive
    connection (reopened only when the server closes it), `Accept-Encoding: gzip`. Records
    each scrape's latency; `stop()` returns the latencies in seconds."""

    CODE = r"""
import http.client, json, signal, sys, time, urllib.parse
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
url, interval, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
parts = urllib.parse.urlsplit(url)
conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
lat = []
deadline = time.monotonic() + 3600
try:
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        try:
            conn.request("GET", parts.path, headers={"Accept-Encoding": "gzip"})
            conn.getresponse().read()
            lat.append(time.perf_counter() - t0)
        except Exception:
            conn.close()
        time.sleep(max(interval - (time.perf_counter() - t0), 0))
finally:
    open(out, "w").write(json.dumps(lat))
"""

    def __init__(self, url: str, interval_s: float, out: Path) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.CODE, url, str(interval_s), str(out)]
        )

    def stop(self) -> list[float]:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        latencies: list[float] = json.loads(self.out.read_text()) if self.out.exists() else []
        return latencies


def scrape_times(url: str, count: int, *, reuse: bool) -> list[float]:
    """Wall time of `count` GETs, on one kept-alive connection (as Prometheus scrapes) or on
    a new connection each (as bench/scrape_latency did before, which hid Nagle's 40 ms)."""
    import http.client
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    times = []
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=10)
    for _ in range(count):
        if not reuse:
            conn.close()
        started = time.perf_counter()
        conn.request("GET", parts.path, headers={"Accept-Encoding": "gzip"})
        conn.getresponse().read()
        times.append(time.perf_counter() - started)
    conn.close()
    return times


def scrape_once(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        data: bytes = response.read()
        return data


def emit(result: dict[str, Any]) -> None:
    """Benchmarks print one JSON object as their last line."""
    print(json.dumps(result, default=str), flush=True)


def write_json(path: Path, result: dict[str, Any]) -> None:
    """The results as JSON at path, whole or not at all (a temp file renamed over it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


def read_status_line(sock: socket.socket) -> bytes:
    """Read until the answer's status line is in; b"" if the peer closed before one."""
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.partition(b"\r\n")[0]


def free_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 now, all different (their sockets are held until all are
    picked)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def wait_listening(port: int, what: str = "the demo", timeout_s: float = 30.0) -> None:
    """Until something accepts on 127.0.0.1:`port`; SystemExit saying `what` did not start."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"{what} did not start") from None
            time.sleep(0.1)
