"""HTML built by construction: text from a snapshot can never become markup.

The renderer writes HTML only through `html()` (a template literal whose fields are filled
with values, each escaped unless it is `Html` already), `join()` and `Html` literals. A value
that reaches the page by any of these routes without being `Html` is escaped, so forgetting
to escape shows `&lt;` on the page at worst, never a tag; a snapshot is often an upload.
"""

from __future__ import annotations

import html as _html
import string
from collections.abc import Iterable
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import LiteralString


class Html(str):
    """Text that is HTML already. Literals of the renderer's own (Html("<p>...")) and what
    html() and join() return; adding anything else to it escapes that first."""

    __slots__ = ()

    def __add__(self, other: str) -> Html:
        return Html(str.__add__(self, escape(other)))


def escape(value: object) -> Html:
    """`value` as HTML text: Html as it is, anything else escaped (quotes too)."""
    if isinstance(value, Html):
        return value
    return Html(_html.escape(str(value), quote=True))


@lru_cache(maxsize=256)
def _parsed(template: str) -> tuple[tuple[str, str | None, str], ...]:
    return tuple(
        (literal, name, spec or "") for literal, name, spec, _ in string.Formatter().parse(template)
    )


def html(template: LiteralString, /, **values: object) -> Html:
    """The template with each {name} (or {name:spec}, for numbers) replaced by its value:
    formatted, then escaped unless it is Html. Literal braces are doubled, as in str.format."""
    out = []
    for literal, name, spec in _parsed(template):
        out.append(literal)
        if name is not None:
            value = values[name]
            out.append(value if isinstance(value, Html) else escape(format(value, spec)))
    return Html("".join(out))


def join(parts: Iterable[object]) -> Html:
    """The parts one after another, each escaped unless it is Html."""
    return Html("".join(escape(part) for part in parts))
