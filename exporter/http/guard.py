"""Slow and hostile clients: a deadline for reading each request, and a cap on connections.

uvicorn bounds only the wait between requests on a kept-alive connection. A client that sends
half a request head (or trickles a body) is held forever, and each such connection holds a file
descriptor: enough of them (1,100 were all held) and `accept` fails for Prometheus too. This
protocol adds the two bounds the exporter needs:

- a whole request (head and body; admin bodies are at most 16 KiB) must arrive within
  READ_TIMEOUT_S of its first byte, or of the connection opening;
- at most MAX_CONNECTIONS are open. A new connection beyond that closes the oldest one still
  reading a request, else the oldest idle kept-alive one (a scraper reconnects at no cost),
  else itself: a request being answered is never cut.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64


class GuardedH11Protocol(H11Protocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.opened = time.monotonic()
        self._read_deadline: asyncio.TimerHandle | None = None

    @property
    def reading(self) -> bool:
        """Waiting for the rest of a request (or for the first one)."""
        return self._read_deadline is not None

    @property
    def idle(self) -> bool:
        """Kept alive between requests: nothing read, nothing being answered."""
        return not self.reading and (self.cycle is None or self.cycle.response_complete)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        if len(self.connections) > MAX_CONNECTIONS:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            if not self.reading:  # the first bytes of the next request on a kept-alive one
                self._arm()
        else:  # the request is in (DONE), or the connection is over
            self._disarm()

    def _arm(self) -> None:
        self._read_deadline = self.loop.call_later(READ_TIMEOUT_S, self._too_slow)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _too_slow(self) -> None:
        self._read_deadline = None
        self.transport.close()  # a handler waiting for the body sees the client disconnect

    def _make_room(self) -> None:
        others = sorted(
            (c for c in self.connections if isinstance(c, GuardedH11Protocol) and c is not self),
            key=lambda c: c.opened,
        )
        victim = next((c for c in others if c.reading), None) or next(
            (c for c in others if c.idle), self
        )
        victim._disarm()
        victim.transport.close()
