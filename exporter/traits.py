"""What a way of running decides for the layers below the assembly (exporter.modes declares
each mode with its traits; the HTTP layer, the collector and the actions read these values,
never a mode's name)."""

from __future__ import annotations

from dataclasses import dataclass, field

from exporter.catalog import NEEDS, OWN_PROCESS


@dataclass(frozen=True)
class Traits:
    name: str  # the `mode` label of gpumem_exporter_build_info
    # What it has of what families need (exporter.catalog.NEEDS): a family is served where
    # its need is had, and only at the full detail level where its full_only is had.
    has: frozenset[str] = field(default_factory=frozenset)
    # One process's numbers at one endpoint: every series keeps its pid (a series without one
    # is read as that process's own). `run` serves every process of a server: a pid is kept
    # only where the other labels do not name the process alone.
    one_process: bool = True
    # Its admin answers come from a recording: they say so (`replay`), and change nothing.
    recorded: bool = False
    # Admin actions answer without credentials where none are configured: only where they
    # change nothing (the recording), so that the demo shows every feature with no set-up.
    admin_open: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.has) - set(NEEDS)
        if unknown:
            raise ValueError(f"{self.name}: has what no family needs: {sorted(unknown)}")

    @property
    def own_process(self) -> bool:
        """The process that serves is one it reports (client_python's process_* families); a
        replay serves the recorded process as host_process_* instead."""
        return OWN_PROCESS in self.has
