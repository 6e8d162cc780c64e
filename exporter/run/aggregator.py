"""The aggregator of `gpumem-exporter run`: one endpoint for every CUDA process of a server.

Agents (exporter.run.agent) connect to a Unix socket in a 0700 folder made for this run; the
aggregator also checks each peer's uid (SO_PEERCRED) and takes its pid from the socket, not
from what it says. It is a source for the sampler: each connected process's latest allocator
readings, labelled with its pid, rank, local_rank and role. A process that exits closes its
connection and its series disappear with it; counters are the process's own, so they stay
monotonic per process. Commands fan out over the same connections.

Nothing an agent sends can hurt another process's series or the endpoint: each message is
bounded and validated (exporter.run.protocol); a bad one drops that process's sample and is
counted by reason; a line over the size bound closes that connection.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exporter.actions.base import ProcessCounts, ProcessResult, Target
from exporter.ratelimit import RateLimitedLog
from exporter.run import protocol
from exporter.run.agent import SOCKET_NAME
from exporter.sample import ActionCounts, AllocatorReading, PinnedHostReading, SourceReading

log = logging.getLogger("exporter.aggregator")


@dataclass
class _Peer:
    sock: socket.socket
    pid: int
    process: dict[str, str] = field(default_factory=dict)
    allocators: list[AllocatorReading] = field(default_factory=list)
    counts: ActionCounts = field(default_factory=ActionCounts)
    pinned_host: PinnedHostReading | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message: dict[str, Any]) -> None:
        with self.lock:
            self.sock.sendall(protocol.encode(message))


class Aggregator:
    name = "agents"

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.socket_path = Path(run_dir) / SOCKET_NAME
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        self._server.listen(64)
        self._peers: dict[int, _Peer] = {}  # fileno -> peer
        self._lock = threading.Lock()
        self._pending: dict[int, Future[ProcessResult]] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self.rejected: Counter[str] = Counter()  # reason -> messages
        self._log = RateLimitedLog(log)
        threading.Thread(target=self._accept, name="gpumem-aggregator", daemon=True).start()

    # -- connections ---------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            creds = self._peer_credentials(sock)
            if creds is None:
                sock.close()
                continue
            threading.Thread(
                target=self._serve,
                args=(_Peer(sock, creds),),
                name="gpumem-aggregator-peer",
                daemon=True,
            ).start()

    @staticmethod
    def _peer_credentials(sock: socket.socket) -> int | None:
        """The peer's pid if it runs as this user, else None (connection refused)."""
        peercred = getattr(socket, "SO_PEERCRED", None)
        if peercred is None:  # not Linux: the 0700 folder is the guard; pid from hello
            return 0
        creds = sock.getsockopt(socket.SOL_SOCKET, peercred, struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", creds)
        return int(pid) if uid == os.getuid() else None

    def _serve(self, peer: _Peer) -> None:
        key = peer.sock.fileno()
        reader = protocol.LineReader()
        try:
            while True:
                chunk = peer.sock.recv(1 << 16)
                if not chunk:
                    break
                for line in reader.feed(chunk):
                    self._handle(key, peer, line)
        except protocol.ProtocolError as exc:  # a line over the bound: no way to resync
            self._reject(peer, exc)
        except OSError:
            pass
        except Exception as exc:  # a bug here must not kill the aggregator's threads
            log.error("agent connection failed: %s: %s", type(exc).__name__, exc)
        finally:
            with self._lock:
                self._peers.pop(key, None)
            peer.sock.close()
            if peer.process:
                log.info("process %s (%s) left", peer.process.get("pid"), peer.process.get("role"))

    def _reject(self, peer: _Peer, exc: protocol.ProtocolError) -> None:
        with self._lock:
            self.rejected[exc.reason] += 1
        peer.allocators = []  # that process's sample is dropped, nobody else's
        peer.pinned_host = None
        who = peer.process.get("pid") or peer.pid or "?"
        self._log.warning(f"agent:{exc.reason}", f"rejected a message from pid {who}: {exc}")

    def _handle(self, key: int, peer: _Peer, line: bytes) -> None:
        try:
            message = protocol.decode(line)
            kind = message["type"]
            if kind == "hello":
                process = protocol.parse_hello(message)
                if peer.pid:
                    process["pid"] = str(peer.pid)  # the socket's word, not the agent's
                peer.process = process
                with self._lock:
                    self._peers[key] = peer
                log.info("process %s (%s) joined", process.get("pid"), process.get("role"))
            elif not peer.process:
                raise protocol.ProtocolError("order", f"a {kind} message before hello")
            elif kind == "sample":
                readings, counts = protocol.parse_sample(message)
                for reading in readings:
                    reading.process = dict(peer.process)
                pinned = protocol.parse_pinned_host(message)
                if pinned is not None:
                    pinned.process = dict(peer.process)
                peer.allocators, peer.counts, peer.pinned_host = readings, counts, pinned
            elif kind == "reply":
                request_id, result = protocol.parse_reply(message)
                result.process = dict(peer.process)
                with self._lock:
                    future = self._pending.pop(request_id, None)
                if future is not None and not future.done():
                    future.set_result(result)
            else:
                raise protocol.ProtocolError("type", f"an agent may not send {kind!r}")
        except protocol.ProtocolError as exc:
            self._reject(peer, exc)

    def processes(self) -> list[dict[str, str]]:
        with self._lock:
            return [dict(p.process) for p in self._peers.values()]

    def gpu_users(self) -> frozenset[tuple[str, str]]:
        """(pid, GPU UUID) of every process reporting an allocator: who uses which GPU."""
        with self._lock:
            return frozenset(
                (a.process.get("pid", ""), a.gpu_uuid)
                for p in self._peers.values()
                for a in p.allocators
            )

    # -- source --------------------------------------------------------------------------

    def read(self) -> SourceReading:
        with self._lock:
            peers = list(self._peers.values())
            rejected = dict(self.rejected)
        return SourceReading(
            allocators=[a for p in peers for a in p.allocators],
            pinned_host=[p.pinned_host for p in peers if p.pinned_host is not None],
            rejected_messages=rejected,
        )

    def action_counts(self) -> list[ProcessCounts]:
        with self._lock:
            return [ProcessCounts(dict(p.process), p.counts) for p in self._peers.values()]

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
        self, action: str, params: dict[str, Any], target: Target, *, timeout_s: float = 60.0
    ) -> list[ProcessResult]:
        """Run `action` in every process that uses CUDA (or those `target` names); one result
        each, in pid order. A process that cannot be reached or does not answer in time gets
        a failed result; the others are not held up beyond the timeout."""
        with self._lock:
            peers = sorted(
                (p for p in self._peers.values() if p.allocators and target.matches(p.process)),
                key=lambda p: int(p.process.get("pid") or 0),
            )
        waiting: list[tuple[_Peer, int, Future[ProcessResult]]] = []
        results: list[ProcessResult] = []
        for peer in peers:
            request_id = next(self._ids)
            future: Future[ProcessResult] = Future()
            with self._lock:
                self._pending[request_id] = future
            try:
                peer.send(protocol.command(request_id, action, params))
            except OSError as exc:
                results.append(
                    self._gave_up(peer, request_id, f"unreachable: {exc}", "unreachable")
                )
                continue
            waiting.append((peer, request_id, future))
        deadline = time.monotonic() + timeout_s
        for peer, request_id, future in waiting:
            try:
                results.append(future.result(timeout=max(deadline - time.monotonic(), 0.0)))
            except FutureTimeout:
                error = f"no answer within {timeout_s:g} s"
                results.append(self._gave_up(peer, request_id, error, "timeout"))
        return sorted(results, key=lambda r: int(r.process.get("pid") or 0))

    def _gave_up(self, peer: _Peer, request_id: int, error: str, outcome: str) -> ProcessResult:
        with self._lock:
            self._pending.pop(request_id, None)
        return ProcessResult(dict(peer.process), False, error=error, outcome=outcome)
