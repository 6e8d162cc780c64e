"""A way of running, declared: its traits, readiness, actions and its place in the docs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from exporter.actions.base import Actions
from exporter.config import Config
from exporter.sampler import Sampler
from exporter.sources import Source
from exporter.traits import Traits


@dataclass(frozen=True)
class Mode:
    traits: Traits
    runs: str  # where, in words
    endpoint: str  # what serves /metrics
    acts: str  # what its admin actions act on
    ready_when: str  # when /readyz answers 200
    ready: Callable[[Sampler], str | None]  # why /readyz answers 503, or None
    # The mode's actions, from its config and sources; None where the caller owns them (the
    # launcher of `run` passes its fan-out).
    actions: Callable[[Config, Sequence[Source]], Actions] | None
    # What it reads from this machine itself (exporter.sources: ALLOCATOR, DEVICE_MEMORY, ...):
    # the kinds that provide it are made (exporter.sources.kinds).
    reads: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.traits.name


def first_sample(sampler: Sampler) -> str | None:
    """Ready once the first sample is in."""
    return "no sample yet" if sampler.latest is None else None
