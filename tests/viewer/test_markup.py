"""The viewer's HTML is built by construction (exporter/viewer/markup.py): text becomes markup
only as a literal of the renderer's own, never through a value."""

from __future__ import annotations

from exporter.viewer.markup import Html, escape, html, join

EVIL = '<script>alert("x")</script>&'


def test_values_are_escaped_unless_they_are_markup_already() -> None:
    page = html("<p title={t}>{body}</p>{ok}", t=EVIL, body=EVIL, ok=Html("<br>"))
    assert page == (
        "<p title=&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;>"
        "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;</p><br>"
    )
    assert isinstance(page, Html)


def test_numbers_keep_their_format_and_braces_their_meaning() -> None:
    assert html("{w:.3f}% {{literal}}", w=12.34567) == "12.346% {literal}"


def test_joining_or_adding_text_escapes_it() -> None:
    joined = join([Html("<i></i>"), EVIL, 3])
    assert joined == "<i></i>" + escape(EVIL) + "3"
    added = Html("<b>") + "</b>"
    assert added == "<b>&lt;/b&gt;" and isinstance(added, Html)
