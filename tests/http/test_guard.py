"""The guard as a wrapper of uvicorn's protocol (exporter.http.guard): an answer leaves the
server as one write, head and body together, and the connection it came on learns where it
started and ended. The real server on a real socket."""

from __future__ import annotations

import http.client
import socket
import time

from tests.helpers import served, slow_reader, wait_until_stalled


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


def test_a_stopped_server_leaves_no_connection_open(tmp_path):
    """Clients that pipeline requests and never read hold answers that cannot be flushed:
    uvicorn's graceful shutdown closes them, which waits for ever, and the stopped server's
    loop left them open (their sockets, and a ResourceWarning when collected: a CI run
    failed on it). Stopped, the server closes them at once."""
    with served(tmp_path) as (server, _):
        readers = [slow_reader(("127.0.0.1", server.port), 400) for _ in range(3)]
        wait_until_stalled(server, len(readers))
    for sock in readers:
        sock.settimeout(5)
        try:
            while sock.recv(1 << 20):
                pass  # what the server had sent, then its end
        except ConnectionResetError:
            pass
        finally:
            sock.close()
    assert not server.connections.open


def test_a_websocket_upgrade_is_answered_as_plain_http(tmp_path):
    """The exporter serves no websockets, and a guarded connection is never handed to another
    protocol outside the guard (uvicorn would, were a websocket library installed beside it):
    an upgrade request is an HTTP request like any other."""
    with (
        served(tmp_path) as (server, _),
        socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock,
    ):
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade, close\r\n"
            b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:200]
