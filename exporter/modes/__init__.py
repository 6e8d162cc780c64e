"""The ways of running, one module each (embedded, helper, node, demo, run), each declaring its
Mode: its traits (what it decides for the layers below: exporter.traits), when it is ready, how
its admin actions are made, and for docs/architecture.md where it runs and what serves it.

Entry points pick a mode by name (exporter.runtime.build_runtime); nothing below the assembly
branches on a mode's name.
"""

from __future__ import annotations

from exporter.modes import demo, embedded, helper, node, run
from exporter.modes.mode import Mode

# Every mode by name, in the order the docs list them.
MODES: dict[str, Mode] = {m.MODE.name: m.MODE for m in (embedded, helper, node, demo, run)}


def markdown_table() -> str:
    """The modes, for docs/architecture.md (written by exporter.reference)."""
    rows = [
        "| mode | runs | serves /metrics | admin actions act on | ready when |",
        "| --- | --- | --- | --- | --- |",
    ]
    for m in MODES.values():
        rows.append(f"| `{m.name}` | {m.runs} | {m.endpoint} | {m.acts} | {m.ready_when} |")
    return "\n".join(rows)
