"""Rates the exporter holds itself to: log lines that cannot flood the host's logs (at most one
per key per interval), and golang.org/x/time/rate's token bucket (the web config's rate limit,
the Kubernetes identity checks)."""

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


class TokenBucket:
    """`burst` tokens, one more every `interval_s`. Not locked: callers hold their own lock or
    run on one thread."""

    def __init__(self, interval_s: float, burst: int) -> None:
        self.interval_s, self.burst = interval_s, burst
        self.tokens, self.at = float(burst), time.monotonic()

    def allow(self, *, take: bool = True) -> bool:
        """Whether a token is there; `take` spends it (False: a look before work whose
        request asks again when it has its answer, a bcrypt check say)."""
        now = time.monotonic()
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) / self.interval_s)
        self.at = now
        if self.tokens >= 1.0:
            if take:
                self.tokens -= 1.0
            return True
        return False
