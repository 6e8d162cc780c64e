"""No client can take the endpoint away (docs/reliability.md, "Slow readers, bursts and busy
admin calls"): the real server on a real socket against clients that never read, a burst of
300 connections, and admin calls stuck on a stopped process while the probes come in."""

from __future__ import annotations

import contextlib
import http.client
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from exporter.actions.snapshots import SnapshotStore
from exporter.config import load_config
from exporter.http import guard
from exporter.http.server import HttpServer, create_app
from exporter.runtime import build_runtime
from exporter.transport import fanout
from exporter.transport.aggregator import Aggregator
from exporter.transport.fanout import FanOutActions
from tests.conftest import REPO_ROOT
from tests.helpers import (
    AUTH,
    TOKEN,
    close_pipes,
    kill_process,
    served,
    slow_reader,
    wait_until_stalled,
)
from tests.http.burst import burst, status_line


def whole_answer(address: tuple[str, int], path: str) -> bytes:
    """Connect, ask, and return the whole answer (the server closes after it): b"" if it closed
    or reset without one. Then a moment's pause, as between two probes."""
    answer = b""
    try:
        with socket.create_connection(address, timeout=20) as sock:
            sock.sendall(
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
            )
            while chunk := sock.recv(65536):
                answer += chunk
    except OSError:
        pass
    time.sleep(0.05)
    return answer


def probes_beside(
    address: tuple[str, int],
    worker: Callable[[], None],
    workers: int,
    stop: threading.Event,
    *,
    settle_s: float,
    count: int,
) -> list[bytes]:
    """`workers` threads running `worker` (until `stop`), then the status lines of `count`
    new scrapes and health checks beside them, every 50 ms."""
    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(settle_s)  # every worker connected and at it
        statuses = []
        for i in range(count):
            statuses.append(status_line(address, "/metrics" if i % 2 else "/healthz"))
            time.sleep(0.05)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    return statuses


def half_sent(address: tuple[str, int], count: int) -> list[socket.socket]:
    """`count` connections, each reading a request it started and never finishes."""
    held = []
    for _ in range(count):
        sock = socket.create_connection(address, timeout=10)
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
        held.append(sock)
    return held


@pytest.mark.slow
def test_seventy_slow_readers_take_neither_scrapes_nor_health_checks_away(tmp_path, monkeypatch):
    monkeypatch.setattr(guard, "WRITE_TIMEOUT_S", 8.0)
    with served(tmp_path) as (server, _):
        address = ("127.0.0.1", server.port)
        readers = [slow_reader(address, 400) for _ in range(70)]
        try:
            wait_until_stalled(server, 64)  # their answers fill every buffer and stall
            scraper = http.client.HTTPConnection(*address, timeout=5)
            answered: list[int | None] = []
            for _ in range(10):
                for path in ("/metrics", "/healthz"):
                    try:
                        scraper.request("GET", path)
                        response = scraper.getresponse()
                        response.read()
                        answered.append(response.status)
                    except (OSError, http.client.HTTPException):
                        answered.append(None)
                        scraper.close()
            scraper.close()
            assert answered == [200] * 20, answered
            # Past the write deadline they are gone, whatever room was needed.
            deadline = time.monotonic() + 10
            while len(server.connections.open) > 2:
                assert time.monotonic() < deadline, len(server.connections.open)
                time.sleep(0.1)
        finally:
            for sock in readers:
                sock.close()


@pytest.mark.slow
def test_a_burst_of_300_connections_gets_an_http_answer_each(tmp_path):
    with served(tmp_path) as (server, _):
        address = ("127.0.0.1", server.port)
        results = burst(address, 300, "/metrics")
        answers = {line for line in results}
        assert len(results) == 300
        assert answers <= {b"HTTP/1.1 200 OK", b"HTTP/1.1 503 Service Unavailable"}, answers
        assert b"HTTP/1.1 200 OK" in answers


@pytest.mark.slow
def test_1200_simultaneous_page_requests_get_an_http_answer_each_never_a_reset(tmp_path):
    """Issue 38: 153 of 1,200 got resets. Connections picked to make room while the busy
    event loop had not read their requests yet were closed with those bytes unread, which
    makes the kernel send a reset; they are now told 503 and closed lingering. The clients
    run in a process of their own (tests.http.burst says why)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 3000:  # the server's end of 1,200 connections, and its own
        if hard != resource.RLIM_INFINITY and hard < 3000:
            pytest.skip(f"needs 3000 fds, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (3000, hard))
    with served(tmp_path) as (server, _):
        address = ("127.0.0.1", server.port)
        results = burst(address, 1200, "/")  # the page: a slower answer
        answers = Counter(results)
        assert len(results) == 1200
        assert set(answers) <= {b"HTTP/1.1 200 OK", b"HTTP/1.1 503 Service Unavailable"}, answers


@pytest.mark.slow
def test_a_full_server_answers_503_with_retry_after_and_keeps_slots_for_probes(tmp_path):
    with served(tmp_path) as (server, _):
        address = ("127.0.0.1", server.port)
        # Clients being answered: each has sent a whole request for a page it never reads.
        busy = [slow_reader(address, 400) for _ in range(guard.MAX_CONNECTIONS)]
        try:
            wait_until_stalled(server, guard.MAX_CONNECTIONS)
            # Stalled answers go first to make room: a probe and a page request both get in.
            assert status_line(address, "/healthz") == b"HTTP/1.1 200 OK"
            assert status_line(address, "/").startswith(b"HTTP/1.1 200")
        finally:
            for sock in busy:
                sock.close()


@pytest.mark.slow
def test_beyond_the_cap_only_probes_get_the_reserve_and_others_503(tmp_path, monkeypatch):
    """With nothing to close (every connection reading a request it started just now), the
    request line decides: a probe path gets a reserved slot, a page gets 503 + Retry-After."""
    monkeypatch.setattr(guard, "READ_GRACE_S", 60.0)
    with served(tmp_path) as (server, _):
        address = ("127.0.0.1", server.port)
        held = half_sent(address, guard.MAX_CONNECTIONS)
        try:
            time.sleep(0.3)
            assert status_line(address, "/healthz") == b"HTTP/1.1 200 OK"
            with socket.create_connection(address, timeout=10) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer
            assert b"\r\nRetry-After: 1\r\n" in answer and answer.endswith(b"retry shortly\n")
        finally:
            for sock in held:
                sock.close()


@pytest.mark.slow
def test_a_connection_closed_to_make_room_is_told_503(tmp_path):
    """The oldest unfinished request gives way to a newcomer at a full server, and is told 503
    before its close: it may be a client whose whole request waits unread behind a busy event
    loop (issue 38's 1,200 simultaneous requests), for which a silent close is a dead target.
    (The 1,200-request test asks this only when its machine is busy enough; this asks it
    every time.)"""
    with served(tmp_path) as (server, _):
        address = ("127.0.0.1", server.port)
        held = half_sent(address, guard.MAX_CONNECTIONS)
        try:
            time.sleep(guard.READ_GRACE_S + 0.3)  # all of them slow now; held[0] the oldest
            assert status_line(address, "/healthz") == b"HTTP/1.1 200 OK"  # made its room
            answer = b""
            with contextlib.suppress(OSError):
                while chunk := held[0].recv(65536):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer
            assert answer.endswith(b"retry shortly\n"), answer
        finally:
            for sock in held:
                sock.close()


@pytest.mark.slow
def test_connections_closed_lingering_hold_no_slot(tmp_path, monkeypatch):
    """A newcomer answered 503 is drained for up to LINGER_S before its close: while it is,
    it must not count against the reserve, or the 503s of a busy moment turn the next probes
    away too (seen as 503s to new probes beside 100 polite health checkers)."""
    monkeypatch.setattr(guard, "READ_GRACE_S", 60.0)
    with served(tmp_path) as (server, _):
        address = ("127.0.0.1", server.port)
        held = half_sent(address, guard.MAX_CONNECTIONS)
        try:
            time.sleep(0.3)
            for _ in range(guard.PROBE_RESERVE + 4):  # answered 503, kept open: lingering
                sock = socket.create_connection(address, timeout=10)
                sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert sock.recv(65536).startswith(b"HTTP/1.1 503")
                held.append(sock)
            assert status_line(address, "/healthz") == b"HTTP/1.1 200 OK"
        finally:
            for sock in held:
                sock.close()


@pytest.mark.slow
def test_a_kept_alive_scraper_keeps_its_connection_when_the_server_fills(tmp_path, monkeypatch):
    """Prometheus between two scrapes is idle: newcomers never close its connection to make
    room (closing it as it sends the next scrape resets that scrape)."""
    monkeypatch.setattr(guard, "READ_GRACE_S", 60.0)
    with served(tmp_path) as (server, _):
        address = ("127.0.0.1", server.port)
        scraper = http.client.HTTPConnection(address[0], address[1], timeout=10)
        scraper.request("GET", "/metrics")
        assert scraper.getresponse().read()
        local_port = scraper.sock.getsockname()[1]
        held = half_sent(address, guard.MAX_CONNECTIONS + 5)
        try:
            time.sleep(0.3)
            scraper.request("GET", "/metrics")  # on the same connection, not a new one
            assert scraper.getresponse().status == 200
            assert scraper.sock.getsockname()[1] == local_port
        finally:
            scraper.close()
            for sock in held:
                sock.close()


@pytest.mark.slow
def test_health_answers_while_admin_calls_wait_for_a_stopped_process(run_dir, monkeypatch):
    """Under `run`, 45 admin calls wait for a worker that was stopped (SIGSTOP): they hold the
    thread pool, and /healthz and /readyz must not queue behind them."""
    monkeypatch.setattr(fanout, "ANSWER_TIMEOUT_S", 6.0)
    aggregator = Aggregator(run_dir)
    config = load_config(env={}, admin_token=TOKEN, snapshot_dir=str(run_dir / "snaps"))
    actions = FanOutActions(aggregator, SnapshotStore.for_config(config))
    runtime = build_runtime(config, mode="run", sources=[aggregator], actions=actions)
    server = HttpServer(create_app(runtime), "127.0.0.1", 0)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.agent_peer",
            str(aggregator.socket_path),
            "answer",
            "0",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={k: v for k, v in os.environ.items() if k != "RANK"},
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while not aggregator.read().allocators:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        runtime.sampler.tick()
        server.start()
        address = ("127.0.0.1", server.port)
        os.kill(worker.pid, signal.SIGSTOP)

        def admin_call() -> None:
            with contextlib.closing(http.client.HTTPConnection(address[0], address[1], 30)) as c:
                c.request("GET", "/history", headers=AUTH)
                c.getresponse().read()

        callers = [threading.Thread(target=admin_call) for _ in range(45)]
        for caller in callers:
            caller.start()
        time.sleep(1.0)  # every pool thread now waits for the stopped worker
        for path in ("/healthz", "/readyz"):
            began = time.monotonic()
            with contextlib.closing(http.client.HTTPConnection(*address, timeout=30)) as c:
                c.request("GET", path)
                status = c.getresponse().status
            took = time.monotonic() - began
            assert status == 200 and took < 1.5, (path, status, took)
        for caller in callers:
            caller.join(30)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        kill_process(worker)
        server.stop()
        aggregator.close()


# 100 health checkers in a process of their own (as a fleet of them is: other processes, not
# threads sharing the server's interpreter lock): each keeps its connection and asks /readyz
# every half second, reading every answer, for argv[2] seconds; prints how many were answered.
POLITE_CHECKERS = """
import http.client, sys, threading, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
end = time.monotonic() + seconds
answered = []

def polite():
    connection = None
    while time.monotonic() < end:
        try:
            if connection is None:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            connection.request("GET", "/readyz")
            response = connection.getresponse()
            response.read()
            answered.append(1)
            if response.getheader("Connection") == "close":
                connection.close()
                connection = None
        except (OSError, http.client.HTTPException):
            connection = None
        time.sleep(0.5)
    if connection is not None:
        connection.close()

threads = [threading.Thread(target=polite) for _ in range(100)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(len(answered))
"""


@pytest.mark.slow
def test_polite_kept_alive_clients_never_lock_out_new_scrapes_and_probes(tmp_path):
    """100 health checkers that each keep a connection and ask /readyz every half second,
    reading every answer, take every regular slot and would keep the probes' reserve too: a
    reserved slot answers one request and closes, so new scrapes and probes always get in."""
    with served(tmp_path) as (server, _):
        address = ("127.0.0.1", server.port)
        checkers = subprocess.Popen(
            [sys.executable, "-c", POLITE_CHECKERS, str(server.port), "8"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(2.0)  # every checker connected and asking
            answers = [
                whole_answer(address, "/metrics" if i % 2 else "/healthz") for i in range(60)
            ]
        finally:
            out, _ = checkers.communicate(timeout=30)
            close_pipes(checkers)
    # The whole answer of any that is not 200: the guard's 503 says "too many connections".
    assert all(a.startswith(b"HTTP/1.1 200 OK\r\n") for a in answers), [
        a for a in answers if not a.startswith(b"HTTP/1.1 200 OK\r\n")
    ]
    assert int(out) > 300


def test_a_client_yet_to_send_keeps_its_slot_while_the_reserve_has_room(tmp_path):
    """A client that has connected but not yet sent its request (a moment between connect()
    and send(), longer on a busy machine) is not closed for a probe while the probes' reserve
    has room: the probe takes a reserved slot. Closing it was the 1-in-60 503 that the polite
    checkers' test saw in CI: a new scrape's connection, silent for a few milliseconds, was
    closed for a checker's reconnect."""
    with served(tmp_path) as (server, _), regular_slots_held(server):
        address = ("127.0.0.1", server.port)
        with socket.create_connection(address, timeout=10) as quiet:
            time.sleep(0.3)  # connected, seen by the server, nothing sent yet
            assert status_line(address, "/healthz") == b"HTTP/1.1 200 OK"
            quiet.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = read_until_closed(quiet)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:200]


def test_a_reserved_slot_answers_one_request_then_closes(tmp_path):
    with (
        served(tmp_path) as (server, _),
        regular_slots_held(server),
        socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock,
    ):
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer
    assert b"\r\nconnection: close\r\n" in answer.lower()


@contextlib.contextmanager
def regular_slots_held(server: HttpServer) -> Iterator[None]:
    """Every regular slot held by a polite client: answered, kept alive, idle."""
    held = []
    try:
        for _ in range(guard.MAX_CONNECTIONS):
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            connection.request("GET", "/readyz")
            connection.getresponse().read()
            held.append(connection)
        yield
    finally:
        for connection in held:
            connection.close()


def read_until_closed(sock: socket.socket) -> bytes:
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


@pytest.mark.slow
def test_churning_silent_connections_never_lock_out_new_scrapes_and_probes(tmp_path):
    """Round 4, HIGH 3: 100 connections that each close and reopen every 0.4 s without sending
    a byte were never old enough to be closed for room (READ_GRACE_S) yet held every slot, the
    reserve included (then 16): every new /metrics and /healthz got 503 for as long as they
    churned. A connection that has sent nothing gives way to one whose request line asks for
    a probe path, whatever its age, once the reserve is full: here 32 more churners than
    the regular slots and the reserve together."""
    with served(tmp_path) as (server, _):
        address = ("127.0.0.1", server.port)
        stop = threading.Event()

        def churn() -> None:
            while not stop.is_set():
                try:
                    with socket.create_connection(address, timeout=5):
                        stop.wait(0.4)
                except OSError:
                    stop.wait(0.05)

        churners = guard.MAX_CONNECTIONS + guard.PROBE_RESERVE + 32
        statuses = probes_beside(address, churn, churners, stop, settle_s=1.5, count=40)
    counts = Counter(statuses)
    # Every one answered 200 (it was 503 for 40 of 40). Neither 503 nor b"": a churner closed
    # to make room whose client had already gone made shutdown() raise ENOTCONN inside the
    # newcomer's request, which ended unanswered (7 of 40 here).
    assert counts == Counter({b"HTTP/1.1 200 OK": 40}), counts


@pytest.mark.slow
def test_half_requests_that_reconnect_at_once_never_lock_out_new_scrapes_and_probes(tmp_path):
    """Round 5 (issue 64), HIGH: clients that send only a request line, wait until the server
    closes them and reconnect at once: 150 of them held every slot, the reserve included,
    with young half-requests (never READ_GRACE_S old, and not silent: they had sent a line),
    and 15 of 16 new /healthz and /metrics got 503. A connection whose request is not whole
    gives way to a newcomer asking for a probe path once the reserve is full, as a silent
    one does."""
    with served(tmp_path) as (server, _):
        address = ("127.0.0.1", server.port)
        stop = threading.Event()

        def half_requests() -> None:
            while not stop.is_set():
                try:
                    with socket.create_connection(address, timeout=5) as sock:
                        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
                        while not stop.is_set() and sock.recv(4096):
                            pass  # until the server closes it
                except OSError:
                    stop.wait(0.01)

        clients = guard.MAX_CONNECTIONS + guard.PROBE_RESERVE + 32
        statuses = probes_beside(address, half_requests, clients, stop, settle_s=1.5, count=40)
    counts = Counter(statuses)
    assert counts == Counter({b"HTTP/1.1 200 OK": 40}), counts


# 80 clients in a process of their own, each asking for /metrics on a new connection with a
# password never seen before, again as soon as it has its answer, for argv[2] seconds.
PASSWORD_GUESSERS = """
import base64, itertools, socket, sys, threading, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
end = time.monotonic() + seconds
counter = itertools.count()

def guess():
    while time.monotonic() < end:
        secret = base64.b64encode(b"prometheus:guess%d" % next(counter)).decode()
        head = f"GET /metrics HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\n"
        head += f"Authorization: Basic {secret}\\r\\n\\r\\n"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(head.encode())
                while s.recv(65536):
                    pass
        except OSError:
            time.sleep(0.01)

threads = [threading.Thread(target=guess) for _ in range(80)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


@pytest.mark.slow
def test_wrong_passwords_never_lock_out_scrapes_and_probes(tmp_path):
    """Round 4, HIGH 4: with basic auth, 80 clients sending never-seen wrong passwords held
    every connection slot, the reserve included, while their bcrypt checks queued one at a
    time: new /metrics with the right password were 503 in 19 of 20, /healthz (no password)
    too. Now at most MAX_PENDING_CHECKS requests wait for a check; the others get 503 and a
    close at once, so slots turn over and scrapes and probes get in."""
    import base64

    import bcrypt

    from tests.support.pki import web_config

    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(10)).decode()
    users = web_config(tmp_path, f"basic_auth_users:\n  prometheus: {hashed}\n")
    secret = base64.b64encode(b"prometheus:s3cret").decode()
    with served(tmp_path, web_config_file=str(users)) as (server, _):
        address = ("127.0.0.1", server.port)
        # Prometheus's password is known (checked once) before the storm starts.
        warm = http.client.HTTPConnection(*address, timeout=10)
        warm.request("GET", "/metrics", headers={"Authorization": f"Basic {secret}"})
        assert warm.getresponse().status == 200
        warm.close()
        guessers = subprocess.Popen(
            [sys.executable, "-c", PASSWORD_GUESSERS, str(server.port), "8"],
            stderr=subprocess.PIPE,
        )
        try:
            time.sleep(2.0)  # every guesser asking
            statuses = []
            for i in range(40):
                if i % 2:
                    statuses.append(status_line(address, "/healthz"))
                    continue
                try:
                    connection = http.client.HTTPConnection(*address, timeout=10)
                    connection.request(
                        "GET", "/metrics", headers={"Authorization": f"Basic {secret}"}
                    )
                    statuses.append(b"HTTP/1.1 %d" % connection.getresponse().status)
                    connection.close()
                except (OSError, http.client.HTTPException):
                    statuses.append(b"")
                time.sleep(0.05)
        finally:
            guessers.communicate(timeout=30)
            close_pipes(guessers)
    counts = Counter(s[:12] for s in statuses)
    assert counts == {b"HTTP/1.1 200": 40}, counts


@pytest.mark.slow
def test_answers_a_client_does_not_read_wait_in_its_buffer_one_at_a_time(tmp_path):
    """Round 4, HIGH 6: the direct path (gone since) wrote each whole /metrics answer at
    once, ignoring the transport's backpressure: clients that asked and never read grew the
    process by hundreds of MB. Every request is uvicorn's now: a pipelined one waits for the
    answer before it, which waits for the buffer to drain, and reading stops meanwhile."""
    request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with served(tmp_path) as (server, _):
        clients = []
        for _ in range(8):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", server.port))
            sock.setblocking(False)
            clients.append(sock)
        for _ in range(1000):  # a request every ~3 ms each, never reading an answer
            for sock in clients:
                with contextlib.suppress(OSError):
                    sock.send(request)
            time.sleep(0.003)
        time.sleep(1.0)
        connections = server.connections.open
        buffered = sum(c.transport.get_write_buffer_size() for c in connections)
        answer = len(status_line(("127.0.0.1", server.port), "/metrics"))  # still served
        for sock in clients:
            sock.close()
    # One answer (~11 KiB here) per connection that does not read, never 2,000.
    assert answer > 0
    assert buffered < 8 * (256 << 10), f"{buffered >> 10} KiB buffered"
