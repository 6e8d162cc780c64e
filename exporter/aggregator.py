"""The aggregator of `gpumem-exporter run`: one endpoint for every CUDA process of a server.

Agents (exporter.agent) connect to a Unix socket in a 0700 folder made for this run; the
aggregator also checks each peer's uid (SO_PEERCRED). It is a source for the sampler: each
connected process's latest allocator readings, labelled with its pid, rank, local_rank and
role. A process that exits closes its connection and its series disappear with it; counters
are the process's own, so they stay monotonic per process. Commands fan out over the same
connections.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import socket
import struct
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exporter.agent import SOCKET_NAME
from exporter.sample import AllocatorReading, SourceReading

log = logging.getLogger("exporter.aggregator")


@dataclass
class _Peer:
    sock: socket.socket
    process: dict[str, str] = field(default_factory=dict)
    allocators: list[AllocatorReading] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message: dict[str, Any]) -> None:
        with self.lock:
            self.sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


class Aggregator:
    name = "processes"

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.socket_path = Path(run_dir) / SOCKET_NAME
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        self._server.listen(64)
        self._peers: dict[int, _Peer] = {}  # fileno -> peer
        self._lock = threading.Lock()
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._closed = False
        threading.Thread(target=self._accept, name="gpumem-aggregator", daemon=True).start()

    # -- connections ---------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            if not self._same_user(sock):
                sock.close()
                continue
            peer = _Peer(sock)
            threading.Thread(
                target=self._serve, args=(peer,), name="gpumem-aggregator-peer", daemon=True
            ).start()

    @staticmethod
    def _same_user(sock: socket.socket) -> bool:
        peercred = getattr(socket, "SO_PEERCRED", None)
        if peercred is None:  # not Linux: the 0700 folder is the guard
            return True
        creds = sock.getsockopt(socket.SOL_SOCKET, peercred, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        return bool(uid == os.getuid())

    def _serve(self, peer: _Peer) -> None:
        key = peer.sock.fileno()
        buffer = b""
        try:
            while True:
                chunk = peer.sock.recv(1 << 20)
                if not chunk:
                    break
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    self._handle(key, peer, line)
        except OSError:
            pass
        finally:
            with self._lock:
                self._peers.pop(key, None)
            peer.sock.close()
            if peer.process:
                log.info("process %s (%s) left", peer.process.get("pid"), peer.process.get("role"))

    def _handle(self, key: int, peer: _Peer, line: bytes) -> None:
        try:
            message = json.loads(line)
            kind = message.get("type")
            if kind == "hello":
                peer.process = {k: str(v) for k, v in dict(message["process"]).items()}
                with self._lock:
                    self._peers[key] = peer
                log.info(
                    "process %s (%s) joined", peer.process.get("pid"), peer.process.get("role")
                )
            elif kind == "sample":
                readings = [AllocatorReading(**a) for a in message["allocators"]]
                for reading in readings:
                    reading.process = dict(peer.process)
                peer.allocators = readings
            elif kind == "reply":
                future = self._pending.pop(int(message["id"]), None)
                if future is not None:
                    future.set_result(message)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("bad message from an agent: %s", exc)

    # -- source --------------------------------------------------------------------------

    def read(self) -> SourceReading:
        with self._lock:
            peers = list(self._peers.values())
        return SourceReading(allocators=[a for p in peers for a in p.allocators])

    def close(self) -> None:
        self._closed = True
        self._server.close()
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            with contextlib.suppress(OSError):
                peer.sock.shutdown(socket.SHUT_RDWR)
        self.socket_path.unlink(missing_ok=True)

    # -- fan-out -------------------------------------------------------------------------

    def command(
        self,
        action: str,
        params: dict[str, Any],
        *,
        pid: int | None = None,
        rank: int | None = None,
        timeout_s: float = 60.0,
    ) -> list[dict[str, Any]]:
        """Run `action` in every process (or those matching pid/rank); one result each."""
        with self._lock:
            peers = [
                p
                for p in self._peers.values()
                if (pid is None or p.process.get("pid") == str(pid))
                and (rank is None or p.process.get("rank") == str(rank))
            ]
        waiting: list[tuple[_Peer, Future[dict[str, Any]]]] = []
        results: list[dict[str, Any]] = []
        for peer in peers:
            request_id = next(self._ids)
            future: Future[dict[str, Any]] = Future()
            self._pending[request_id] = future
            try:
                peer.send({"type": "command", "id": request_id, "action": action, "params": params})
            except OSError as exc:
                self._pending.pop(request_id, None)
                results.append(
                    {"process": peer.process, "ok": False, "error": f"process unreachable: {exc}"}
                )
                continue
            waiting.append((peer, future))
        for peer, future in waiting:
            try:
                reply = future.result(timeout=timeout_s)
            except FutureTimeout:
                results.append(
                    {
                        "process": peer.process,
                        "ok": False,
                        "error": f"no answer within {timeout_s:g} s",
                    }
                )
                continue
            entry = {"process": peer.process, "ok": bool(reply.get("ok"))}
            if reply.get("ok"):
                entry["result"] = reply.get("result")
            else:
                entry["error"] = reply.get("error", "unknown error")
            results.append(entry)
        return results
