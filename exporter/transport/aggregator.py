"""The aggregator of `gpumem-exporter run`: one endpoint for every CUDA process of a server.

Agents (exporter.transport.agent) connect to a Unix socket in a 0700 folder made for this run; the
aggregator also checks each peer's uid (SO_PEERCRED) and takes its pid from the socket, not
from what it says. It is a source for the sampler: each connected process's latest allocator
readings, labelled with its pid, rank, local_rank and role. A process that exits closes its
connection and its series disappear with it; counters are the process's own, so they stay
monotonic per process. Commands fan out over the same connections.

Nothing an agent sends can hurt another process's series or the endpoint: each message is
bounded and validated (exporter.transport.protocol); a bad one drops that process's sample and is
counted by reason; a line over the size bound closes that connection. No local process can
blind it either: one thread serves every connection through a selector; at most MAX_PEERS are
open, and one that says no hello within HELLO_TIMEOUT_S is closed; running out of fds pauses
accepting instead of ending it; a pid registers once; only the process a command was sent to
may answer it; a rank its launch environment contradicts is replaced by that environment's.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Protocol

from exporter import budget
from exporter.actions.base import ProcessResult, Target
from exporter.probe import record
from exporter.ratelimit import RateLimitedLog
from exporter.sample import (
    AllocatorReading,
    ProcessCounts,
    SourceReading,
)
from exporter.transport import protocol
from exporter.transport.agent import SOCKET_NAME
from exporter.transport.peer import Peer, aged, environment_labels

log = logging.getLogger("exporter.aggregator")


# At most this many connections at once: far above the processes of one server (a node has
# at most 8 GPUs, a few workers each), far below what would exhaust the launcher's fds.
MAX_PEERS = 256
# A connection that has not said hello by then is closed: it holds an fd and a slot.
HELLO_TIMEOUT_S = 5.0
# After an accept fails for want of fds or memory, wait this long before the next one.
ACCEPT_BACKOFF_S = 0.2
# A peer that does not take a command within this long is given up on.
SEND_TIMEOUT_S = 5.0
_NO_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class Paced(Protocol):
    """What the aggregator's thread ticks (exporter.sampler.Sampler)."""

    def due_at(self) -> float: ...

    def paced_tick(self, heard: bool) -> None: ...


class Aggregator:
    name = "agents"

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        max_peers: int = MAX_PEERS,
        hello_timeout_s: float = HELLO_TIMEOUT_S,
        proc: str = "/proc",
        silent_after_s: float = 5.0,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        # A process that has not reported for this long is silent (stopped, or hung holding
        # its GIL): its last numbers are withdrawn and /readyz names it (issue 38).
        self.silent_after_s = silent_after_s
        # Called (on the aggregator's thread) when a connection opens or closes: the helper
        # waits on it to leave once the last process it serves has gone, instead of looking.
        self._on_change = on_change
        self.socket_path = Path(run_dir) / SOCKET_NAME
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        self._server.listen(64)
        self._server.setblocking(False)
        self._max_peers = max_peers
        self._hello_timeout_s = hello_timeout_s
        self._proc = proc
        self._peers: dict[int, Peer] = {}  # fileno -> peer that said hello
        self._connections: dict[int, Peer] = {}  # fileno -> every open connection
        self._lock = threading.Lock()
        # request id -> (the answer, the connection it was sent to: only that one may answer)
        self._pending: dict[int, tuple[Future[ProcessResult], int]] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self.rejected: Counter[str] = Counter()  # reason -> messages
        self.admitted = 0  # connections ever admitted
        self._log = RateLimitedLog(log)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._paced: Paced | None = None
        # close() and pace() wake the loop through this pair: the loop has no timer of its
        # own, so a helper serving one process at 1 Hz wakes once a tick, not three times
        # (each wake cost ~0.13 ms of CPU on the VMs measured: docs/performance.md).
        self._waker, self._woken = socket.socketpair()
        self._woken.setblocking(False)
        self._selector.register(self._woken, selectors.EVENT_READ)
        self._accept_paused_until = 0.0
        # One thread for every connection: a selector loop, not a thread per peer (3,000 idle
        # connections once made 3,006 threads).
        self._thread = threading.Thread(target=self._loop, name="gpumem-aggregator", daemon=True)
        self._thread.start()

    # -- connections ---------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closed:
            try:
                self._turn()
            except Exception as exc:  # the loop is every agent's link: it must go on
                if self._closed:
                    return
                self._log.error("loop", "agent connections loop failed", exc)
                time.sleep(0.1)

    def _turn(self) -> None:
        now = time.monotonic()
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._selector.register(self._server, selectors.EVENT_READ)
        heard = False
        for key, _ in self._selector.select(timeout=self._until_due(now)):
            if key.fileobj is self._server:
                self._accept()
            elif key.fileobj is self._woken:
                with contextlib.suppress(OSError):
                    self._woken.recv(64)
            else:
                self._read(key.data)
                heard = True
        self._expire_silent(time.monotonic())
        if self._paced is not None:
            self._paced.paced_tick(heard)

    def _until_due(self, now: float) -> float | None:
        """Seconds until something is due without a message (a connection's hello deadline,
        the end of an accept pause); None: nothing, wait for the sockets."""
        with self._lock:
            due = [
                p.connected_at + self._hello_timeout_s
                for p in self._connections.values()
                if not p.process
            ]
        if self._accept_paused_until:
            due.append(self._accept_paused_until)
        if self._paced is not None:
            due.append(self._paced.due_at())
        # A hair past the deadline: _expire_silent closes those strictly past it.
        return max(min(due) - now, 0.0) + 0.001 if due else None

    def _accept(self) -> None:
        for _ in range(64):  # a burst of connections, without starving the peers
            try:
                sock, _ = self._server.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _NO_RESOURCES:
                    # Out of fds or memory: stop accepting for a moment rather than spin or
                    # die; the agents' connections wait in the backlog.
                    self._log.warning(
                        "accept", f"cannot accept agent connections: {exc.strerror}; retrying"
                    )
                    self._selector.unregister(self._server)
                    self._accept_paused_until = time.monotonic() + ACCEPT_BACKOFF_S
                    return
                if self._closed:
                    return
                self._log.warning("accept", f"accepting an agent connection failed: {exc}")
                return
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        pid = self._peer_credentials(sock)
        if pid is None:
            sock.close()
            return
        if len(self._connections) >= self._max_peers:
            self._count("too_many_connections", f"refused pid {pid}: {self._max_peers} open")
            reason = f"all {self._max_peers} of the helper's process connections are taken"
            with contextlib.suppress(OSError):  # the agent says why on its handle
                sock.send(protocol.encode(protocol.refused(reason)), socket.MSG_DONTWAIT)
            sock.close()
            return
        sock.settimeout(SEND_TIMEOUT_S)  # reads happen only when the selector says so
        peer = Peer(sock, pid)
        with self._lock:
            self._connections[sock.fileno()] = peer
            self.admitted += 1
        self._selector.register(sock, selectors.EVENT_READ, peer)
        if self._on_change is not None:
            self._on_change()

    @staticmethod
    def _peer_credentials(sock: socket.socket) -> int | None:
        """The peer's pid if it runs as this user, else None (connection refused)."""
        peercred = getattr(socket, "SO_PEERCRED", None)
        if peercred is None:  # not Linux: the 0700 folder is the guard; pid from hello
            return 0
        creds = sock.getsockopt(socket.SOL_SOCKET, peercred, struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", creds)
        return int(pid) if uid == os.getuid() else None

    def _read(self, peer: Peer) -> None:
        try:
            chunk = peer.sock.recv(1 << 16)
        except (BlockingIOError, TimeoutError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(peer)
            return
        try:
            for line in peer.reader.feed(chunk):
                self._handle(peer, line)
        except protocol.ProtocolError as exc:  # over the bound, or no size: no way to resync
            self._reject(peer, exc)
            self._drop(peer)

    def _expire_silent(self, now: float) -> None:
        with self._lock:
            silent = [
                p
                for p in self._connections.values()
                if not p.process and now - p.connected_at > self._hello_timeout_s
            ]
        for peer in silent:
            self._count("hello_timeout", f"closed pid {peer.pid}: no hello")
            self._drop(peer)

    def _drop(self, peer: Peer) -> None:
        key = peer.sock.fileno()
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(peer.sock)
        with self._lock:
            self._connections.pop(key, None)
            registered = self._peers.pop(key, None) is not None
        peer.sock.close()
        if self._on_change is not None:
            self._on_change()
        if registered:
            log.info("process %s (%s) left", peer.process.get("pid"), peer.process.get("role"))

    def _count(self, reason: str, message: str) -> None:
        with self._lock:
            self.rejected[reason] += 1
        self._log.warning(f"agent:{reason}", message)

    def _reject(self, peer: Peer, exc: protocol.ProtocolError) -> None:
        with self._lock:
            self.rejected[exc.reason] += 1
        peer.allocators = []  # that process's sample is dropped, nobody else's
        peer.pinned_host = None
        who = peer.process.get("pid") or peer.pid or "?"
        self._log.warning(f"agent:{exc.reason}", f"rejected a message from pid {who}: {exc}")

    def _hello(self, peer: Peer, process: dict[str, str]) -> None:
        backed: dict[str, str] = {}
        if peer.pid:
            process["pid"] = str(peer.pid)  # the socket's word, not the agent's
            backed = environment_labels(peer.pid, self._proc)
            for name, value in backed.items():
                if process.get(name, "") != value:  # a claim its environment does not back
                    self._count("claim", f"pid {peer.pid} claimed {name}={process.get(name)!r}")
                    process[name] = value
        key = peer.sock.fileno()
        refused: list[str] = []
        with self._lock:
            taken = peer.pid and any(p.pid == peer.pid and k != key for k, p in self._peers.items())
            if not taken:
                refused = self._settle_claims(peer, process, backed)
                self._peers[key] = peer
                peer.process = process
        for claim in refused:
            self._count("claim", claim)
        if taken:
            raise protocol.ProtocolError("duplicate", f"pid {peer.pid} is registered already")
        log.info("process %s (%s) joined", process.get("pid"), process.get("role"))

    def _settle_claims(
        self, peer: Peer, process: dict[str, str], backed: dict[str, str]
    ) -> list[str]:
        """A rank its environment does not show stands only if it is a number no other
        process has: never a second rank 0 beside the real one (issue 38). A backed rank
        takes the label from an unbacked claim of it. Under self._lock; returns what it
        refused, to be counted."""
        refused = []
        for name in ("rank", "local_rank"):
            value = process.get(name, "")
            if not value:
                continue
            holders = [p for p in self._peers.values() if p.process.get(name) == value]
            if name in backed:
                for other in holders:
                    if name in other.unbacked:  # the environment's word over a claim
                        other.process[name] = ""
                        other.unbacked.discard(name)
                        refused.append(f"pid {other.pid} lost unbacked {name}={value!r}")
                continue
            if value.isdigit() and not holders:
                peer.unbacked.add(name)
            else:
                process[name] = ""
                refused.append(f"pid {peer.pid} claimed {name}={value!r}, unbacked and taken")
        return refused

    def _handle(self, peer: Peer, line: bytes) -> None:
        if line[:4] == record.MAGIC:
            try:
                peer.take_record(line)
            except protocol.ProtocolError as exc:
                self._reject(peer, exc)
            except record.RecordError as exc:
                self._reject(peer, protocol.ProtocolError(exc.reason, str(exc)))
            return
        if line[:1] == protocol.OLD_RECORD_LINE:  # a probe of version 1: refused, not misread
            self._reject(peer, protocol.ProtocolError("record_version", "a version 1 record"))
            return
        try:
            message = protocol.decode(line)
            kind = message["type"]
            if kind == "hello":
                if peer.process:
                    raise protocol.ProtocolError("order", "a second hello")
                self._hello(peer, protocol.parse_hello(message))
            elif not peer.process:
                raise protocol.ProtocolError("order", f"a {kind} message before hello")
            elif kind == "sample":
                peer.take_sample(message)
            elif kind == "reply":
                request_id, result = protocol.parse_reply(message)
                result.process = dict(peer.process)
                with self._lock:
                    pending = self._pending.get(request_id)
                    if pending is not None and pending[1] == peer.id:
                        del self._pending[request_id]
                    else:
                        pending = None
                if pending is None:
                    raise protocol.ProtocolError(
                        "reply", f"a reply to request {request_id}, which was not sent to it"
                    )
                future = pending[0]
                if not future.done():
                    future.set_result(result)
            else:
                raise protocol.ProtocolError("type", f"an agent may not send {kind!r}")
        except protocol.ProtocolError as exc:
            self._reject(peer, exc)

    def connections(self) -> int:
        """Open connections from agents (said hello or not): whether anyone is served."""
        with self._lock:
            return len(self._connections)

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
        now = time.monotonic()
        # A silent process's last numbers are not served as if they were current.
        peers = [p for p in peers if not self._silent(p, now)]
        allocators: list[AllocatorReading] = []
        over = {"per_process": 0, "per_endpoint": 0}
        for peer in sorted(peers, key=lambda p: p.id):  # the first connected keep their place
            mine, dropped = budget.take(peer.allocators, budget.PER_PROCESS)
            over["per_process"] += dropped
            mine, dropped = budget.take(mine, budget.PER_ENDPOINT - len(allocators))
            over["per_endpoint"] += dropped
            allocators.extend(aged(a, now - peer.sampled_at) for a in mine)
        if any(over.values()):
            self._log.warning(
                "budget",
                f"agents sent more allocator readings than one endpoint serves: "
                f"{over['per_process']} over {budget.PER_PROCESS} a process, "
                f"{over['per_endpoint']} over {budget.PER_ENDPOINT} in all; left out",
            )
        return SourceReading(
            allocators=allocators,
            pinned_host=[p.pinned_host for p in peers if p.pinned_host is not None],
            rejected_messages=rejected,
            over_budget=over,
        )

    def _silent(self, peer: Peer, now: float) -> bool:
        return peer.quiet_s(now) > self.silent_after_s

    def silent_processes(self) -> list[tuple[dict[str, str], float]]:
        """(labels, seconds since its last report) of each process that has gone silent."""
        with self._lock:
            peers = list(self._peers.values())
        now = time.monotonic()
        return [(dict(p.process), p.quiet_s(now)) for p in peers if self._silent(p, now)]

    def action_counts(self) -> list[ProcessCounts]:
        with self._lock:
            return [
                ProcessCounts(dict(p.process), p.counts, p.reported_at)
                for p in self._peers.values()
            ]

    def pace(self, paced: Paced) -> None:
        """Tick `paced` (the helper's sampler) on this thread, as processes report: a helper
        serving one process at 1 Hz then wakes once a tick for both, where its own sampler
        thread woke once more (each wake ~0.13 ms of CPU on a VM), and serves each report at
        once rather than up to an interval later."""
        self._paced = paced
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._waker.send(b"x")

    def close(self) -> None:
        self._closed = True
        self._wake()
        self._thread.join(2.0)
        with self._lock:
            connections = list(self._connections.values())
            self._connections.clear()
            self._peers.clear()
        for peer in connections:
            with contextlib.suppress(OSError):
                peer.sock.shutdown(socket.SHUT_RDWR)
            peer.sock.close()
        self._server.close()
        self._selector.close()
        self._waker.close()
        self._woken.close()
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
        waiting: list[tuple[Peer, int, Future[ProcessResult]]] = []
        results: list[ProcessResult] = []
        for peer in peers:
            request_id = next(self._ids)
            future: Future[ProcessResult] = Future()
            with self._lock:
                self._pending[request_id] = (future, peer.id)
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

    def _gave_up(self, peer: Peer, request_id: int, error: str, outcome: str) -> ProcessResult:
        with self._lock:
            self._pending.pop(request_id, None)
        return ProcessResult(dict(peer.process), False, error=error, outcome=outcome)
