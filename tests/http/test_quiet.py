"""uvicorn without its wake-ups (exporter.internals.QuietServer): the HTTP thread sleeps while
nobody asks, stops at once when told from another thread or by a signal, and the Date it sends
(exporter.http.guard.AnswerWatch) is the current second."""

from __future__ import annotations

import http.client
import signal
import subprocess
import sys
import textwrap
import threading
import time
from email.utils import parsedate_to_datetime

import pytest

from exporter.http.server import HTTP_THREAD
from tests.helpers import kill_process, served


def _thread_cpu_s(name: str) -> float:
    thread = next(t for t in threading.enumerate() if t.name == name)
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


@pytest.mark.slow
def test_an_idle_server_does_not_wake(tmp_path) -> None:
    """uvicorn's own loop woke ten times a second (3 ms of CPU per second in the serving
    process); idle, the HTTP thread now runs nothing. Measured on the thread's CPU clock,
    which counts only its own work."""
    with served(tmp_path) as (server, _):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        conn.request("GET", "/metrics")  # a kept-alive connection, as Prometheus holds
        conn.getresponse().read()
        time.sleep(0.2)
        before = _thread_cpu_s(HTTP_THREAD)
        time.sleep(2.0)
        idle_ms = (_thread_cpu_s(HTTP_THREAD) - before) * 1000
        conn.close()
    # 20 wake-ups of uvicorn's loop cost ~6 ms on this kind of machine; none costs nothing.
    assert idle_ms < 0.5, f"the idle HTTP thread used {idle_ms:.2f} ms of CPU in 2 s"


def test_stop_from_another_thread_is_prompt(tmp_path) -> None:
    with served(tmp_path) as (server, _):
        thread = server._thread
        assert thread is not None
        started = time.monotonic()
        server.stop()
        stopped_in = time.monotonic() - started
        assert not thread.is_alive()
    assert stopped_in < 1.5, f"stop() took {stopped_in:.2f} s"


@pytest.mark.slow
def test_the_date_header_is_the_current_second(tmp_path) -> None:
    """No timer refreshes it any more: each request does. Two requests seconds apart, on
    the open routes' shortcut and through the app, each carry their own second."""
    with served(tmp_path) as (server, _):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        for path in ("/healthz", "/", "/healthz"):  # shortcut, the app's page, shortcut again
            time.sleep(1.1)
            asked = time.time()
            conn.request("GET", path)
            response = conn.getresponse()
            response.read()
            date = parsedate_to_datetime(response.headers["Date"]).timestamp()
            assert int(asked) <= date <= time.time(), (path, date, asked)
        conn.close()


_SERVE_IN_MAIN_THREAD = textwrap.dedent(
    """
    import sys
    from exporter.http.server import HttpServer, create_app
    from tests.helpers import make_app
    app, runtime = make_app(__import__("pathlib").Path(sys.argv[1]))
    server = HttpServer(app, "127.0.0.1", 0)
    print(server.port, flush=True)
    server.run()  # as `gpumem-exporter run` and the node daemon serve
    print("stopped", flush=True)
    """
)


@pytest.mark.slow
def test_a_signal_stops_a_server_in_the_main_thread(tmp_path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE_IN_MAIN_THREAD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/readyz")
        assert conn.getresponse().status == 200
        conn.close()
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=10)
        assert time.monotonic() - started < 3
    finally:
        kill_process(process)
