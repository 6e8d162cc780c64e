"""/metrics bytes, rendered once per new sample and shared by every scrape until the next.

The sample changes once per tick, so rebuilding the exposition on every scrape (0.8 ms of
prometheus_client's text format for 2 GPUs, held under the GIL of the inference server) is
waste: two Prometheus replicas scraping the same target, or a dashboard refreshing, cost one
render. prometheus_client stays the format's authority: its encoders write the text (text,
OpenMetrics and their escaping variants, chosen from the Accept header exactly as its own
servers choose) through templates that leave only the values to format on each render
(exporter.exposition_templates), and gzip is applied as its servers apply it.

What the collector reads decides when the bytes are stale: `fingerprint()` returns everything
that can change between ticks (the published state, the alerts, the action counts), compared
by equality. Other collectors in the registry (client_python's process metrics) are refreshed
with it, so they are at most one tick old.
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import Collector

from exporter.exposition_templates import TemplateRenderer, families_of

log = logging.getLogger(__name__)

# gzip level 1: paid once per tick that is scraped. Measured on the development machine
# (bench/render_cost's series): one GPU's 10 KiB in 43 us at level 1 against 110 us at 6, 8
# GPUs' 30 KiB in 58 against 241 us, for 8 % more bytes (2.8 against 2.6 KiB): on a pod
# network the bytes cost nothing, the CPU is the server's.
GZIP_LEVEL = 1
# zlib's default deflate state (a 32 KiB window, memLevel 8) is 256 KiB, allocated and freed
# by every compression: above glibc's mmap threshold, so each scrape's gzip mapped fresh pages
# and faulted them in (22 minor faults). In the helper on an H100 that gzip cost 0.43 ms of
# CPU a scrape (bench.helper_breakdown), a quarter of its HTTP thread. A 16 KiB window and
# memLevel 5 make it 80 KiB, taken from the heap: no fault, and a once-a-second compression
# of one GPU's body 190 us of CPU against 323 on the development VM (66 against 135 hot),
# for 1-3 % more bytes (the demo's bodies of 1, 8 and 32 GPUs: 3,030, 4,249 and 8,937 against
# 2,996, 4,139 and 8,831).
GZIP_WINDOW_BITS = 14
GZIP_MEM_LEVEL = 5


def gzip_compress(data: bytes) -> bytes:
    """`data` as one gzip member (RFC 1952): GZIP_LEVEL, with the smaller state above."""
    wbits = 16 + GZIP_WINDOW_BITS  # 16+: a gzip header and trailer around the deflate data
    deflate = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, wbits, GZIP_MEM_LEVEL)
    return deflate.compress(data) + deflate.flush()


# Distinct Accept headers remembered (Prometheus sends one; a scanner must not grow the map).
MAX_ACCEPT_HEADERS = 16


class RenderFailed(Exception):
    """The exposition could not be rendered; str() says why in one line."""


class RenderFailures:
    """Renders that raised, counted (gpumem_exporter_render_failures_total, on the next
    answer that renders) and the last one's reason while it lasts (/healthz says "failing"):
    a value that breaks the render once gave every scrape a 500 while /healthz said ok."""

    def __init__(self) -> None:
        self.count = 0
        self.last: str | None = None  # None once a render succeeds again


@dataclass(frozen=True)
class Body:
    data: bytes
    content_type: str
    gzipped: bool


class ExpositionCache:
    """Renders the registry's `collectors` (all of them, in its order) at most once per
    fingerprint and format; safe from any thread."""

    def __init__(
        self,
        collectors: Sequence[Collector],
        fingerprint: Callable[[], object],
        failures: RenderFailures | None = None,
    ) -> None:
        self._collectors = tuple(collectors)
        self.failures = failures if failures is not None else RenderFailures()
        self._fingerprint = fingerprint
        self._lock = threading.Lock()
        self._key: object = None
        self._bodies: dict[tuple[str, bool], Body] = {}
        self._encoders: dict[str, tuple[Callable[[Collector], bytes], str]] = {}
        self._renderers: dict[str, TemplateRenderer] = {}  # by content type
        self.renders = 0  # how many times the registry was rendered (tests, benchmarks)

    def body(self, accept: str, accept_encoding: str) -> Body:
        encoder, content_type = self._encoder(accept)
        gzipped = gzip_accepted(accept_encoding)
        # Read before rendering: a tick that lands during the render makes the next scrape
        # render again instead of the new state being hidden behind old bytes.
        key = self._fingerprint()
        with self._lock:
            if key != self._key:
                self._key, self._bodies = key, {}
            cached = self._bodies.get((content_type, gzipped))
            if cached is not None:
                return cached
            # Rendered under the lock: concurrent scrapes of a new tick wait for one render
            # instead of each paying for their own.
            plain = self._bodies.get((content_type, False))
            if plain is None:
                plain = Body(self._render_or_say(encoder, content_type), content_type, False)
                self.renders += 1
                self._bodies[(content_type, False)] = plain
            if not gzipped:
                return plain
            body = Body(gzip_compress(plain.data), content_type, True)
            self._bodies[(content_type, True)] = body
            return body

    def _render_or_say(self, encoder: Callable[[Collector], bytes], content_type: str) -> bytes:
        failures = self.failures
        try:
            data = self._render(encoder, content_type)
        except Exception as exc:  # any collector's bug: one answer fails, never the server
            reason = f"{type(exc).__name__}: {exc}"[:300]
            if reason != failures.last:  # logged once while it lasts, not on every scrape
                log.error("gpumem-exporter: /metrics could not be rendered: %s", reason)
            failures.count += 1
            failures.last = reason
            raise RenderFailed(reason) from exc
        failures.last = None
        return data

    def _render(self, encoder: Callable[[Collector], bytes], content_type: str) -> bytes:
        # The content type names the format, its version and escaping: one encoder each.
        renderer = self._renderers.get(content_type)
        if renderer is None:
            renderer = self._renderers[content_type] = TemplateRenderer(encoder)
        return renderer.render(families_of(self._collectors))

    def _encoder(self, accept: str) -> tuple[Callable[[Collector], bytes], str]:
        found = self._encoders.get(accept)
        if found is None:
            found = choose_encoder(accept)
            if len(self._encoders) < MAX_ACCEPT_HEADERS:
                self._encoders[accept] = found
        return found
