"""The runbooks, served by the exporter itself: where the live page's alert links point when no
`runbook_url_base` is configured, so that they work on a cluster without internet.

The package carries a copy of docs/runbooks.md (exporter/data/runbooks.md; a test keeps the two
equal), rendered to HTML by markdown-it-py (CommonMark, with tables; raw HTML in the text is
escaped, never passed through). Every heading gets the anchor GitHub gives it (an alert's is its
name in lower case), so `/runbooks#gpumemoutofmemory` lands where the link on GitHub would.
Links to other files of the repository, which the exporter does not serve, become their path
as text.
"""

from __future__ import annotations

import html
import re
from functools import lru_cache
from importlib import resources
from typing import Any

from markdown_it import MarkdownIt
from markdown_it.token import Token

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


def _served(href: str) -> bool:
    return href.startswith(("#", "http://", "https://", "mailto:"))


def _link_open(self: Any, tokens: list[Token], idx: int, options: Any, env: Any) -> str:
    href = str(tokens[idx].attrGet("href") or "")
    if _served(href):
        return str(self.renderToken(tokens, idx, options, env))
    return f'<span class="repo-path" title="{html.escape(href)} in the repository">'


def _link_close(self: Any, tokens: list[Token], idx: int, options: Any, env: Any) -> str:
    opening = next(t for t in reversed(tokens[:idx]) if t.type == "link_open")
    if _served(str(opening.attrGet("href") or "")):
        return str(self.renderToken(tokens, idx, options, env))
    return "</span>"


def _markdown() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    md.add_render_rule("link_open", _link_open)
    md.add_render_rule("link_close", _link_close)
    return md


def render(markdown: str) -> str:
    """The page: a table of contents of the `## ` sections, then the document, each heading
    with its GitHub anchor (and a link to itself)."""
    md = _markdown()
    tokens = md.parse(markdown)
    sections: list[tuple[str, list[Token]]] = [("top", [])]
    toc = []
    for i, token in enumerate(tokens):
        if token.type == "heading_open":
            title = tokens[i + 1].content
            anchor = slug(title)
            if token.tag == "h2":  # a section of its own, at the anchor: the alert's
                sections.append((anchor, []))
                toc.append(f'<li><a href="#{html.escape(anchor)}">{html.escape(title)}</a></li>')
            else:
                token.attrSet("id", anchor)
        sections[-1][1].append(token)
    body = "".join(
        f'<section id="{html.escape(anchor)}">{md.renderer.render(part, md.options, {})}</section>'
        for anchor, part in sections
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>gpumem-exporter runbooks</title>"
        '<link rel="stylesheet" href="static/page.css"></head>'
        '<body class="runbooks"><header><h1>Runbooks</h1>'
        '<a href="./">live page</a></header>'
        f'<nav><ul class="toc">{"".join(toc)}</ul></nav><main>{body}</main></body></html>'
    )
