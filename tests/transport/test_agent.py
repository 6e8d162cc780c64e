"""The agent of `gpumem-exporter run` as a probe: between full samples it sends one packed
record per device and tick, which the aggregator lays over the device's latest full sample;
it never blocks to send one. A real Aggregator on a Unix socket, an Agent in this process
over a test double of torch serving the allocator dict captured on an H200."""

from __future__ import annotations

import base64
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exporter.actions.base import Target
from exporter.probe import record
from exporter.probe.allocator import AllocatorProbe
from exporter.transport import protocol
from exporter.transport.agent import SOCKET_NAME
from exporter.transport.aggregator import Aggregator
from tests.helpers import ProbedServer, thread_wakeups


def served(aggregator: Aggregator, timeout_s: float = 5.0, **wanted: int):
    """The aggregator's one reading once its gauges show `wanted`."""
    deadline = time.monotonic() + timeout_s
    while True:
        readings = aggregator.read().allocators
        if readings and all(readings[0].gauges.get(k) == v for k, v in wanted.items()):
            return readings[0]
        if time.monotonic() > deadline:
            pytest.fail(f"not served: {wanted}; have {readings[:1]}")
        time.sleep(0.02)


@contextlib.contextmanager
def probed(run_dir: Path, **settings: float) -> Iterator[tuple[ProbedServer, Aggregator, Any]]:
    """A real Aggregator in `run_dir` and the agent of a ProbedServer reporting to it."""
    server = ProbedServer()
    aggregator = Aggregator(run_dir)
    agent = server.agent(run_dir, **settings)
    try:
        yield server, aggregator, agent
    finally:
        agent.stop()
        aggregator.close()


def test_records_carry_each_ticks_numbers_over_the_full_sample(run_dir):
    with probed(run_dir) as (server, aggregator, agent):
        agent.tick()  # the first tick: the full sample (identity, settings, counts)
        allocated = server.stats["allocated_bytes"]["all"]["current"]
        first = served(aggregator, allocated_bytes=allocated)
        assert first.gpu_uuid == "GPU-0000-0" and server.full_ticks == 1
        for step in range(1, 4):
            server.allocate(1 << 20)
            agent.tick()
            reading = served(aggregator, allocated_bytes=allocated + step * (1 << 20))
        assert server.full_ticks == 1  # three records, no full sample
        # The pools' numbers come with each record too (three 1 MiB blocks: the small pool).
        small = reading.pools["small"]["allocated_bytes"]
        assert small == first.pools["small"]["allocated_bytes"] + 3 * (1 << 20)
        assert reading.pools["large"] == first.pools["large"]
        # Everything else of the full sample stays: identity, backend, counters.
        assert (reading.gpu_uuid, reading.backend) == (first.gpu_uuid, first.backend)
        assert reading.counters == first.counters
        pinned = aggregator.read().pinned_host[0]
        assert pinned.held_bytes == server.host_stats["allocated_bytes"]["current"]
        assert pinned.process["pid"] == first.process["pid"]


def test_a_retry_an_oom_or_a_command_brings_the_full_sample_at_once(run_dir):
    with probed(run_dir) as (server, _, agent):
        agent.tick()
        agent.tick()
        assert server.full_ticks == 1
        server.stats["num_alloc_retries"] += 1
        agent.tick()
        assert server.full_ticks == 2  # the retry's layout and counts go out now
        agent.tick()
        assert server.full_ticks == 2
        server.stats["num_ooms"] += 1
        agent.tick()
        assert server.full_ticks == 3
        agent._execute({"type": "command", "id": 1, "action": "reset_peak", "params": {}})
        agent.tick()
        assert server.full_ticks == 4  # the action's counts go out with the next tick


def test_a_verdict_that_comes_after_the_ooms_count_brings_the_full_sample_at_once(run_dir):
    """The OOM's count goes out with a record (a full sample follows at once) while the OOM
    observer is still taking its readings on the OOM-ing thread: its verdict, when it comes,
    brings the next full sample at the next tick, not at the detail interval (10 s)."""
    from exporter.oom_verdict import OomVerdict, decide

    with probed(run_dir) as (server, aggregator, agent):
        agent.tick()
        server.stats["num_ooms"] += 1
        agent.tick()  # the count moved: full sample, no verdict in it yet
        agent.tick()
        assert server.full_ticks == 2
        assert served(aggregator).last_oom is None
        verdict = decide(OomVerdict(0, time.time(), 1 << 30, device_free_bytes=0))
        agent.source.ooms.record(verdict)  # what the observer does when it is done
        agent.tick()
        assert server.full_ticks == 3
        deadline = time.monotonic() + 5
        while served(aggregator).last_oom is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert served(aggregator).last_oom.verdict == verdict.verdict
        agent.source.ooms.set_snapshot(0, verdict.timestamp, "20261127T000000Z-0a1b2c3d")
        agent.tick()  # the snapshot written after it: linked at the next tick too
        assert server.full_ticks == 4


def test_the_full_sample_comes_again_every_detail_interval(run_dir):
    with probed(run_dir, process_interval_s=0.2) as (server, _, agent):
        agent.tick()
        agent.tick()
        assert server.full_ticks == 1
        time.sleep(0.25)
        agent.tick()
        assert server.full_ticks == 2


def test_a_paced_sampler_ticks_on_the_aggregators_thread_as_the_process_reports(run_dir):
    """Aggregator.pace (the helper's and run's sampler): a report ticks it at once once 3/4
    of an interval has passed, on the thread that woke for the report; with no report it
    ticks 1.5 intervals after its last; a stopped sampler never ticks."""
    from exporter.sampler import Sampler

    ticks: list[tuple[float, str]] = []

    def heard(_sample: object) -> None:
        ticks.append((time.monotonic(), threading.current_thread().name))

    def ticked(count: int, within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while len(ticks) < count and time.monotonic() < deadline:
            time.sleep(0.005)
        return len(ticks) >= count

    with probed(run_dir) as (_, aggregator, agent):
        agent.tick()
        served(aggregator)
        # No source: stop() would close them, the aggregator among them.
        sampler = Sampler([], interval_s=0.8, listeners=[heard])
        aggregator.pace(sampler)
        assert ticked(1, 0.5)  # the first at once
        time.sleep(max(ticks[0][0] + 0.65 - time.monotonic(), 0.0))
        reported = time.monotonic()
        agent.tick()  # 0.65 s after its last tick: past 3/4 of 0.8
        assert ticked(2, 0.4)
        # Its tick follows the report, on the thread that took it; unpaced by reports, the
        # next would have come at 1.2 s, 0.55 s after the report.
        assert ticks[1][0] - reported < 0.3 and ticks[1][1] == "gpumem-aggregator"
        agent.tick()  # at once again: too soon after the last tick, no tick
        time.sleep(0.15)
        assert len(ticks) == 2
        assert ticked(3, 2.0)  # heard from or not, 1.5 intervals after its last
        assert 1.15 <= ticks[2][0] - ticks[1][0] < 1.7
        sampler.stop()
        agent.tick()
        time.sleep(1.3)
        assert len(ticks) == 3


def test_the_command_reader_sleeps_while_records_go_out(run_dir):
    """The thread that waits for the launcher's commands costs the serving process nothing
    per tick: it is not woken each time the launcher takes a record (it was, in recv())."""
    with probed(run_dir) as (server, aggregator, agent):
        agent.tick()
        [reader] = [t for t in threading.enumerate() if t.name == "gpumem-agent-commands"]
        served(aggregator)
        before = thread_wakeups(reader)
        for _ in range(30):
            server.allocate(1 << 20)
            agent.tick()
            time.sleep(0.005)  # the aggregator takes each record before the next one
        served(aggregator, allocated_bytes=server.stats["allocated_bytes"]["all"]["current"])
        assert agent.records_sent == 30
        assert thread_wakeups(reader) - before <= 2
        # It still wakes for what it waits for: a command reaches this process's actions,
        # which answer (that the test double's torch has no CUDA for them to act on).
        [result] = aggregator.command("reset_peak", {}, Target(), timeout_s=5.0)
        assert result.outcome == "unavailable", result


def test_a_process_nvml_lists_late_gets_its_outside_bytes_in_a_second_not_ten(run_dir):
    """The full sample comes every 10 s; a process NVML did not list at its first one (its
    context just made) gets the next when NonAllocatorReader reads again, not 10 s later."""
    import json
    from types import SimpleNamespace

    from exporter.sources.non_allocator import NonAllocatorReader
    from exporter.sources.torch_allocator import TorchAllocatorSource
    from tests.conftest import DATA_DIR
    from tests.support.nvml_double import FakeNvml

    capture = json.loads((DATA_DIR / "allocator_native.json").read_text())
    raw = capture["nvml_raw"]
    device = raw["devices"][0]
    (listed,) = device["processes"]
    listed["pid"] += 1  # not (yet) this process
    with probed(run_dir) as (server, aggregator, agent):
        server.cuda.get_device_properties = lambda index: SimpleNamespace(  # type: ignore[method-assign]
            uuid=device["uuid"]
        )
        probe = NonAllocatorReader(FakeNvml(raw), pid=lambda: capture["pid"])
        agent.source = TorchAllocatorSource(server.torch, layout_interval_s=0, non_allocator=probe)
        agent.interval_s = 1.0  # as at 1 Hz (the test still ticks it by hand)
        assert agent.detail_interval_s == 10.0
        agent.tick()
        assert served(aggregator).non_allocator_bytes is None
        assert agent._next_full - time.monotonic() <= 1.0  # the next tick, not 10 s away
        listed["pid"] -= 1  # NVML lists it now
        time.sleep(0.6)
        agent._next_full = min(agent._next_full, time.monotonic())  # its time has come
        agent.tick()
        assert server.full_ticks == 2
        reserved = server.stats["reserved_bytes"]["all"]["current"]
        deadline = time.monotonic() + 5
        while served(aggregator).non_allocator_bytes is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert served(aggregator).non_allocator_bytes == listed["usedGpuMemory"] - reserved
        assert agent._next_full - time.monotonic() > 9.0  # back to every 10 s


def tick_until_dropping(agent: Any, conn: socket.socket, ticks: int, peer: str) -> float:
    """Tick until more than 10 messages were dropped (the other end reads nothing); the
    slowest tick. Fails the test if a tick blocks."""
    slowest = [0.0]

    def run() -> None:
        for _ in range(ticks):
            started = time.perf_counter()
            agent.tick()
            slowest[0] = max(slowest[0], time.perf_counter() - started)
            if agent.records_dropped > 10:
                return

    ticking = threading.Thread(target=run, daemon=True)
    ticking.start()
    ticking.join(20.0)
    if ticking.is_alive():
        conn.close()  # let the blocked send fail, so the thread ends
        pytest.fail(f"a tick blocked on {peer}")
    return slowest[0]


def drained(conn: socket.socket) -> bytes:
    """What the other end had sent, all of it, without waiting for more."""
    conn.setblocking(False)
    received = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := conn.recv(1 << 20):
            received += chunk
    return received


def test_a_launcher_that_does_not_read_never_blocks_the_probe(run_dir):
    """The launcher's loop stalls (here: a socket nobody reads). Each tick still returns at
    once; what does not fit is dropped and counted, and the lines that did go stay whole."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(run_dir / SOCKET_NAME))
    listener.listen(1)
    server = ProbedServer()
    agent = server.agent(run_dir)
    conn = None
    try:
        agent.tick()  # connects; hello and the full sample fit in an empty buffer
        conn, _ = listener.accept()
        slowest = tick_until_dropping(agent, conn, 5000, "a launcher that does not read")
        assert agent.records_dropped > 10
        assert slowest < 0.5, slowest
        received = drained(conn)
        reader = protocol.StreamReader()
        records = [m for m in reader.feed(received) if m[:4] == record.MAGIC]
        assert len(records) > 10
        for data in records:  # whole: the last one cut where the buffer filled waits
            assert record.unpack(data)[0] == 0
    finally:
        agent.stop()
        if conn is not None:
            conn.close()
        listener.close()


def test_full_samples_never_block_the_probe_on_a_helper_that_does_not_read(run_dir):
    """Issue 63 item 4: a helper stopped (SIGSTOP) or behind. Every tick a full sample (the
    largest message): each tick returns at once, what does not fit is dropped and counted,
    and every message that went out is whole. (A blocking sendall held the probe thread for
    as long as the helper was stopped, and command replies behind it.)"""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(run_dir / SOCKET_NAME))
    listener.listen(1)
    server = ProbedServer()
    agent = server.agent(run_dir)
    agent.detail_interval_s = 0.0  # a full sample at every tick
    conn = None
    try:
        agent.tick()
        conn, _ = listener.accept()

        tick_until_dropping(agent, conn, 20000, "a helper that does not read")
        assert agent.records_dropped > 10 and agent.full_samples > 10
        lines = [m for m in protocol.StreamReader().feed(drained(conn)) if m[:1] == b"{"]
        samples = [protocol.decode(line) for line in lines]  # each whole JSON
        assert len(samples) > 10 and all(m["type"] in ("hello", "sample") for m in samples)
    finally:
        agent.stop()
        if conn is not None:
            conn.close()
        listener.close()


def test_the_probe_threads_sleep_is_ended_early_by_a_verdict_without_stopping():
    from exporter.transport.agent import _Stop

    stop = _Stop()
    woke: list[tuple[bool, float]] = []
    sleeper = threading.Thread(target=lambda: woke.append((stop.sleep(60.0), time.monotonic())))
    sleeper.start()
    time.sleep(0.1)
    woken_at = time.monotonic()
    stop.wake()
    sleeper.join(5)
    assert woke and woke[0][0] is False and woke[0][1] - woken_at < 1.0
    started = time.monotonic()
    assert stop.sleep(0.05) is False  # the next sleep is whole again
    assert time.monotonic() - started >= 0.05
    stop.set()
    assert stop.sleep(5.0) is True


def test_a_record_of_another_version_is_refused_and_counted_never_misread(run_dir):
    aggregator = Aggregator(run_dir)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(run_dir / SOCKET_NAME))
    try:
        allocator = {"device": 0, "gpu_uuid": "GPU-x", "backend": "native",
                     "expandable_segments": False, "gauges": {"allocated_bytes": 5}}  # fmt: skip
        for message in (
            {"type": "hello", "version": 1, "process": {"role": "w"}},
            {"type": "sample", "allocators": [allocator]},
        ):
            conn.sendall(protocol.encode(message))
        served(aggregator, allocated_bytes=5)
        values = [record.ABSENT] * len(record.FIELDS)
        values[0] = 7  # allocated_bytes, as version 1 places it
        newer = bytearray(record.pack(0, 1, time.time(), values, []))
        newer[4:6] = (record.VERSION + 1).to_bytes(2, "little")
        newer += b"\0" * 8  # and longer: its size says so, and the stream stays in step
        newer[6:8] = len(newer).to_bytes(2, "little")
        conn.sendall(bytes(newer))
        conn.sendall(b"R" + base64.b64encode(record.pack(0, 1, time.time(), values, [])) + b"\n")
        short = bytearray(record.pack(0, 1, time.time(), values, []))[:-8]
        short[6:8] = len(short).to_bytes(2, "little")  # its size agrees, its layout does not
        conn.sendall(bytes(short))
        deadline = time.monotonic() + 5
        while sum(aggregator.rejected.values()) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert aggregator.rejected["record_version"] == 2  # this one's next, and version 1's
        assert aggregator.rejected["record"] == 1
        assert all(r.gauges.get("allocated_bytes") != 7 for r in aggregator.read().allocators)
        # A record of this version for a device with no full sample is out of order.
        conn.sendall(record.pack(3, 2, time.time(), values, []))
        while aggregator.rejected["order"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert aggregator.rejected["order"] == 1
    finally:
        conn.close()
        aggregator.close()


def test_the_probe_never_reads_a_device_this_process_did_not_initialize():
    server = ProbedServer()
    server.cuda.count = 2  # device 1 exists; this process has no context on it
    probe = AllocatorProbe(server.torch)
    assert probe.records() == []  # not configured by a full read yet: nothing
    probe.configure("native", False)
    [data] = probe.records()
    assert record.unpack(data)[0] == 0
    assert server.cuda.calls == []  # the C call only, never the Python wrapper


def test_the_record_reader_is_compiled_again_only_when_the_settings_change():
    """Every full sample configures the probe; compiling its reader costs more than a whole
    record, so it happens only where the backend or expandable segments changed, while the
    devices are worked out again each time (a device initialized later joins)."""
    server = ProbedServer()
    server.cuda.count = 2
    probe = AllocatorProbe(server.torch)
    probe.configure("native", False)
    compiled = probe._pack
    assert [record.unpack(d)[0] for d in probe.records()] == [0]
    server.cuda.contexts.add(1)  # the server starts using device 1
    probe.configure("native", False)
    assert probe._pack is compiled
    assert [record.unpack(d)[0] for d in probe.records()] == [0, 1]
    probe.configure("native", True)  # expandable segments turned on
    assert probe._pack is not compiled
    [data, _] = probe.records()
    assert record.unpack(data)[3]["gauges"].get("inactive_split_bytes") is None


def test_dropped_records_are_served_only_once_a_process_dropped_one():
    """Not even the family's HELP before: an endpoint's text stays what it was (the
    exposition digests) until a probe had to drop a record."""
    from prometheus_client import CollectorRegistry, generate_latest

    from tests.helpers import captured_sample, catalog_collector

    for per_process, dropped in ((False, 0), (True, 3)):  # catalog_collector's counts
        registry = CollectorRegistry()
        registry.register(catalog_collector(captured_sample("native"), "run", {}, per_process))
        text = generate_latest(registry).decode()
        assert ("gpumem_exporter_probe_records_dropped_total" in text) is bool(dropped)
        if dropped:
            assert 'gpumem_exporter_probe_records_dropped_total{local_rank="0"' in text


def test_a_component_named_goes_out_at_the_next_tick_with_its_problems(run_dir):
    """exporter.component() in the serving process: the full sample carries it at the next
    tick (not at the detail interval), the helper's reading has it, the ledger sums."""
    from exporter.components import Components
    from exporter.ledger import ledger

    with probed(run_dir) as (server, aggregator, agent):
        current = server.stats["allocated_bytes"]["all"]
        components = Components(lambda: {0: current["current"]})
        agent.source.components = components
        agent.tick()
        agent.tick()
        assert server.full_ticks == 1
        with components.measure("weights"):
            server.allocate(3 << 30)
            server.stats["reserved_bytes"]["all"]["current"] += 3 << 30  # a new segment
        with components.measure("scratch"):
            server.allocate(-(1 << 20))  # freed more than it took: a problem, counted
        agent.tick()
        assert server.full_ticks == 2
        deadline = time.monotonic() + 5
        while not served(aggregator).components:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        reading = served(aggregator)
        assert reading.components == {"weights": 3 << 30}
        parts = dict(ledger(reading))
        assert parts["weights"] == 3 << 30
        assert sum(parts.values()) == reading.gauges["reserved_bytes"]  # no NVML here
        [counts] = aggregator.action_counts()
        assert counts.counts.component_problems == {"negative_growth": 1}


def test_the_probe_threads_sleep_ends_at_once_when_stopped_and_stays_ended():
    """The agent sleeps between ticks on a held lock (one C call a wake-up, not Event.wait's
    Python): stop() must still end a long sleep at once, and every later one."""
    from exporter.transport.agent import _Stop

    stop = _Stop()
    started = time.monotonic()
    assert stop.sleep(0.05) is False  # not stopped: the whole interval
    assert time.monotonic() - started >= 0.05
    woke: list[float] = []
    sleeper = threading.Thread(target=lambda: woke.append(stop.sleep(60.0) and time.monotonic()))
    sleeper.start()
    time.sleep(0.1)
    stopped_at = time.monotonic()
    stop.set()
    sleeper.join(5)
    assert woke and woke[0] - stopped_at < 1.0
    started = time.monotonic()
    assert stop.sleep(5.0) is True  # at once, again
    stop.set()  # twice: no error
    assert stop.sleep(5.0) is True
    assert time.monotonic() - started < 1.0


def _host(script: str, tmp_path: Path) -> Any:
    """`script` run as a host process of its own (a SIGPIPE there must not end pytest); it
    must have ended well."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    return done


_HOST_WITH_DEFAULT_SIGPIPE = """
import signal, sys, tempfile
from pathlib import Path
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as an embedding C++ server, or a CLI, has it
from exporter.transport.aggregator import Aggregator
from tests.helpers import ProbedServer
run_dir = Path(tempfile.mkdtemp())
server, aggregator = ProbedServer(), Aggregator(run_dir)
agent = server.agent(run_dir)
agent.tick()  # connected; the full sample
agent.tick()  # a record
aggregator.close()  # the helper is gone: its end of the connection is closed
for tick in range(3):  # records, then (reconnecting fails) full samples
    try:
        agent.tick()
    except OSError as exc:
        print("tick", tick, type(exc).__name__)
        agent._close()
print("alive")
"""


def test_a_helper_gone_mid_send_never_kills_a_host_whose_sigpipe_is_at_its_default(tmp_path):
    """A write to a closed Unix socket raises SIGPIPE, which kills a process that did not
    ignore it (Python does; an embedding C++ server or a CLI that restores the default does
    not). The probe's sends fail with EPIPE instead, and it reconnects later."""
    done = _host(_HOST_WITH_DEFAULT_SIGPIPE, tmp_path)
    assert "tick 0 BrokenPipeError" in done.stdout and "alive" in done.stdout


_PROBE_THREAD_WRITING_TO_A_GONE_PEER = """
import os, signal, tempfile, threading
from pathlib import Path
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
from tests.helpers import ProbedServer
run_dir = Path(tempfile.mkdtemp())  # no helper listens here
agent = ProbedServer().agent(run_dir)
agent.interval_s = 0.05
wrote = threading.Event()

def lost():  # what finding the helper again does over HTTP, to a peer that is gone
    readable, writable = os.pipe()
    os.close(readable)
    try:
        os.write(writable, b"GET /healthz HTTP/1.1")
    except BrokenPipeError:
        print("EPIPE")
    finally:
        wrote.set()
    return None

agent.on_lost = lost
agent.start()
wrote.wait(10)
agent.stop()
print("alive")
"""


def test_what_the_probe_thread_writes_to_a_gone_peer_never_kills_such_a_host(tmp_path):
    """The probe's thread also finds or restarts the helper (HTTP): a write there to a peer
    that has gone must not kill a host whose SIGPIPE is at its default either."""
    done = _host(_PROBE_THREAD_WRITING_TO_A_GONE_PEER, tmp_path)
    assert done.stdout.split() == ["EPIPE", "alive"]


def test_a_refusal_heard_after_the_hello_is_told_after_the_dial_never_undone_by_it(
    run_dir, monkeypatch
):
    """A helper that takes the hello, then says "refused" and closes (the aggregator refuses
    as soon as it accepts, so a hello often gets through first). What the agent tells last
    must be the refusal: told before the dial's own "taken", it was undone by it
    (handle.error None with the refusal logged; CI). A stand-in helper refuses once it has
    the hello, and the dial is slowed, so that a reader already running would win every
    time."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(run_dir / SOCKET_NAME))
    listener.listen(1)

    def refuse_after_hello() -> None:
        peer, _ = listener.accept()
        with peer:
            peer.recv(65536)
            peer.sendall(protocol.encode(protocol.refused("no room here")))

    helper = threading.Thread(target=refuse_after_hello, daemon=True)
    helper.start()
    told: list[str | None] = []
    agent = ProbedServer().agent(run_dir)
    agent.on_dial = told.append
    try_dial = agent._try_dial

    def slow_dial() -> str | None:
        said = try_dial()
        time.sleep(0.3)  # the refusal is in the socket by now
        return said

    monkeypatch.setattr(agent, "_try_dial", slow_dial)
    try:
        assert agent.connect(), told  # the hello went through
        deadline = time.monotonic() + 5
        while len(told) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert told == [None, "the helper did not take this process: no room here"]
    finally:
        agent.stop()
        listener.close()
        helper.join(5)
