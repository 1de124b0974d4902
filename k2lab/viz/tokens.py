"""Tokens as coloured text: each piece on its own background, with its id underneath."""

from __future__ import annotations

import html
from collections.abc import Sequence

from .style import show_whitespace

# Pastel backgrounds that keep black text readable; neighbours always differ.
PALETTE = ("#fde2e4", "#e2ecf9", "#e4f4e1", "#fff1c9", "#efe3f7", "#dff3f4", "#fbe7d6")
# The text colour is set, not inherited: JupyterLab's dark theme writes near-white text, unreadable on pastels.
TEXT, LABEL = "#1a1a1a", "#4a4a4a"


def spans_html(pieces: Sequence[tuple[str, str | None]]) -> str:
    """HTML for (text, label) pieces: each text on its own colour, its label (e.g. the token id) in small type
    beneath, whitespace made visible. ``label=None`` shows the text alone."""
    cells = []
    for i, (text, label) in enumerate(pieces):
        shown = html.escape(show_whitespace(text))
        sub = f'<span style="display:block;font-size:9px;color:{LABEL}">{html.escape(label)}</span>' if label else ""
        cells.append(
            f'<span style="display:inline-block;margin:1px;padding:1px 3px;border-radius:3px;'
            f'background:{PALETTE[i % len(PALETTE)]};color:{TEXT};'
            f'font-family:monospace;white-space:pre;text-align:center">'
            f"{shown}{sub}</span>"
        )
    return f'<div style="line-height:1.9">{"".join(cells)}</div>'


def tokens_html(tokens: Sequence, special_ids: Sequence[int] = ()) -> str:
    """HTML for tokens with ``.id`` and ``.text`` (``K2Tokenizer.pieces``); special ids are marked with a star."""
    special = set(special_ids)
    return spans_html([(t.text, f"{t.id}{'*' if t.id in special else ''}") for t in tokens])
