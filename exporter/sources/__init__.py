"""Sources: one module per thing the exporter reads. A source reads; it never writes metrics.

Each source is a small class with a `name` and a `read()` that returns a SourceReading (empty
when there is nothing to report, which is not an error) and raises only when the read itself
failed. The sampler times every read, counts failures and keeps one failing source from
stopping the others.
"""

from __future__ import annotations

from typing import Protocol

from exporter.sample import SourceReading


class Source(Protocol):
    name: str

    def read(self) -> SourceReading: ...

    def close(self) -> None: ...
