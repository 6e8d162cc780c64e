"""Faults around traces: a recorded target that dies or serves garbage, a recorder that is
killed, trace files that are valid JSON but not samples, and a health check that sees a
source failing on every tick."""

from __future__ import annotations

import gzip
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from exporter.config import load_config
from exporter.http.server import create_app
from exporter.runtime import build_runtime
from exporter.sample import HostReading, Sample, SourceReading
from exporter.sampler import Sampler
from exporter.sources.replay import ReplaySource, demo_trace_path
from exporter.trace import TraceError, TraceWriter, read_trace
from tests.conftest import REPO_ROOT
from tests.helpers import captured_sample, render

CLI = [sys.executable, "-m", "exporter.cli"]
EXPOSITION = render(captured_sample("native")).encode()


def _with_value(value: str) -> bytes:
    """The captured exposition with one allocator gauge's value replaced."""
    lines = EXPOSITION.decode().splitlines()
    for index, line in enumerate(lines):
        if line.startswith("torch_cuda_reserved_bytes{"):
            lines[index] = line.rsplit(" ", 1)[0] + " " + value
            return ("\n".join(lines) + "\n").encode()
    raise AssertionError("no torch_cuda_reserved_bytes in the captured exposition")


GARBAGE = {
    "html": ("text/html; charset=utf-8", b"<!doctype html><html><body>Login</body></html>\n"),
    "text": ("text/plain", b"<!doctype html><html><body>Login</body></html>\n"),  # a proxy
    "nan": ("text/plain; version=0.0.4", _with_value("NaN")),
    "inf": ("text/plain; version=0.0.4", _with_value("+Inf")),
}
REASONS = {
    "html": "answered with an HTML page, not metrics",
    "text": "not a gpumem-exporter exposition: invalid metric name:<!doctype html>",
    "nan": "torch_cuda_reserved_bytes is nan, not a finite value",
    "inf": "torch_cuda_reserved_bytes is inf, not a finite value",
}


class Target(http.server.ThreadingHTTPServer):
    """A recorded exporter: answers `good` scrapes with a real exposition, then either
    dies (stops listening) or, given `garbage`, answers with that from then on."""

    daemon_threads = True

    def __init__(self, good: int | None, garbage: tuple[str, bytes] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.good, self.garbage, self.scrapes = good, garbage, 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def die(self) -> None:
        self.shutdown()
        self.server_close()  # connections are refused from now on


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Target

    def do_GET(self) -> None:
        target = self.server
        with target.lock:
            target.scrapes += 1
            scrape = target.scrapes
        if target.good is None or scrape <= target.good:
            self._answer("text/plain; version=0.0.4", EXPOSITION)
            if scrape == target.good and target.garbage is None:
                threading.Thread(target=target.die, daemon=True).start()
        elif target.garbage is not None:
            self._answer(*target.garbage)
        else:
            self.close_connection = True  # a scrape that came in while dying: no answer

    def _answer(self, content_type: str, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def target(good: int | None, garbage: tuple[str, bytes] | None = None) -> Iterator[Target]:
    server = Target(good, garbage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        if thread.is_alive():
            server.die()


def record(url: str, output: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CLI, "record", "--url", url, "-o", str(output), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(".partial")]


# -- record: a target that dies, a recorder that is killed --------------------------------------


@pytest.mark.slow
def test_record_keeps_the_samples_taken_before_the_target_died(tmp_path):
    """The target answers 5 scrapes of a 20 s recording, then stops listening: the recording
    ends soon after (3 missed scrapes), exit 0, one line naming the count and the file, and
    the file loaded the samples so far at every moment it was looked at while recording."""
    output = tmp_path / "incident.jsonl.gz"
    started = time.monotonic()
    with target(good=5) as server:
        proc = record(server.url, output, "--duration-s", "20", "--interval-s", "0.2")
        seen = []
        while proc.poll() is None:
            if output.exists():
                seen.append(len(read_trace(output)[1]))  # loadable at every moment
            time.sleep(0.05)
        stdout, stderr = proc.communicate()
    took_s = time.monotonic() - started
    assert proc.returncode == 0, stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert "stopped answering after 5 samples" in stderr and f"kept 5 samples in {output}" in stderr
    assert "Connection refused" in stderr or "RemoteDisconnected" in stderr, stderr
    assert stdout == ""
    meta, samples = read_trace(output)
    assert len(samples) == 5 and meta["source_url"] == server.url + "/metrics"
    assert samples[0].allocators == captured_sample("native").allocators
    assert seen and seen == sorted(seen) and 0 < seen[0] < 5  # written as it went
    assert leftovers(tmp_path) == []
    assert took_s < 12  # stopped when the target died, not at the end of the 20 s


@pytest.mark.slow
def test_a_killed_recorder_leaves_a_loadable_trace(tmp_path):
    output = tmp_path / "t.jsonl.gz"
    with target(good=None) as server:
        proc = record(server.url, output, "--duration-s", "60", "--interval-s", "0.1")
        try:
            deadline = time.monotonic() + 30
            while not (output.exists() and len(read_trace(output)[1]) >= 3):
                assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
                time.sleep(0.05)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
    _, samples = read_trace(output)  # its gzip stream has no end: every complete line loads
    assert len(samples) >= 3
    assert [s.timestamp for s in samples] == sorted({s.timestamp for s in samples})


@pytest.mark.slow
def test_a_live_trace_cut_anywhere_loads_up_to_its_last_complete_sample(tmp_path):
    samples = read_trace(demo_trace_path())[1][:4]
    path = tmp_path / "live.jsonl.gz"
    writer = TraceWriter(path, live=True)
    sizes = []
    for sample in samples:
        writer(sample)
        sizes.append(path.stat().st_size)
    data = path.read_bytes()
    writer.close()
    cut = tmp_path / "cut.jsonl.gz"
    counts = []
    for size in range(sizes[0], len(data) + 1):
        cut.write_bytes(data[:size])
        counts.append(len(read_trace(cut)[1]))
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] == 4
    assert [counts[s - sizes[0]] for s in sizes] == [1, 2, 3, 4]
    assert read_trace(path)[1] == samples  # closed: the whole trace


def test_the_writer_keeps_timestamps_increasing_when_the_clock_steps_back(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    writer = TraceWriter(path)
    for timestamp in (100.0, 50.0, 50.0, float("nan"), 101.0):
        writer(Sample(timestamp=timestamp))
    writer.close()
    stamps = [s.timestamp for s in read_trace(path)[1]]
    assert len(stamps) == 5 and stamps[0] == 100.0 and stamps == sorted(set(stamps))


# -- record: a target that serves something other than its metrics ------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_record_keeps_its_samples_when_the_target_starts_serving_garbage(tmp_path, kind):
    output = tmp_path / "t.jsonl.gz"
    with target(good=3, garbage=GARBAGE[kind]) as server:
        proc = record(server.url, output, "--duration-s", "20", "--interval-s", "0.1")
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert "stopped answering after 3 samples" in stderr and REASONS[kind] in stderr, stderr
    assert len(read_trace(output)[1]) == 3
    assert leftovers(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_record_of_a_target_serving_garbage_from_the_start_is_a_one_line_error(tmp_path, kind):
    output = tmp_path / "t.jsonl.gz"
    with target(good=0, garbage=GARBAGE[kind]) as server:
        proc = record(server.url, output, "--duration-s", "5", "--interval-s", "0.1")
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert stderr.startswith(f"gpumem-exporter record: error: {server.url}/metrics")
    assert REASONS[kind] in stderr
    assert list(tmp_path.iterdir()) == []  # nothing written, no .partial


# -- demo --trace: lines that are JSON but not samples ------------------------------------------

HEADER = b'{"format": "gpumem-trace", "version": 1}\n'
ALLOCATOR = '{"device": 0, "gpu_uuid": "GPU-x", "backend": "native", "expandable_segments": false'


@pytest.mark.parametrize(
    ("lines", "line", "problem"),
    [
        (["[1, 2]"], 2, "expected a sample object, got [1, 2]"),
        (['{"timestamp": NaN}'], 2, "timestamp is NaN, not a finite number"),
        (['{"timestamp": 1}', '{"timestamp": Infinity}'], 3, "timestamp is Infinity"),
        (['{"timestamp": 1}', '{"timestamp": 1}'], 3, "timestamp 1 is not after"),
        (['{"timestamp": 2}', '{"timestamp": 1}'], 3, "timestamp 1 is not after"),
        (['{"timestamp": "1"}'], 2, 'timestamp: expected a number, got "1"'),
        (['{"allocators": []}'], 2, "timestamp is missing"),
        (['{"timestamp": 1, "gpus": {}}'], 2, "gpus: expected a list"),
        (['{"timestamp": 1, "gpus": [{"index": "0", "uuid": "u"}]}'], 2, "gpus[0].index"),
        (
            ['{"timestamp": 1, "allocators": [' + ALLOCATOR + ', "gauges": {"x": NaN}}]}'],
            2,
            "allocators[0].gauges.x: expected an integer, got NaN",
        ),
        (
            ['{"timestamp": 1, "allocators": [' + ALLOCATOR + ', "counters": {"x": 1.5}}]}'],
            2,
            "allocators[0].counters.x: expected an integer, got 1.5",
        ),
        (['{"timestamp": 1, "host": {"total_bytes": 1}}'], 2, "host.available_bytes is missing"),
        (['{"timestamp": 1, "processes": [{"gpu_index": 0}]}'], 2, "processes[0].gpu_uuid"),
        (['{"timestamp": 1, "gpus": [{"index": 0, "uuid": "u", "x": 1}]}'], 2, "unknown field"),
        (['{"timestamp": 1, "self_pid": true}'], 2, "self_pid: expected an integer, got true"),
        (['{"timestamp": 1}', "", "{oops"], 4, "malformed trace at line 4: Expecting"),
    ],
)
def test_a_trace_line_that_is_not_a_sample_is_named_in_one_line(tmp_path, lines, line, problem):
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(gzip.compress(HEADER + "\n".join(lines).encode() + b"\n"))
    with pytest.raises(TraceError) as info:
        read_trace(path)
    message = str(info.value)
    assert f"malformed trace at line {line}: " in message and problem in message, message
    assert "\n" not in message


def test_the_validation_accepts_every_trace_the_exporter_writes(tmp_path):
    meta, _ = read_trace(demo_trace_path())
    path = tmp_path / "t.jsonl.gz"
    writer = TraceWriter(path, meta=meta)
    for sample in [captured_sample(name) for name in ("native", "expandable", "async")]:
        sample.timestamp = time.time()
        writer(sample)
    writer.close()
    assert len(read_trace(path)[1]) == 3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b'{"timestamp": 1}\n[1, 2]\n', "line 3: expected a sample object"),
        (b'{"timestamp": 1}\n{"timestamp": 1}\n', "line 3: timestamp 1 is not after"),
        (b'{"timestamp": NaN}\n', "line 2: timestamp is NaN"),
    ],
)
def test_demo_refuses_a_trace_that_is_not_samples_in_one_line(tmp_path, body, problem):
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(gzip.compress(HEADER + body))
    proc = subprocess.run(
        [*CLI, "demo", "--trace", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert problem in proc.stderr


# -- /healthz sees a source failing on every tick -----------------------------------------------


class Source:
    required = False  # what exporter.sampler reads of a source that must work

    def __init__(self, name: str, fails: bool = False) -> None:
        self.name, self.fails = name, fails

    def read(self) -> SourceReading:
        if self.fails:
            raise RuntimeError(f"{self.name} unavailable")
        return SourceReading(host=HostReading(100, 50, 10, 1))

    def close(self) -> None:
        pass


def health(mode: str, sources: list) -> tuple[TestClient, Sampler]:
    runtime = build_runtime(load_config(env={}), mode=mode, sources=sources)
    return TestClient(create_app(runtime)), runtime.sampler


def test_healthz_fails_when_the_demo_replay_fails_on_every_tick(tmp_path):
    """What a trace with one repeated timestamp did before it was refused at load: a replay
    of zero duration, whose every read divides by zero."""
    path = tmp_path / "t.jsonl.gz"
    writer = TraceWriter(path)
    for sample in read_trace(demo_trace_path())[1][:2]:
        writer(sample)
    writer.close()
    replay = ReplaySource(path)
    replay.duration_s = 0.0
    client, sampler = health("demo", [replay])
    for _ in range(2):
        sampler.tick()
    assert client.get("/healthz").status_code == 200  # not yet: one bad read can be transient
    sampler.tick()
    answer = client.get("/healthz")
    assert answer.status_code == 503
    body = answer.json()
    assert body["status"] == "failing" and body["mode"] == "demo"
    failure = body["failing_sources"]["replay"]
    assert failure["failed_reads"] == 3 and failure["last_error"].startswith("ZeroDivisionError")


def test_healthz_fails_when_every_source_fails_and_recovers_with_one():
    nvml, host = Source("nvml", fails=True), Source("host", fails=True)
    client, sampler = health("embedded", [nvml, host])
    for _ in range(3):
        sampler.tick()
    body = client.get("/healthz").json()
    assert body["status"] == "failing"
    assert body["failing_sources"]["host"] == {
        "failed_reads": 3,
        "last_error": "RuntimeError: host unavailable",
    }
    host.fails = False
    sampler.tick()
    assert client.get("/healthz").status_code == 200


def test_one_failing_optional_source_keeps_an_embedded_exporter_healthy():
    """NVML on a host without a GPU fails every read; host memory still reads: healthy, and
    the failure shows on gpumem_exporter_source_up instead."""
    client, sampler = health("embedded", [Source("torch"), Source("nvml", fails=True)])
    for _ in range(10):
        sampler.tick()
    answer = client.get("/healthz")
    assert answer.status_code == 200 and answer.json()["status"] == "ok"
    assert 'gpumem_exporter_source_up{source="nvml"} 0.0' in client.get("/metrics").text


def test_a_required_source_fails_the_health_check_even_next_to_working_ones():
    required = Source("replay", fails=True)
    required.required = True
    sampler = Sampler([required, Source("host")])
    for _ in range(3):
        sampler.tick()
    assert list(sampler.failing_sources()) == ["replay"]
    assert Sampler([]).failing_sources() == {}  # no sources is not "every source failed"


def test_a_closed_live_trace_is_a_plain_gzip_file(tmp_path):
    """Flushing every sample leaves a file that any gzip reader takes, once closed."""
    path = tmp_path / "t.jsonl.gz"
    writer = TraceWriter(path, live=True)
    samples = read_trace(demo_trace_path())[1][:10]
    for sample in samples:
        writer(sample)
    writer.close()
    decoded = [json.loads(line) for line in gzip.decompress(path.read_bytes()).splitlines()]
    assert len(decoded) == 11 and read_trace(path)[1] == samples


def test_only_reads_failed_in_a_row_count():
    flaky = Source("host", fails=True)
    sampler = Sampler([flaky])
    for fails in (True, True, False, True, True):
        flaky.fails = fails
        sampler.tick()
    failed = sampler.failing_sources(after_reads=1)
    assert failed["host"].failed_reads == 2 and sampler.failing_sources() == {}
    sampler.tick()
    assert sampler.failing_sources()["host"].failed_reads == 3


@pytest.mark.slow
def test_an_embedded_recording_survives_its_server_being_killed(tmp_path):
    """exporter.start(record_to=...) writes as it goes: a server killed mid-run keeps it."""
    trace = tmp_path / "server.trace.gz"
    code = (
        "import time, exporter\n"
        f"exporter.start(port=0, interval_s=0.1, record_to={str(trace)!r})\n"
        "time.sleep(120)\n"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, "GPUMEM_NVML": "off"}, cwd=REPO_ROOT
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if trace.exists() and len(read_trace(trace)[1]) >= 3:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("no samples were recorded")
    finally:
        server.kill()
        server.wait(10)
    assert len(read_trace(trace)[1]) >= 3


def test_a_gzip_bomb_is_one_reason_not_a_traceback(tmp_path, monkeypatch):
    """A small file that decompresses to more than a trace ever is (issue 38: a traceback,
    and memory without bound): one TraceError, read no further than the limit."""
    from exporter import trace

    monkeypatch.setattr(trace, "MAX_TRACE_BYTES", 1 << 20)
    bomb = tmp_path / "bomb.jsonl.gz"
    bomb.write_bytes(gzip.compress(b"\0" * (8 << 20)))  # 8 KiB on disk
    with pytest.raises(trace.TraceError, match="decompresses to more than 1 MiB: not a trace"):
        trace.read_trace(bomb)
    # Traces under the limit load as before.
    monkeypatch.setattr(trace, "MAX_TRACE_BYTES", 64 << 20)
    assert read_trace(demo_trace_path())[1]


def _trace_file(path: Path, version: int, *lines: dict) -> Path:
    header = {"format": "gpumem-trace", "version": version, "meta": {}}
    path.write_bytes(
        gzip.compress(b"".join(json.dumps(x).encode() + b"\n" for x in (header, *lines)))
    )
    return path


def test_an_older_version_loads_through_its_upgrade_and_a_newer_one_is_named(tmp_path, monkeypatch):
    """A version this reader knows only through UPGRADES is read as this version's lines; a
    newer one is refused, saying it is newer."""
    from exporter import trace

    old = {
        "time": 5.0,
        "host": {
            "total_bytes": 8,
            "available_bytes": 4,
            "swap_total_bytes": 0,
            "swap_used_bytes": 0,
        },
    }
    path = _trace_file(tmp_path / "old.jsonl.gz", 0, old)
    with pytest.raises(trace.TraceError, match=r"unsupported trace version 0$"):
        trace.read_trace(path)
    monkeypatch.setitem(trace.UPGRADES, 0, lambda line: {"timestamp": line.pop("time"), **line})
    _, [sample] = trace.read_trace(path)
    assert sample.timestamp == 5.0 and sample.host == HostReading(8, 4, 0, 0)
    newer = _trace_file(tmp_path / "new.jsonl.gz", trace.VERSION + 1, {"timestamp": 1.0})
    with pytest.raises(trace.TraceError, match="written by a newer gpumem-exporter"):
        trace.read_trace(newer)


def test_a_trace_line_holds_every_traced_part_and_reads_back_equal():
    """Sample.to_dict and Sample.from_dict come from the readings' declarations: a recorded
    sample goes out and back equal, and the node's own parts never enter a trace."""
    from exporter.sample import READING_PARTS
    from exporter.sources.replay import demo_trace_path
    from exporter.trace import read_trace

    traced = {f.name for f in READING_PARTS if f.metadata["traced"]}
    assert {"kubelet", "process_containers", "rejected_messages"} & traced == set()
    for sample in read_trace(demo_trace_path())[1]:
        line = json.loads(json.dumps(sample.to_dict()))
        assert set(line) == {"timestamp", *traced}
        assert Sample.from_dict(line) == sample
