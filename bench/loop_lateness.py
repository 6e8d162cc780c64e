"""What an embedded exporter costs an asyncio serving loop: the loop's lateness and the exporter
threads' CPU, before and after a change, in one run.

The serving process runs an asyncio loop that wakes every 1 ms (as vLLM's and SGLang's API
servers do) beside a thread that allocates and frees GPU memory; a scraper process reads
`/metrics` once a second over a kept-alive connection with Prometheus 3's headers (OpenMetrics,
gzip), as Prometheus does. Arms: `off` (no exporter), `probe-1Hz` and `probe-10Hz` (the floor:
a bare probe, see _bare_probe), `1Hz` and `10Hz` (`exporter.start()`: since issue 49 a probe
here and a helper process that serves), `1Hz+page` (the live page
open as well, polling its data once a second), `run-1Hz` and `run-10Hz` (under
`gpumem-exporter run`: the process's agent samples and sends, the launcher process serves),
each in a fresh
process, with the exporter package taken from `--root` (a checkout of the code to measure), in
alternating rounds so that drift falls on every arm alike.

    python -m bench.loop_lateness --root /path/to/before --root . --seconds 20 --rounds 3
    python -m bench.loop_lateness --root BEFORE:1Hz,10Hz --root . ...  (some arms of a tree)

Lateness: how much later than asked each 1 ms sleep woke (p99, p99.9, max). CPU: the exporter's
threads (named gpumem-*, each, and together) and the thread pool of the app's sync routes by
their CPU clocks, and the whole process, per second of the run; the garbage collector's pauses.
One JSON object on the last line. Without a GPU the loop runs with no allocating thread (a
check of the bench itself, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.helper_cpu import _threads, listening_process

REPO = Path(__file__).resolve().parent.parent
# arm -> (sampling interval, whether the live page is open beside the scrapes, whether the
# process runs under `gpumem-exporter run`: its agent samples, the launcher serves)
ARMS = {
    "off": (None, False, False),
    "probe-1Hz": (1.0, False, False),
    "probe-10Hz": (0.1, False, False),
    "1Hz": (1.0, False, False),
    "10Hz": (0.1, False, False),
    "1Hz+page": (1.0, True, False),
    "run-1Hz": (1.0, False, True),
    "run-10Hz": (0.1, False, True),
}
# The bare probe's 47 numbers: what an exporter serves of the nested stats dict.
_BYTES = ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes")
_POOLS = ("all", "large_pool", "small_pool")
_COUNTS = ("segment", "allocation", "active", "inactive_split")
_SCALARS: tuple[str, ...] = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")
_SCALARS += ("num_sync_all_streams", "max_split_size")
_OVERSIZE = ("oversize_allocations", "oversize_segments")
_BARE_PATHS = (
    *((f, p, s) for f in _BYTES for p in _POOLS for s in ("current", "peak")),
    *(("requested_bytes", p, "current") for p in _POOLS),
    *((f, "all", s) for f in _COUNTS for s in ("current", "peak")),
    *((f, "", "") for f in _SCALARS),
    *((f, "all", s) for f in _OVERSIZE for s in ("current", "peak")),
)


def _number(stats: Any, family: str, pool: str, stat: str) -> int:
    """One number of the nested stats dict, -1 where this torch has none."""
    try:
        value = stats[family][pool][stat] if pool else stats[family]
    except KeyError:
        return -1
    return value if isinstance(value, int) else -1


def bare_tick() -> tuple[Any, Any]:
    """The bare probe's tick (the C call, 47 numbers, one struct pack, one non-blocking write
    to a pipe another process reads; no exporter code) and that reading process."""
    import struct

    import torch

    reader = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.buffer.read()"], stdin=subprocess.PIPE
    )
    assert reader.stdin is not None
    fd = reader.stdin.fileno()
    os.set_blocking(fd, False)
    read = torch._C._cuda_memoryStats
    pack = struct.Struct("<" + "q" * len(_BARE_PATHS)).pack

    def tick() -> None:
        stats = read(0)
        values = [_number(stats, f, p, s) for f, p, s in _BARE_PATHS]
        with contextlib.suppress(BlockingIOError):  # dropped, never waited for
            os.write(fd, pack(*values))

    return tick, reader


def _cpu_s(process: Any) -> float | None:
    """A process's CPU seconds (user and system), None if it is gone or unknown: the sum of
    its threads' nanosecond counts (bench.helper_cpu._threads). psutil's cpu_times() counts
    in clock ticks (10 ms), so a helper's ~25 ms over a 10 s arm read as 1.0 or 2.0 ms/s."""
    if process is None:
        return None
    try:
        return sum(ns for ns, _ in _threads(process.pid).values()) / 1e9
    except (OSError, ValueError):
        return None


def _helper_link(handle: Any) -> Any:
    """The handle's link to its helper: `_link` since issue 63, `_probe` in a tree before."""
    return getattr(handle, "_link", None) or getattr(handle, "_probe", None)


def _delivered(handle: Any, under_run: bool) -> dict[str, Any]:
    """The agent's counts of what it sent (and whether it is connected): under `run`, the
    module's agent; with a helper (exporter.start() since issue 49), the handle's link's."""
    module = sys.modules.get("exporter.run.agent")
    found = getattr(module, "_agent", None) if under_run and module is not None else None
    link = _helper_link(handle) if handle is not None else None
    if found is None and link is not None:
        found = link.agent
    if found is None:
        return {}
    counts: dict[str, Any] = {
        name: getattr(found, name, None)  # None: an agent before the probe
        for name in ("full_samples", "records_sent", "records_dropped")
    }
    counts["connected"] = getattr(found, "_sock", None) is not None
    counts["link_error"] = getattr(link, "error", None) if link is not None else None
    return counts


def _bare_probe(interval_s: float, stop: Any, timing: TickTiming | None = None) -> Any:
    """The floor of exporting from inside a server: a thread that ticks bare_tick() at the
    interval. No exporter code at all."""
    import threading

    tick, reader = bare_tick()
    if timing is not None:
        tick = timing.timed(tick)

    def run() -> None:
        while not stop.wait(interval_s):
            tick()

    thread = threading.Thread(target=run, name="gpumem-bare-probe", daemon=True)
    thread.start()
    return reader


class TickTiming:
    """Each tick's CPU (its thread's clock) while `on` is set, by kind: the bare probe's
    ("bare"), or the agent's record tick ("record") and full sample ("full"). Two clock reads
    per tick, in every arm alike (--ticks): where a run's CPU per second goes, tick by tick."""

    def __init__(self) -> None:
        import threading

        self.on = threading.Event()
        self.cpu: dict[str, list[float]] = {}

    def timed(self, tick: Any, fulls: Any = None) -> Any:
        """`tick` timed; `fulls()` (the agent's full-sample count) tells a full tick."""
        import time

        clock = time.thread_time

        def timed_tick() -> None:
            if not self.on.is_set():
                tick()
                return
            before = fulls() if fulls is not None else None
            started = clock()
            try:
                tick()
            finally:
                took = clock() - started
                kind = "bare" if fulls is None else "record" if fulls() == before else "full"
                self.cpu.setdefault(kind, []).append(took)

        return timed_tick

    def time_agent(self, agent: Any) -> None:
        # The agent's thread calls self.tick() each time: the instance attribute wins.
        agent.tick = self.timed(agent.tick, lambda: agent.full_samples)

    def summary(self) -> dict[str, Any]:
        from bench.common import summary

        return {kind: summary(values, 1e6) for kind, values in self.cpu.items()}


# What Prometheus 3 sends: OpenMetrics first, gzip.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)


def _threads_cpu_s() -> dict[str, float]:
    """CPU seconds of this process's exporter threads (gpumem-*), and of the thread pool that
    runs the app's sync routes (the live page's data), by their CPU clocks."""
    import threading
    import time

    found: dict[str, float] = {}
    for thread in threading.enumerate():
        name = thread.name
        if name.startswith("AnyIO worker"):
            name = "anyio-workers"
        elif not name.startswith("gpumem") or thread.ident is None:
            continue
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))  # type: ignore[arg-type]
        except OSError:
            continue  # exited meanwhile
        found[name] = found.get(name, 0.0) + cpu
    return found


class GcPauses:
    """The garbage collector's pauses during the run (gc.callbacks), on whichever thread."""

    def __init__(self) -> None:
        import gc
        import time

        self.pauses: list[float] = []
        self._started = 0.0
        self._clock = time.perf_counter

        def callback(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                self._started = self._clock()
            else:
                self.pauses.append(self._clock() - self._started)

        gc.callbacks.append(callback)

    def summary(self, seconds: float) -> dict[str, float]:
        pauses = sorted(self.pauses)
        return {
            "collections_per_s": len(pauses) / seconds,
            "pause_ms_per_s": sum(pauses) / seconds * 1000,
            "max_pause_ms": (pauses[-1] * 1000) if pauses else 0.0,
        }


def serve(arm: str, seconds: float, port: int, time_ticks: bool = False) -> dict[str, Any]:
    """One arm in this process (the `--serve` entry): the loop, the allocating thread, and the
    exporter at the arm's interval."""
    import asyncio
    import threading
    import time
    import urllib.request

    import torch

    gpu = torch.cuda.is_available()
    if gpu:
        torch.empty(1, device="cuda:0")
    stop = threading.Event()

    def allocate() -> None:
        while gpu and not stop.is_set():
            kept = [torch.empty(4 << 20, dtype=torch.uint8, device="cuda:0") for _ in range(8)]
            del kept
            time.sleep(0.005)

    worker = threading.Thread(target=allocate, name="allocator", daemon=True)
    worker.start()
    handle = None
    # Seconds until /metrics served this process's allocator; None: it never did in 20 s
    # (an arm that measures an exporter that does not deliver must say so).
    first_sample_s: float | None = None
    interval, page, under_run = ARMS[arm]
    bare = arm.startswith("probe-")
    timing = TickTiming() if time_ticks else None
    probe_reader = _bare_probe(interval, stop, timing) if bare and interval is not None else None
    if interval is not None and not under_run and not bare:
        import exporter

        handle = exporter.start(port=port, interval_s=interval)
    clients = []
    if interval is not None and not bare:
        scrape = [sys.executable, "-c", _SCRAPER, f"http://127.0.0.1:{port}", str(seconds)]
        clients.append(subprocess.Popen([*scrape, "/metrics"]))
        if page:  # the live page polls its data once a second
            clients.append(subprocess.Popen([*scrape, "/api/window"]))
        waited = time.monotonic()
        deadline = waited + 20
        while time.monotonic() < deadline:  # this process's first allocator sample is in
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
                    if b"torch_cuda_reserved_bytes{" in r.read():
                        first_sample_s = time.monotonic() - waited
                        break
            except OSError:
                pass
            time.sleep(0.05)
        # The measurement is of the steady state: what the first sample set up (NVML, the
        # OOM observer, imports) is not a cost per second; it has happened by now.
        time.sleep(1.5)
    if timing is not None and not bare:
        timed = sys.modules.get("exporter.run.agent")
        agent = getattr(timed, "_agent", None) if under_run else None
        if agent is None and handle is not None:
            agent = _helper_link(handle).agent
        if agent is not None:
            timing.time_agent(agent)
    late: list[float] = []

    async def loop() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            asked = time.perf_counter()
            await asyncio.sleep(0.001)
            late.append(time.perf_counter() - asked - 0.001)

    threads_before, process_before = _threads_cpu_s(), time.process_time()
    server = listening_process(port) if interval is not None and not bare else None
    server_before = _cpu_s(server)
    gc_pauses = GcPauses()
    started = time.perf_counter()
    if timing is not None:
        timing.on.set()
    asyncio.run(loop())
    wall = time.perf_counter() - started
    if timing is not None:
        timing.on.clear()
    threads = {
        name: (cpu - threads_before.get(name, 0.0)) / wall * 1000
        for name, cpu in _threads_cpu_s().items()
    }
    cpu = sum(v for name, v in threads.items() if name.startswith("gpumem")) * wall / 1000
    process_cpu = time.process_time() - process_before
    server_after = _cpu_s(server)
    # The helper's (exporter.start()) or the launcher's (run) CPU: what serves this process.
    server_cpu = (
        (server_after - server_before) / wall * 1000
        if server_before is not None and server_after is not None
        else None
    )
    delivered = _delivered(handle, under_run)  # before stop(): what the window's agent sent
    stop.set()
    # Joined, not left to interpreter exit: a daemon thread still allocating while CUDA tears
    # down aborts the process (SIGABRT, seen once in 16 runs of the `off` arm, exporter absent).
    worker.join(timeout=10)
    for client in clients:
        client.wait(timeout=seconds + 30)
    if handle is not None:
        handle.stop()
    if probe_reader is not None:
        assert probe_reader.stdin is not None
        probe_reader.stdin.close()
        probe_reader.wait(timeout=10)
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
        "threads_cpu_ms_per_s": threads,
        "gc": gc_pauses.summary(wall),
        # The whole serving process (loop, allocating thread, exporter): its difference from
        # the `off` arm is what the exporter costs, threads it starts included.
        "process_cpu_ms_per_s": process_cpu / wall * 1000,
        "server_cpu_ms_per_s": server_cpu,
        # What its agent sent over the process's life so far, and whether it is connected.
        "agent": delivered,
        "first_sample_s": first_sample_s if interval is not None and not bare else None,
        # --ticks: each tick's CPU in the window, by kind (bare, record, full)
        **({"ticks_cpu_us": timing.summary()} if timing is not None else {}),
    }


# Once a second over one kept-alive connection, with Prometheus 3's headers.
_SCRAPER = f"""
import http.client, sys, time, urllib.parse
url = urllib.parse.urlsplit(sys.argv[1]); end = time.monotonic() + float(sys.argv[2])
conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
headers = {{"Accept": "{PROMETHEUS_ACCEPT}", "Accept-Encoding": "gzip"}}
while time.monotonic() < end:
    conn.request("GET", sys.argv[3], headers=headers); conn.getresponse().read(); time.sleep(1.0)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root",
        action="append",
        required=True,
        help="code to measure; ROOT:ARMS measures only those arms of it (a before tree's)",
    )
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    # 0: a free port for each arm. One port for all let an arm join (or be kept from its
    # port by) a helper an earlier arm or an earlier run left, of other code.
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--arms", default=",".join(ARMS), help="comma-separated, of " + ", ".join(ARMS)
    )
    parser.add_argument(
        "--ticks", action="store_true", help="each tick's CPU by kind (bare, record, full)"
    )
    args = parser.parse_args()
    if args.serve:
        print(json.dumps(serve(args.serve, args.seconds, args.port, args.ticks)), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="loop-lateness-") as links:
        compare(args, Path(links))


def exporter_only(root: str, links: Path) -> str:
    """A folder holding `root`'s exporter package alone (a link), to go first on the path:
    the measured tree gives the exporter, this checkout the bench. With `root` itself first,
    a tree from before a helper of the bench was added gave its own older bench, and every
    arm of it failed at its first import."""
    folder = links / str(len(list(links.iterdir())))
    folder.mkdir()
    (folder / "exporter").symlink_to(Path(root).resolve() / "exporter", target_is_directory=True)
    return str(folder)


def compare(args: argparse.Namespace, links: Path) -> None:
    from bench.common import free_port

    # The path it was given stays after the trees (the GPU machine's carried packages:
    # without them the helper could not start, and the arm measured a probe whose link never
    # connected).
    carried = os.environ.get("PYTHONPATH", "")
    results: list[dict[str, Any]] = []
    paths: dict[str, str] = {}
    for round_ in range(args.rounds):
        for given in args.root:
            root, _, only = given.partition(":")
            for arm in (only or args.arms).split(","):
                port = args.port or free_port()
                if root not in paths:
                    paths[root] = exporter_only(root, links)
                path = os.pathsep.join(filter(None, [paths[root], str(REPO), carried]))
                env = dict(os.environ, PYTHONPATH=path)
                command = [sys.executable, __file__, "--root", root, "--serve", arm]
                interval, _, under_run = ARMS[arm]
                if under_run:  # the launcher serves on the port; this process only samples
                    launcher = [sys.executable, "-m", "exporter.cli", "run", "--port"]
                    launcher += [str(port), "--interval-s", str(interval), "--"]
                    command = [*launcher, *command]
                out = subprocess.run(
                    [*command, "--seconds", str(args.seconds), "--port", str(port)]
                    + (["--ticks"] if args.ticks else []),
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
