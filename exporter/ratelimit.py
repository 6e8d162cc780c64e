"""Log lines that cannot flood the host's logs: at most one per key per interval."""

from __future__ import annotations

import logging
import time

# At most one log line per key per this many seconds: a broken source ticking at 10 Hz, or an
# agent sending garbage, must not flood the inference server's logs.
LOG_EVERY_S = 60.0


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, every_s: float = LOG_EVERY_S) -> None:
        self._log = logger
        self._every_s = every_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, key: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self._every_s) < self._every_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        suppressed = self._suppressed.pop(key, 0)
        self._last[key] = now
        more = f" ({suppressed} similar suppressed)" if suppressed else ""
        self._log.log(level, "%s%s", message, more)

    def error(self, key: str, message: str, exc: BaseException) -> None:
        self.log(logging.ERROR, key, f"{message}: {type(exc).__name__}: {exc}")

    def warning(self, key: str, message: str) -> None:
        self.log(logging.WARNING, key, message)
