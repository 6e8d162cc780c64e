"""The reference tables in docs/, written from the declarations they describe.

docs/metrics.md's family table comes from exporter.catalog, docs/settings.md's table from
exporter.config's Config fields, and docs/architecture.md's modes from exporter.modes.MODES.
Each sits between two markers; `python -m exporter.reference --write` rewrites them and
`--check` fails while one is out of date (a test runs the check).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from exporter import catalog, config, modes

DOCS = Path(__file__).resolve().parent.parent / "docs"
TABLES: dict[str, Callable[[], str]] = {
    "metrics.md": lambda: catalog.markdown_table(
        {name: mode.traits.has for name, mode in modes.MODES.items()}
    ),
    "settings.md": config.markdown_table,
    "architecture.md": modes.markdown_table,
}
BEGIN = "<!-- written by `python -m exporter.reference --write` from the code; do not edit -->"
END = "<!-- end of the written table -->"
_SECTION = re.compile(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), re.S)


def section(text: str) -> str | None:
    """The written part of a document, or None where its markers are missing."""
    match = _SECTION.search(text)
    return match.group(1).rstrip("\n") if match else None


def stale(docs: Path = DOCS) -> list[str]:
    """The documents whose table differs from what the code declares."""
    return [name for name, table in TABLES.items() if section((docs / name).read_text()) != table()]


def write(docs: Path = DOCS) -> list[str]:
    """Rewrite every stale table (atomically); the documents written."""
    written = []
    for name in stale(docs):
        path = docs / name
        text = path.read_text()
        match = _SECTION.search(text)
        if match is None:
            raise SystemExit(f"{path}: the markers of the written table are missing")
        start, end = match.span()
        new = f"{text[:start]}{BEGIN}\n{TABLES[name]()}\n{END}{text[end:]}"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(new)
        tmp.replace(path)
        written.append(name)
    return written


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        print("written: " + (", ".join(write()) or "none (all up to date)"))
    elif sys.argv[1:] == ["--check"]:
        if out_of_date := stale():
            sys.exit(
                f"out of date: {', '.join(out_of_date)}: run python -m exporter.reference --write"
            )
    else:
        sys.exit("usage: python -m exporter.reference --write | --check")
