"""uvicorn's server without its wake-ups: nothing runs on the HTTP thread while nobody asks.

uvicorn's main loop sleeps 0.1 s at a time to notice `should_exit` and to refresh the Date
header once a second: ten wake-ups a second, which cost 3 ms of CPU per second in the serving
process (measured: docs/performance.md), more than the exporter's own work. Here the main
loop waits for an exit event instead, set by `exit()` from any thread or by uvicorn's signal
handler, and the Date header is brought up to date by each request (`refresh_date`) rather
than by a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from email.utils import formatdate
from types import FrameType

import uvicorn
from uvicorn.server import ServerState

_date = (0, b"")  # (the second, its Date header value), shared: the clock is one


def refresh_date(state: ServerState, config: uvicorn.Config) -> None:
    """Keep the default headers' Date (RFC 9110: an origin server with a clock sends it) at
    the current second, as uvicorn's timer would have; formatted once a second."""
    global _date
    if not config.date_header:
        return
    second = int(time.time())
    if second != _date[0]:
        _date = (second, formatdate(second, usegmt=True).encode())
    headers = state.default_headers
    if not headers or headers[0] != (b"date", _date[1]):
        state.default_headers = [(b"date", _date[1]), *config.encoded_headers]


class QuietServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, on_shutdown: Callable[[], None] | None = None
    ) -> None:
        super().__init__(config)
        # Closes the connections that uvicorn does not know of (exporter.http.tls's).
        self._on_shutdown = on_shutdown
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit: asyncio.Event | None = None

    async def main_loop(self) -> None:
        await self.on_tick(0)  # the default headers, as uvicorn's first tick sets them
        # Set before should_exit is read: exit() from another thread either sees the event
        # or has set should_exit before this reads it.
        self._exit = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        while not self.should_exit:
            await self._exit.wait()
            self._exit.clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._on_shutdown is not None:
            self._on_shutdown()
        await super().shutdown(sockets)

    def exit(self) -> None:
        """Stop serving; safe from any thread."""
        self.should_exit = True
        self._wake()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)  # SIGINT/SIGTERM, when serving in the main thread
        self._wake()

    def _wake(self) -> None:
        loop, event = self._loop, self._exit
        if loop is None or event is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to wake
            loop.call_soon_threadsafe(event.set)
