"""The guard as a wrapper of uvicorn's protocol (exporter.http.guard): an answer leaves the
server as one write, head and body together, and the connection it came on learns where it
started and ended. The real server on a real socket."""

from __future__ import annotations

import http.client
import time

from tests.helpers import served


def _metrics(conn: http.client.HTTPConnection) -> bytes:
    conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
    response = conn.getresponse()
    assert response.status == 200
    return response.read()


def test_an_answer_leaves_as_one_write_and_its_connection_sees_it_end(tmp_path):
    """uvicorn writes an answer's head and body apart, and with TCP_NODELAY each write was a
    segment of its own (two sends a scrape): gathered, one /metrics answer is one write."""
    with served(tmp_path) as (server, _):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        try:
            _metrics(conn)
            (connection,) = server.connections.open
            transport = connection.transport
            written: list[int] = []
            write = transport.write

            def counted(data: bytes) -> None:
                written.append(len(data))
                write(data)

            transport.write = counted
            body = _metrics(conn)
            time.sleep(0.05)  # nothing more follows the answer
            assert len(written) == 1, written
            assert written[0] > len(body)  # the head and the whole body
            assert connection.in_flight == 0 and not connection.answering
            assert connection.client == ("127.0.0.1", conn.sock.getsockname()[1])
        finally:
            conn.close()
