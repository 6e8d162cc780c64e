"""Helpers the test modules share: no test module imports another."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from exporter.config import load_config
from exporter.http.server import HttpServer, create_app
from exporter.metrics import SampleCollector
from exporter.runtime import build_runtime
from exporter.sample import (
    AllocatorReading,
    ExporterState,
    GpuReading,
    ProcessGpuReading,
    Sample,
    SourceStatus,
)
from exporter.sources.replay import ReplaySource, derive_recorded_non_allocator
from tests.conftest import DATA_DIR


def decode_png(data: bytes) -> tuple[int, int, int, list[bytes]]:
    """(width, height, bytes per pixel, rows) of an 8-bit non-interlaced PNG, using zlib only."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    assert header is not None
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and interlace == 0, header
    bpp = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    stride = width * bpp
    raw = zlib.decompress(b"".join(idat))
    low7 = int.from_bytes(b"\x7f" * stride, "big")
    high1 = int.from_bytes(b"\x80" * stride, "big")
    rows: list[bytes] = []
    prev = bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind_, line = raw[start], raw[start + 1 : start + 1 + stride]
        if kind_ == 0:
            cur = line
        elif kind_ == 2:
            # "Up", the commonest filter: byte-wise addition mod 256 of whole rows at once.
            a, b = int.from_bytes(line, "big"), int.from_bytes(prev, "big")
            cur = (((a & low7) + (b & low7)) ^ ((a ^ b) & high1)).to_bytes(stride, "big")
        else:
            out = bytearray(line)
            for i in range(stride):
                left = out[i - bpp] if i >= bpp else 0
                up = prev[i]
                if kind_ == 1:
                    pred = left
                elif kind_ == 3:
                    pred = (left + up) >> 1
                else:  # Paeth
                    up_left = prev[i - bpp] if i >= bpp else 0
                    p = left + up - up_left
                    pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
                    pred = left if pa <= pb and pa <= pc else up if pb <= pc else up_left
                out[i] = (out[i] + pred) & 0xFF
            cur = bytes(out)
        rows.append(cur)
        prev = cur
    return width, height, bpp, rows


class FakeCuda:
    """Records every call so tests can prove which devices were touched."""

    def __init__(self, stats: dict, initialized: bool, contexts: set[int], count: int = 2):
        self.stats = stats
        self.initialized = initialized
        self.contexts = contexts
        self.count = count
        self.calls: list[tuple] = []

    def is_initialized(self):
        return self.initialized

    def device_count(self):
        return self.count

    def memory_stats_as_nested_dict(self, device=None):
        self.calls.append(("memory_stats_as_nested_dict", device))
        assert isinstance(device, int), "device index must always be explicit"
        return self.stats

    def get_allocator_backend(self):
        return "native"

    def get_device_properties(self, index):
        self.calls.append(("get_device_properties", index))
        return SimpleNamespace(uuid=f"0000-{index}")


def fake_torch(cuda: FakeCuda, with_context_api: bool = True):
    c = SimpleNamespace()
    if with_context_api:
        c._cuda_hasPrimaryContext = lambda i: i in cuda.contexts
    return SimpleNamespace(cuda=cuda, _C=c)


def captured_sample(name: str) -> Sample:
    """A sample as the exporter's own sources read it on the GPU machine."""
    data = json.loads((DATA_DIR / f"allocator_{name}.json").read_text())
    sample = Sample(
        timestamp=1.0,
        allocators=[AllocatorReading(**a) for a in data["exporter_allocators"]],
        gpus=[GpuReading(**g) for g in data["exporter_gpus"]],
        processes=[ProcessGpuReading(**p) for p in data["exporter_processes"]],
        self_pid=data["pid"],
    )
    # Captured before processes took their non-allocator bytes themselves: derived from the
    # capture's process list, read in the same tick, as a replay does.
    derive_recorded_non_allocator([sample])
    return sample


def render(sample: Sample | None, labels: dict | None = None, replay: bool = False) -> str:
    registry = CollectorRegistry()
    state = ExporterState(
        sample=sample,
        sources={"torch": SourceStatus(True, 1e-5, 0), "nvml": SourceStatus(False, 2e-5, 3)},
    )
    registry.register(
        SampleCollector(
            lambda: state,
            const_labels=labels or {},
            version="0.1.0",
            mode="demo" if replay else "embedded",
            torch_version="2.11.0",
            own_process=not replay,
        )
    )
    return generate_latest(registry).decode()


@contextlib.contextmanager
def served(tmp_path, **settings):
    """The demo's app on a real uvicorn server in this process (sockets, not a test client),
    with its sampler running as in production: a sample ticked once by hand goes stale after
    5 s, and /healthz then answers 503 (which, on a busy machine, a test setting up 70
    clients took for the guard's)."""
    app, runtime = make_app(tmp_path, **settings)
    server = HttpServer(app, "127.0.0.1", 0)
    runtime.sampler.start()
    server.start()
    try:
        deadline = time.monotonic() + 10
        while not server._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        yield server, runtime
    finally:
        server.stop()
        runtime.sampler.stop()


TOKEN = "s3cret-token"


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def make_app(tmp_path, mode="demo", **settings):
    settings.setdefault("admin_token", TOKEN)
    config = load_config(env={}, snapshot_dir=str(tmp_path / "snaps"), **settings)
    sources = [ReplaySource()] if mode == "demo" else []
    runtime = build_runtime(config, mode=mode, sources=sources)
    runtime.sampler.tick()
    return create_app(runtime), runtime


def only(response) -> dict:
    """The one process's result: every action answers a list, one entry outside `run`."""
    body = response.json()
    assert len(body["processes"]) == 1, body
    entry = body["processes"][0]
    assert entry["process"]["pid"] == str(os.getpid())
    return entry["result"] if entry["ok"] else entry


CLI = [sys.executable, "-m", "exporter.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_cli(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None, umask: int = -1
) -> subprocess.CompletedProcess:
    """Run the CLI; `env` replaces the environment, `umask` is the user's (-1: inherited)."""
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, umask=umask
    )


@contextmanager
def running(
    *args: str, env: dict[str, str] | None = None, wait_for: str = "/readyz"
) -> Iterator[str]:
    """Start `gpumem-exporter ARGS --port P`, wait for `wait_for` to answer 200, yield the
    base URL."""
    port = free_port()
    proc = subprocess.Popen(
        [*CLI, *args, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url + wait_for, timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"exporter did not start: {proc.stdout.read()}") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            # uvicorn re-raises the SIGTERM it handled once it has shut down cleanly.
            assert proc.wait(timeout=15) in (0, -signal.SIGTERM)
        finally:
            proc.kill()
