"""The metrics contract: every family each mode serves, as released, and the rule that no
release breaks it without a deprecation.

dcgm-exporter's users lost dashboards and alerts to renames nobody announced (4.9 renamed 23
fields and changed memory from MiB to bytes). Here `metrics-contract.json`, at the root of
the repository, lists each family a scrape shows: its type, unit, labels and, per mode, the
detail level that serves it ("basic": every level; "full": GPUMEM_DETAIL=full only). It is
written from exporter.catalog and exporter.modes, and it only grows:

- a new family, or a new mode serving one, is added with the version that added it;
- a family that goes or changes (its name, type, unit, labels; a mode that stops serving it;
  a basic family made full-only) is a break, unless the catalog declares it deprecated with
  its replacement (`Family.replaced_by`): then it is served beside the replacement, with the
  replacement's samples, and may leave at the next minor release, not before.

`python -m exporter.contract --write` adds what is new and refuses a break, naming it;
`--check` fails while the file is out of date or broken (a test runs it). Standard library
only, as the catalog is.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from exporter import catalog
from exporter.version import __version__

CONTRACT = Path(__file__).resolve().parent.parent / "metrics-contract.json"
# The units a family's name ends in (Prometheus's naming rules); "" where it counts things.
UNITS = ("bytes", "seconds", "ratio")

Entry = dict[str, Any]


def unit(family: catalog.Family) -> str:
    last = family.name.rsplit("_", 1)[-1]
    return last if last in UNITS else ""


def entry(family: catalog.Family, modes: Mapping[str, Collection[str]]) -> Entry:
    """What the contract holds of one family (its `since` comes from the file)."""
    found: Entry = {
        "type": family.kind,
        "unit": unit(family),
        "labels": list(family.labels),
        "modes": {
            name: "full" if family.full_only_in(has) else "basic"
            for name, has in modes.items()
            if family.served(has)
        },
    }
    if family.per_process:
        found["process_labels"] = list(catalog.PROCESS_LABELS)  # where one serves many
    if family.info_labels:
        found["info_labels"] = list(family.info_labels)
    if family.replaced_by:
        found["deprecated"] = {"replacement": family.replaced_by, "since": family.deprecated_since}
    return found


def declared(modes: Mapping[str, Collection[str]]) -> dict[str, Entry]:
    """The contract as the code declares it now, by exposed name (without `since`)."""
    return {f.exposed: entry(f, modes) for f in catalog.FAMILIES}


def _minor(version: str) -> tuple[int, int]:
    major, minor, *_ = (int(part) for part in version.split("."))
    return major, minor


def breaks(released: Mapping[str, Entry], now: Mapping[str, Entry], version: str) -> list[str]:
    """What `now` (at `version`) breaks of the `released` contract, one line each."""
    found = []
    for name, before in released.items():
        after = now.get(name)
        if after is None:
            deprecated = before.get("deprecated")
            if deprecated is None:
                found.append(f"{name}: removed without a deprecation (declare it replaced_by)")
            elif _minor(version) <= _minor(deprecated["since"]):
                found.append(
                    f"{name}: deprecated in {deprecated['since']}, removed in {version}: "
                    "it stays beside its replacement for a minor release"
                )
            continue
        for key in ("type", "unit", "labels", "process_labels", "info_labels"):
            if before.get(key) != after.get(key):
                found.append(f"{name}: {key} {before.get(key)} -> {after.get(key)}")
        for mode, level in before["modes"].items():
            now_level = after["modes"].get(mode)
            if now_level is None:
                found.append(f"{name}: no longer served by {mode}")
            elif (level, now_level) == ("basic", "full"):
                found.append(f"{name}: {mode} serves it at the full detail level only now")
        if "deprecated" in before and "deprecated" not in after:
            found.append(f"{name}: its deprecation was taken back")
    return found


def updated(
    released: Mapping[str, Entry], now: Mapping[str, Entry], version: str
) -> dict[str, dict[str, Entry]]:
    """The file's content once `now` is written over `released`: each family with the
    version that added it (new ones: `version`); families gone after their deprecation
    leave it."""
    families = {}
    for name, found in now.items():
        since = released.get(name, {}).get("since", version)
        families[name] = {"since": since, **found}
    return {"families": families}


def render(contract: Mapping[str, Mapping[str, Entry]]) -> str:
    """The file's text: one family a line, so that a change reads as one line in a diff."""
    lines = [f"  {json.dumps(name)}: {json.dumps(e)}" for name, e in contract["families"].items()]
    return '{"families": {\n' + ",\n".join(lines) + "\n}}\n"


def read(path: Path = CONTRACT) -> dict[str, Entry]:
    """The released contract's families, without their `since` (as declared() gives them)."""
    families = json.loads(path.read_text())["families"]
    return {name: {k: v for k, v in e.items() if k != "since"} for name, e in families.items()}


def _declared_now() -> dict[str, Entry]:
    from exporter.modes import MODES  # the modes sit above the catalog

    return declared({name: mode.traits.has for name, mode in MODES.items()})


def problems(path: Path = CONTRACT, version: str = __version__) -> list[str]:
    """Why the file is not the contract of this code: breaks, or families not written yet."""
    now = _declared_now()
    released = read(path)
    found = breaks(released, now, version)
    if not found and json.loads(path.read_text()) != updated(released, now, version):
        found.append(f"{path.name} is out of date: run python -m exporter.contract --write")
    return found


def write(path: Path = CONTRACT, version: str = __version__) -> list[str]:
    """Add what is new (atomically); the breaks instead, if any (nothing written)."""
    now = _declared_now()
    released = read(path) if path.exists() else {}
    found = breaks(released, now, version)
    if found:
        return found
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(render(updated(released, now, version)))
    tmp.replace(path)
    return []


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        if refused := write():
            sys.exit("not written: the catalog breaks the contract:\n" + "\n".join(refused))
    elif sys.argv[1:] == ["--check"]:
        if found := problems():
            sys.exit("\n".join(found))
    else:
        sys.exit("usage: python -m exporter.contract --write | --check")
