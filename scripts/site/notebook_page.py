"""A stored notebook as a page of the documentation site, from its saved outputs (nothing is executed).

``render(nb, ...)`` turns a notebook (the JSON dict of an ``.ipynb``) into Markdown for MkDocs plus a "stash": pieces of
finished HTML (highlighted code, outputs, figures, formulas) that the Markdown carries as placeholder words
(``k2stash0001x``), put back into the page's HTML after Markdown has run (``unstash``), so that Markdown never touches
them. What the page shows, cell by cell:

- Markdown cells as Markdown; ``$...$`` and ``$$...$$`` formulas as MathML (``latex2mathml``, drawn by the browser
  itself, no script); the ``<details>`` folds of hints and solutions stay folds (their inside is Markdown too);
  links to other notebooks point at their pages; each Mermaid diagram is what ``render``'s ``diagram`` makes of it
  (the site: its committed SVG, ``diagrams.py``), else its source.
- Code cells highlighted, with their stored outputs: streams and tracebacks as text boxes that scroll when long or
  wide; HTML, images, Markdown and LaTeX as such; plotly figures (``application/vnd.plotly.v1+json``) as divs that
  ``notebook.js`` draws with the plotly.js bundled into the site; ipywidgets as their saved state (the notebook's
  ``widgets`` metadata), drawn as inert controls with the saved values and the Output widgets' saved outputs (plotly
  figures included), else their text fallback.
- Cells tagged ``solution`` stay folded: a solution's code and outputs go inside the fold of the Markdown solution
  cell before it (or a fold of their own). Cell tags (nbval's and others) are never shown.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

PLOTLY = "application/vnd.plotly.v1+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
# The richest representation first, as JupyterLab picks it.
MIME_ORDER = [WIDGET_VIEW, PLOTLY, "text/html", "image/svg+xml", "image/png", "image/jpeg", "text/markdown",
              "text/latex", "text/plain"]

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
STASH_WORD = re.compile(r"k2stash(\d{4})x")
NBVAL_MARK = re.compile(r"^\s*#\s*NBVAL_[A-Z_]+\s*$")


@dataclass
class Page:
    """What ``render`` gives: the page's Markdown, the HTML pieces it refers to, and counts for the checks."""

    markdown: str
    stash: dict[str, str] = field(default_factory=dict)
    plots: int = 0  # plotly figures on the page (those inside saved widgets included)
    stored_plots: int = 0  # plotly outputs in the notebook's cells (what JupyterLab shows without the widgets)
    widgets: int = 0  # widget views drawn from saved state
    mermaid: int = 0

    def put(self, piece: str) -> str:
        key = f"k2stash{len(self.stash):04d}x"
        self.stash[key] = piece
        return key


def unstash(content: str, stash: dict[str, str]) -> str:
    """Put the stashed HTML back into rendered HTML: a placeholder alone in a paragraph replaces the paragraph."""
    content = re.sub(r"<p>\s*(k2stash\d{4}x)\s*</p>", lambda m: stash.get(m.group(1), m.group(0)), content)
    return STASH_WORD.sub(lambda m: stash.get(m.group(0), m.group(0)), content)


# ---------------------------------------------------------------------------------------------------------------------
# Markdown cells


def _tex_to_mathml(tex: str, display: bool) -> str:
    from latex2mathml.converter import convert

    try:
        out = convert(tex, display="block" if display else "inline")
    except Exception:  # noqa: BLE001 - a formula latex2mathml cannot read is shown as its source, not a failed build
        out = f'<code class="k2-tex">{html.escape(tex)}</code>'
    # The TeX source rides along for copy and for screen readers; search skips the MathML's token soup.
    out = out.replace("<math ", f'<math data-search-exclude alttext="{html.escape(tex, quote=True)}" ', 1)
    return f'<div class="k2-math">{out}</div>' if display else out


FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^\n]*)\n"
                   r"(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$", re.M | re.S)
LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")  # a Markdown link's ](target#anchor)
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
DISPLAY_MATH = re.compile(r"\$\$(.+?)\$\$", re.S)
INLINE_MATH = re.compile(r"(?<![\\$\w])\$(?=\S)([^$\n]+?)(?<=\S)\$(?![\w$])")
DETAILS = re.compile(r"<details(\s[^>]*)?>", re.I)


def is_mermaid(fence: re.Match) -> bool:
    """Whether a ``FENCE`` match is a Mermaid diagram (its info string says ``mermaid``)."""
    return fence.group("info").strip().lower() == "mermaid"


def _split_keep(pattern: re.Pattern, text: str) -> list[tuple[bool, str]]:
    """``text`` cut into (matched, piece) runs."""
    out, last = [], 0
    for m in pattern.finditer(text):
        out.append((False, text[last:m.start()]))
        out.append((True, m.group(0)))
        last = m.end()
    out.append((False, text[last:]))
    return out


def mermaid_source(number: int, body: str) -> str:
    """A Mermaid diagram shown as its source (what ``render`` does without a ``diagram`` function)."""
    return ('<div class="k2-mermaid k2-mermaid-source"><div class="k2-note">A Mermaid diagram (JupyterLab draws it; '
            f'its source here):</div><pre><code>{html.escape(body.rstrip())}</code></pre></div>')


def markdown_cell(source: str, page: Page, link: Callable[[str], str], tags: list[str],
                  diagram: Callable[[int, str], str] = mermaid_source) -> str:
    """A Markdown cell's source, ready for MkDocs (formulas, diagrams and folds prepared; links rewritten)."""
    pieces = []
    for fenced, piece in _split_keep(FENCE, source):
        if fenced:
            m = FENCE.match(piece)
            if m and is_mermaid(m):
                page.mermaid += 1
                piece = "\n" + page.put(diagram(page.mermaid, m.group("body"))) + "\n"
            pieces.append(piece)
            continue
        out = []
        for code, run in _split_keep(CODE_SPAN, piece):
            if code:
                out.append(run)
                continue
            run = DISPLAY_MATH.sub(lambda m: "\n\n" + page.put(_tex_to_mathml(m.group(1).strip(), True)) + "\n\n", run)
            run = INLINE_MATH.sub(lambda m: page.put(_tex_to_mathml(m.group(1), False)), run)
            out.append(run)
        pieces.append("".join(out))
    text = "".join(pieces)
    # Links to other notebooks and to the glossary: the pages the site makes of them.
    text = LINK.sub(lambda m: m.group(1) + link(m.group(2)) + m.group(3), text)
    kind = "solution" if "solution" in tags else "hint" if "hint" in tags else "note"

    def fold(m: re.Match) -> str:
        attrs = m.group(1) or ""
        cls = "" if "class=" in attrs else f' class="k2-{kind} {"success" if kind == "solution" else "tip"}"'
        return f'<details{attrs}{cls} markdown="1">'

    return DETAILS.sub(fold, text)


# ---------------------------------------------------------------------------------------------------------------------
# Code cells and their outputs


def _highlight(code: str) -> str:
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    # The markup of pymdownx.highlight, so that the theme's code styles (and its copy button) apply.
    body = highlight(code, PythonLexer(), HtmlFormatter(nowrap=True))
    return f'<div class="language-python highlight"><pre><span></span><code>{body}</code></pre></div>'


def _text(value: str | list[str]) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def _clean_stream(text: str) -> str:
    """Text as a terminal would leave it: colour codes dropped, a carriage return overwriting its line."""
    text = ANSI.sub("", text)
    return "\n".join(line.split("\r")[-1] if "\r" in line else line for line in text.split("\n"))


def _json_script(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")


def _plot(figure: dict, page: Page) -> str:
    page.plots += 1
    payload = {"data": figure.get("data", []), "layout": figure.get("layout", {}), "config": figure.get("config", {})}
    return (f'<div class="k2-plot" data-search-exclude><div class="k2-plotly" data-k2-plot="{page.plots}"></div>'
            f'<script type="application/json" class="k2-plotly-spec">{_json_script(payload)}</script></div>')


def _stream_html(name: str, text: str) -> str:
    return f'<pre class="k2-out k2-stream k2-{name}">{html.escape(_clean_stream(text))}</pre>'


def output_html(output: dict, page: Page, widgets: dict) -> str:
    """One stored output as HTML."""
    kind = output.get("output_type")
    if kind == "stream":
        return _stream_html(output.get("name", "stdout"), _text(output.get("text", "")))
    if kind == "error":
        trace = "\n".join(output.get("traceback") or [f"{output.get('ename')}: {output.get('evalue')}"])
        return f'<pre class="k2-out k2-error">{html.escape(_clean_stream(trace))}</pre>'
    data = output.get("data", {})
    for mime in MIME_ORDER:
        if mime not in data:
            continue
        value = data[mime]
        if mime == WIDGET_VIEW:
            model_id = value.get("model_id") if isinstance(value, dict) else None
            if model_id in widgets:
                page.widgets += 1
                return widget_html(model_id, widgets, page)
            continue  # no saved state for this view: its fallback below
        if mime == PLOTLY:
            return _plot(value, page)
        if mime == "text/html":
            return f'<div class="k2-out k2-html">{_text(value)}</div>'
        if mime == "image/svg+xml":
            return f'<div class="k2-out k2-image">{_text(value)}</div>'
        if mime in ("image/png", "image/jpeg"):
            raw = _text(value).replace("\n", "")
            base64.b64decode(raw, validate=True)  # a broken image fails the build, not the reader
            return f'<div class="k2-out k2-image"><img alt="" src="data:{mime};base64,{raw}"></div>'
        if mime == "text/markdown":
            import markdown

            return f'<div class="k2-out k2-markdown">{markdown.markdown(_text(value), extensions=["tables"])}</div>'
        if mime == "text/latex":
            tex = _text(value).strip().strip("$")
            return f'<div class="k2-out">{_tex_to_mathml(tex, True)}</div>'
        return f'<pre class="k2-out k2-plain">{html.escape(_clean_stream(_text(value)))}</pre>'
    return ""


def outputs_html(outputs: list[dict], page: Page, widgets: dict) -> str:
    """A cell's outputs; consecutive pieces of one stream are joined as the notebook shows them."""
    merged: list[dict] = []
    for output in outputs:
        if (output.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream"
                and merged[-1].get("name") == output.get("name")):
            merged[-1] = {**merged[-1], "text": _text(merged[-1]["text"]) + _text(output.get("text", ""))}
        else:
            merged.append(output)
    return "".join(output_html(output, page, widgets) for output in merged)


# ---------------------------------------------------------------------------------------------------------------------
# ipywidgets, from the state the notebook saved


def _ref(value: object, widgets: dict) -> dict | None:
    if isinstance(value, str) and value.startswith("IPY_MODEL_"):
        return widgets.get(value[len("IPY_MODEL_"):])
    return None


def _label(state: dict) -> str:
    text = state.get("description") or ""
    return f'<label class="k2-w-label">{html.escape(text)}</label>' if text else ""


def _format(value: float, fmt: str | None) -> str:
    try:
        return format(value, fmt or ".2f")
    except (TypeError, ValueError):
        return str(value)


def widget_html(model_id: str, widgets: dict, page: Page, depth: int = 0) -> str:
    """A widget view drawn from its saved model: inert controls showing the saved values, boxes as flex rows or
    columns, Output widgets with their saved outputs. The top view carries a note that it is a saved state."""
    model = widgets.get(model_id)
    if model is None or depth > 20:
        return ""
    name, state = model.get("model_name", ""), model.get("state", {})
    inner = ""
    if name in ("VBoxModel", "HBoxModel", "BoxModel", "GridBoxModel", "AccordionModel", "TabModel", "StackModel"):
        children = [_ref(child, widgets) for child in state.get("children", [])]
        ids = [child[len("IPY_MODEL_"):] for child in state.get("children", []) if isinstance(child, str)]
        direction = "row" if name == "HBoxModel" else "column"
        parts = [widget_html(i, widgets, page, depth + 1) for i, c in zip(ids, children, strict=False) if c]
        inner = f'<div class="k2-w-box k2-w-{direction}">{"".join(parts)}</div>'
    elif name == "OutputModel":
        inner = f'<div class="k2-w-output">{outputs_html(state.get("outputs", []), page, widgets)}</div>'
    elif name in ("IntSliderModel", "FloatSliderModel", "FloatLogSliderModel", "IntRangeSliderModel",
                  "FloatRangeSliderModel"):
        value, lo, hi, step = state.get("value"), state.get("min", 0), state.get("max", 100), state.get("step", 1)
        shown = value
        if name == "FloatLogSliderModel" and isinstance(value, int | float) and value > 0:
            base = state.get("base", 10.0)
            shown, value = value, math.log(value, base)  # the slider's position is the exponent
        readout = (" – ".join(_format(v, state.get("readout_format")) for v in shown) if isinstance(shown, list)
                   else _format(shown, state.get("readout_format") or ("d" if name.startswith("Int") else ".2f")))
        position = value[0] if isinstance(value, list) else value
        inner = (f'<div class="k2-w-control">{_label(state)}<input type="range" disabled min="{lo}" max="{hi}" '
                 f'step="{step or "any"}" value="{position}"><span class="k2-w-readout">{html.escape(readout)}</span>'
                 "</div>")
    elif name in ("DropdownModel", "SelectModel", "RadioButtonsModel", "ToggleButtonsModel", "SelectionSliderModel"):
        labels, index = state.get("_options_labels", []), state.get("index")
        options = "".join(f'<option{" selected" if i == index else ""}>{html.escape(str(label))}</option>'
                          for i, label in enumerate(labels))
        inner = f'<div class="k2-w-control">{_label(state)}<select disabled>{options}</select></div>'
    elif name in ("CheckboxModel", "ToggleButtonModel"):
        checked = " checked" if state.get("value") else ""
        inner = f'<div class="k2-w-control">{_label(state)}<input type="checkbox" disabled{checked}></div>'
    elif name == "TextareaModel":
        rows = max(2, min(12, str(state.get("value", "")).count("\n") + 1))
        inner = (f'<div class="k2-w-control">{_label(state)}<textarea readonly rows="{rows}">'
                 f'{html.escape(str(state.get("value", "")))}</textarea></div>')
    elif name in ("TextModel", "IntTextModel", "FloatTextModel", "BoundedIntTextModel", "BoundedFloatTextModel"):
        inner = (f'<div class="k2-w-control">{_label(state)}<input type="text" readonly '
                 f'value="{html.escape(str(state.get("value", "")), quote=True)}"></div>')
    elif name in ("HTMLModel", "HTMLMathModel"):
        inner = f'<div class="k2-w-html">{_label(state)}{state.get("value", "")}</div>'
    elif name == "LabelModel":
        inner = f'<div class="k2-w-html">{html.escape(str(state.get("value", "")))}</div>'
    elif name == "ButtonModel":
        inner = f'<button class="k2-w-button" disabled>{html.escape(str(state.get("description", "")))}</button>'
    else:
        inner = f'<div class="k2-w-unknown">[{html.escape(name.removesuffix("Model"))} widget]</div>'
    if depth:
        return inner
    return ('<div class="k2-widget" data-k2-widget>'
            '<div class="k2-note">An explorer, shown as it was saved when the notebook ran; in JupyterLab its '
            f"controls redraw it.</div>{inner}</div>")


# ---------------------------------------------------------------------------------------------------------------------
# The whole notebook


def render(nb: dict, link: Callable[[str], str], diagram: Callable[[int, str], str] = mermaid_source) -> Page:
    """The page of notebook ``nb`` (its JSON), ``link`` rewriting a Markdown link's target (another notebook's page),
    ``diagram(n, source)`` the HTML of the page's n-th Mermaid diagram (from 1)."""
    page = Page("")
    widgets = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    chunks: list[str] = []
    open_solution: int | None = None  # index in chunks of the last Markdown solution fold, while code may join it
    for cell in nb.get("cells", []):
        tags = list(cell.get("metadata", {}).get("tags", []))
        source = _text(cell.get("source", ""))
        if cell.get("cell_type") == "markdown":
            chunks.append(markdown_cell(source, page, link, tags, diagram))
            open_solution = len(chunks) - 1 if "solution" in tags and chunks[-1].rstrip().endswith("</details>") \
                else None
            continue
        if cell.get("cell_type") != "code":
            if source.strip():
                chunks.append(page.put(f'<pre class="k2-out k2-raw">{html.escape(source)}</pre>'))
            open_solution = None
            continue
        # nbval's markers in the code (``# NBVAL_CHECK_OUTPUT``) are for the test runner, not for the reader
        source = "\n".join(line for line in source.split("\n") if not NBVAL_MARK.match(line))
        stored = sum(PLOTLY in o.get("data", {}) for o in cell.get("outputs", []))
        page.stored_plots += stored
        body = (_highlight(source) if source.strip() else "") + outputs_html(cell.get("outputs", []), page, widgets)
        cell_html = f'<div class="k2-cell">{body}</div>'
        if "solution" in tags:
            if open_solution is not None:  # inside the fold the Markdown solution opened, before its end
                text = chunks[open_solution].rstrip()
                chunks[open_solution] = text[: -len("</details>")] + "\n" + page.put(cell_html) + "\n\n</details>"
                continue
            summary = "Solution (code)"
            cell_html = (f'<details class="k2-solution success"><summary>{summary}</summary>{cell_html}</details>')
        else:
            open_solution = None
        chunks.append(page.put(cell_html))
    page.markdown = "\n\n".join(chunks) + "\n"
    return page
