"""The runbooks, served by the exporter itself: where the live page's alert links point when no
`runbook_url_base` is configured, so that they work on a cluster without internet.

The package carries a copy of docs/runbooks.md (exporter/data/runbooks.md; a test keeps the two
equal). No Markdown library is a dependency, so the page is the Markdown text itself, escaped
and preformatted, cut into one section per `## ` heading with the anchor GitHub gives it (the
alert name in lower case), so `/runbooks#gpumemoutofmemory` lands where the link on GitHub
would.
"""

from __future__ import annotations

import html
import re
from functools import lru_cache
from importlib import resources

from exporter.config import Config

PAGE = "runbooks"  # relative to the live page, so that a path prefix of a proxy is kept


def runbook_url(config: Config, alert: str) -> str:
    base = config.runbook_url_base
    return f"{base if base else PAGE}#{alert.lower()}"


def slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@lru_cache(maxsize=1)
def runbooks_markdown() -> str:
    return (resources.files("exporter") / "data" / "runbooks.md").read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def runbooks_html() -> str:
    return render(runbooks_markdown())


def render(markdown: str) -> str:
    """The page: a table of contents, then each `## ` section as escaped preformatted text,
    with `### ` headings as anchors of their own (the document links to them too)."""
    sections: list[tuple[str, list[str]]] = [("", [])]
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code  # a `## ` inside a code block is a shell comment
        if line.startswith("## ") and not in_code:
            sections.append((line[3:].strip(), []))
        else:
            sections[-1][1].append(line)
    esc = html.escape
    toc = "".join(
        f'<li><a href="#{esc(slug(title))}">{esc(title)}</a></li>' for title, _ in sections[1:]
    )
    body = [f'<section id="top">{_blocks(sections[0][1])}</section>']
    for title, lines in sections[1:]:
        anchor = esc(slug(title))
        body.append(
            f'<section id="{anchor}"><h2><a href="#{anchor}">{esc(title)}</a></h2>'
            f"{_blocks(lines)}</section>"
        )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>gpumem-exporter runbooks</title>"
        '<link rel="stylesheet" href="static/page.css"></head>'
        '<body class="runbooks"><header><h1>Runbooks</h1>'
        '<a href="./">live page</a></header>'
        f'<nav><ul class="toc">{toc}</ul></nav><main>{"".join(body)}</main></body></html>'
    )


def _blocks(lines: list[str]) -> str:
    """Escaped preformatted text, cut at each `### ` heading (outside code) into an anchor."""
    parts: list[str] = []
    chunk: list[str] = []
    in_code = False

    def flush() -> None:
        text = "\n".join(chunk).strip("\n")
        if text.strip():
            parts.append(f"<pre>{html.escape(text)}</pre>")
        chunk.clear()

    for line in lines:
        if line.startswith("```"):
            in_code = not in_code
        if line.startswith("### ") and not in_code:
            flush()
            title = line[4:].strip()
            parts.append(f'<h3 id="{html.escape(slug(title))}">{html.escape(title)}</h3>')
        else:
            chunk.append(line)
    flush()
    return "".join(parts)
