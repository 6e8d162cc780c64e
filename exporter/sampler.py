"""The sidecar thread: reads every source at the interval and publishes one merged sample.

The sampler owns timing, error accounting and isolation (as node_exporter's frame does for its
collectors): each source is timed, a failing source is logged (rate-limited) and reported as
down while the others go on, and nothing raised by a source or a listener reaches the host
process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from exporter.ratelimit import RateLimitedLog
from exporter.sample import ExporterState, Sample, SourceStatus
from exporter.sources import Source

log = logging.getLogger(__name__)

Listener = Callable[[Sample], None]

# A paced sampler (Aggregator.pace) ticks when a process reports, once at least this much of
# an interval has passed since its last tick: its ticks then follow the reports, one a
# report at 1 Hz, however the two started; never more than one per 3/4 interval with many.
PACED_EARLIEST = 0.75
# ...and at the latest this much of an interval after its last, with no report: later than
# one interval, so that a report due just after the interval takes the tick (they lock).
PACED_LATEST = 1.5

# A source counts as failing once this many reads in a row have failed: one failed read (a
# transient NVML error) must not flap a health check.
FAILING_AFTER_READS = 3


class Sampler:
    """Ticks the sources; `tick()` can also be called directly (tests, one-shot reads)."""

    def __init__(
        self,
        sources: Sequence[Source],
        *,
        interval_s: float = 1.0,
        listeners: Sequence[Listener] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.sources = list(sources)
        self.interval_s = interval_s
        self.listeners = list(listeners)
        self._clock = clock
        self._state = ExporterState(sources={s.name: SourceStatus() for s in self.sources})
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._errors = RateLimitedLog(log)
        self._pid = os.getpid()
        self._ticked_at = 0.0

    # -- reading ------------------------------------------------------------------------

    def state(self) -> ExporterState:
        """The latest published state; cheap, safe from any thread. A tick publishes a new
        state object and never changes one it has published, so no copy is needed."""
        with self._lock:
            return self._state

    @property
    def latest(self) -> Sample | None:
        with self._lock:
            return self._state.sample

    def failing_sources(self, after_reads: int = FAILING_AFTER_READS) -> dict[str, SourceStatus]:
        """The failures that leave this exporter with nothing to serve, or {} while it has.

        Conservative, because one source failing among working ones is normal (NVML on a host
        without a GPU, next to host memory) and shows on gpumem_exporter_source_up: only when
        every source has failed its last `after_reads` reads, or a source the mode cannot do
        without (`required = True`: the demo's replay) has.
        """
        with self._lock:
            sources = self._state.sources
        failed = {n: s for n, s in sources.items() if s.failed_reads >= after_reads}
        names = {source.name for source in self.sources}
        if names and names <= failed.keys():
            return failed
        required = {s.name for s in self.sources if getattr(s, "required", False)}
        return {name: failure for name, failure in failed.items() if name in required}

    def unavailable_sources(self) -> dict[str, str]:
        """Sources with nothing to read on this host, and why (SourceReading.unavailable)."""
        with self._lock:
            sources = self._state.sources
        return {name: s.unavailable for name, s in sorted(sources.items()) if s.unavailable}

    def sample_age_s(self) -> float | None:
        sample = self.latest
        return None if sample is None else max(self._clock() - sample.timestamp, 0.0)

    # -- ticking ------------------------------------------------------------------------

    def tick(self) -> Sample:
        sample = Sample(timestamp=0.0, self_pid=self._pid)
        statuses = {}
        for source in self.sources:
            previous = self._state.sources.get(source.name, SourceStatus())
            started = time.perf_counter()
            try:
                reading = source.read()
            except Exception as exc:
                duration = time.perf_counter() - started
                statuses[source.name] = SourceStatus(
                    False,
                    duration,
                    previous.errors + 1,
                    previous.failed_reads + 1,
                    " ".join(f"{type(exc).__name__}: {exc}".split())[:300],
                )
                self._errors.error(f"source:{source.name}", f"source {source.name} failed", exc)
                continue
            duration = time.perf_counter() - started
            statuses[source.name] = SourceStatus(
                True, duration, previous.errors, unavailable=reading.unavailable
            )
            sample.merge(reading)
        sample.timestamp = self._clock()
        with self._lock:
            self._state = ExporterState(sample=sample, sources=statuses)
        for listener in self.listeners:
            try:
                listener(sample)
            except Exception as exc:
                name = getattr(listener, "__name__", type(listener).__name__)
                self._errors.error(f"listener:{name}", f"sample listener {name} failed", exc)
        return sample

    # -- paced by another thread's wake-ups (Aggregator.pace) --------------------------------

    def due_at(self) -> float:
        """When a paced sampler ticks at the latest (time.monotonic()), heard from or not."""
        return self._ticked_at + PACED_LATEST * self.interval_s

    def paced_tick(self, heard: bool) -> None:
        """Tick if due: now that a process has reported (`heard`) and most of an interval has
        passed, or at due_at() without one. Called by the thread that just woke for the
        report, so the tick costs no wake-up of its own and serves the report at once."""
        if self._stop.is_set():
            return
        now = time.monotonic()
        since = now - self._ticked_at
        if since >= PACED_LATEST * self.interval_s or (
            heard and since >= PACED_EARLIEST * self.interval_s
        ):
            self._ticked_at = now
            self._guarded_tick()

    def _guarded_tick(self) -> None:
        try:
            self.tick()
        except Exception as exc:  # never let the thread die: it is the exporter
            self._errors.error("tick", "sampler tick failed", exc)

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            self._guarded_tick()
            next_tick += self.interval_s
            delay = next_tick - time.monotonic()
            if delay < 0:  # fell behind (slow source, suspended process): do not burst
                next_tick = time.monotonic()
                delay = 0
            self._stop.wait(delay)

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        # A daemon thread: an exporter must never keep the inference server from exiting.
        self._thread = threading.Thread(target=self._run, name="gpumem-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        for source in self.sources:
            try:
                source.close()
            except Exception as exc:
                self._errors.error(f"close:{source.name}", f"closing {source.name} failed", exc)
