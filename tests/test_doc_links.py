"""Links between the repository's documents land: every relative link to a Markdown file names
one that exists, and every `#anchor` names one of its headings (GitHub's ids). A section that
moves (docs/performance.md's history did) cannot leave a link behind it."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO_ROOT
from tests.helpers import markdown_anchors

DOCUMENTS = [
    REPO_ROOT / "README.md",
    REPO_ROOT / "CHANGELOG.md",
    *sorted((REPO_ROOT / "docs").glob("*.md")),
]
# [text](target) outside code: the target up to its closing parenthesis.
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _links(document: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", document.read_text(), flags=re.S)
    return _LINK.findall(text)


def test_every_link_to_a_document_and_its_section_lands() -> None:
    broken = []
    for document in DOCUMENTS:
        for target in _links(document):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            landing = (document.parent / path).resolve() if path else document
            if not landing.exists():
                broken.append(f"{document.name}: {target} (no such file)")
            elif (
                anchor
                and landing.suffix == ".md"
                and anchor not in markdown_anchors(landing.read_text())
            ):
                broken.append(f"{document.name}: {target} (no such section)")
    assert broken == [], "\n".join(broken)
