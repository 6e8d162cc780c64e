"""The agent in each Python process of a server run under `gpumem-exporter run`.

It is loaded by sitecustomize at interpreter start, so it imports only the standard library
and the allocator source (never torch, never the web stack). It stays idle until this process
has initialized CUDA itself, then connects to the aggregator's Unix socket (in a 0700 folder
that only the same user can reach) and sends its allocator readings every interval. The
aggregator can ask it to take a snapshot or empty its cache; the work runs here, in the
process that owns the allocator.

Protocol: newline-delimited JSON both ways.
  agent -> aggregator: {"type": "hello", "process": {...}}, {"type": "sample",
                       "allocators": [...]}, {"type": "reply", "id": .., "ok": .., ...}
  aggregator -> agent: {"type": "command", "id": .., "action": "snapshot"|"empty_cache",
                       "params": {...}}
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from exporter.sources.torch_allocator import TorchAllocatorSource

log = logging.getLogger("exporter.agent")

RUN_DIR_ENV = "GPUMEM_RUN_DIR"
SOCKET_NAME = "aggregator.sock"
RECONNECT_S = 5.0


def process_labels() -> dict[str, str]:
    """pid, rank, local_rank and role (GPUMEM_ROLE, else the process title)."""
    role = os.environ.get("GPUMEM_ROLE", "")
    if not role:
        try:  # reflects setproctitle(), which servers like vLLM use to name their processes
            with open("/proc/self/cmdline", "rb") as f:
                role = os.path.basename(f.read().split(b"\0")[0].decode(errors="replace"))
        except OSError:
            role = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return {
        "pid": str(os.getpid()),
        "rank": os.environ.get("RANK", ""),
        "local_rank": os.environ.get("LOCAL_RANK", ""),
        "role": role[:64],
    }


class Agent:
    def __init__(self, run_dir: str, interval_s: float = 1.0) -> None:
        self.socket_path = str(Path(run_dir) / SOCKET_NAME)
        self.interval_s = interval_s
        self.source = TorchAllocatorSource()
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._next_connect = 0.0
        self._actions: Any = None
        self.thread = threading.Thread(target=self._run, name="gpumem-agent", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._close()

    # -- sending -------------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        sock = self._sock
        if sock is None:
            return
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        with self._send_lock:
            sock.sendall(data)

    def _close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def _connect(self) -> bool:
        now = time.monotonic()
        if now < self._next_connect:
            return False
        self._next_connect = now + RECONNECT_S
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            return False
        self._sock = sock
        self._send({"type": "hello", "process": process_labels()})
        threading.Thread(
            target=self._read, args=(sock,), name="gpumem-agent-commands", daemon=True
        ).start()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                reading = self.source.read()  # empty until this process uses CUDA
                if not reading.allocators:
                    continue
                if self._sock is None and not self._connect():
                    continue
                self._send(
                    {"type": "sample", "allocators": [asdict(a) for a in reading.allocators]}
                )
            except OSError:
                self._close()  # the aggregator went away; retry later
            except Exception as exc:  # never let the agent disturb its host
                log.debug("agent tick failed: %s", exc)

    # -- commands ------------------------------------------------------------------------

    def _read(self, sock: socket.socket) -> None:
        buffer = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                if message.get("type") == "command":
                    threading.Thread(target=self._execute, args=(message,), daemon=True).start()

    def _execute(self, message: dict[str, Any]) -> None:
        reply: dict[str, Any] = {
            "type": "reply",
            "id": message.get("id"),
            "process": process_labels(),
        }
        try:
            reply["result"] = self._act(message.get("action", ""), message.get("params") or {})
            reply["ok"] = True
        except Exception as exc:
            from exporter.actions import ActionUnavailable

            reply["ok"] = False
            reply["error"] = str(exc)
            reply["unavailable"] = isinstance(exc, ActionUnavailable)
        try:
            self._send(reply)
        except OSError:
            self._close()

    def _act(self, action: str, params: dict[str, Any]) -> dict[str, Any]:
        from exporter.actions import Actions
        from exporter.config import load_config
        from exporter.snapshots import SnapshotStore

        if self._actions is None:
            config = load_config()
            self._actions = Actions(
                SnapshotStore(
                    config.snapshot_directory,
                    max_count=config.snapshot_max_count,
                    max_bytes=config.snapshot_max_bytes,
                )
            )
        actions = self._actions
        if action == "empty_cache":
            result = actions.empty_cache(params.get("device"))
            return {
                "devices": result.devices,
                "released_bytes": result.released_bytes,
                "reserved_before_bytes": {
                    str(k): v for k, v in result.reserved_before_bytes.items()
                },
                "reserved_after_bytes": {str(k): v for k, v in result.reserved_after_bytes.items()},
                "duration_s": result.duration_s,
            }
        if action == "snapshot":
            record_s = params.get("record_s")
            meta = {"process": process_labels()}
            if record_s:
                info = actions.store.reserve("record", meta=meta)
                actions.record_window(
                    info,
                    float(record_s),
                    max_entries=int(params.get("max_entries", 100_000)),
                    stacks=params.get("stacks", "python"),
                    context=params.get("context", "all"),
                )
            else:
                info = actions.snapshot("api", meta=meta)
            return info.public()
        raise ValueError(f"unknown action {action!r}")


_agent: Agent | None = None


def start_agent() -> Agent | None:
    """Start this process's agent if it runs under `gpumem-exporter run` (idempotent)."""
    global _agent
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir or _agent is not None:
        return _agent
    try:
        interval = float(os.environ.get("GPUMEM_INTERVAL_S", "1") or 1)
    except ValueError:
        interval = 1.0
    _agent = Agent(run_dir, interval_s=max(interval, 0.01))
    _agent.start()
    return _agent


def _after_fork_in_child() -> None:
    # Threads do not survive fork: a forked worker gets an agent of its own, which stays idle
    # until the worker initializes CUDA itself.
    global _agent
    if _agent is not None:
        # Close our copy of the parent's connection (close, not shutdown: the parent keeps
        # it), so that the aggregator sees the parent leave when it exits.
        _agent._close()
        _agent = None
        start_agent()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
