"""Text from outside (ack reasons, writer ids, policy and other table properties, request ids, column names, paths)
shown safely: one function per place it is shown.

- a terminal (`partfin` output, log lines): `terminal_text`. Characters a terminal would act on (ESC and the
  other control characters: screen clears, a clipboard write by OSC 52, a bell) and those that would break
  the line (newlines, U+2028) or reorder it (bidi overrides) are shown as Python escapes (`\\x1b`, `\\n`,
  `\\u202e`), as `repr` shows them: a value stays visible, on its line, and cannot forge another line.
  A `rich` renderable is built with `rich.text.Text`, never from a string `rich` would read as markup.
- markdown (Dagster metadata, descriptions the UI renders as markdown): `markdown_text`. Every ASCII
  punctuation character is backslash-escaped (CommonMark lets any be), so the text is shown as written
  and never becomes a link, an image, raw HTML, emphasis or a table cell boundary. partfin's own markdown
  holds no link or image built from outside text.
- HTML (the `partfin report` page): `html_text`, `html.escape` with quotes.
- matplotlib titles: drawn with `parse_math=False` where the text carries outside text (a `$` starts mathtext).
"""

from __future__ import annotations

import html
import string

_MARKDOWN_ESCAPES = str.maketrans({c: f"\\{c}" for c in string.punctuation})


def terminal_text(value: str) -> str:
    """`value` on one line with every non-printable character (as `str.isprintable` says) as its Python escape."""
    if value.isprintable():
        return value
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in value)


def markdown_text(value: str) -> str:
    """`value` as literal markdown text: one line (terminal_text), every ASCII punctuation character escaped."""
    return terminal_text(value).translate(_MARKDOWN_ESCAPES)


def html_text(value: str) -> str:
    """`value` as HTML text or attribute value: non-printable characters escaped as on a terminal, then `html.escape`."""
    return html.escape(terminal_text(value), quote=True)
