"""The lab as a learner sees it: open notebooks in JupyterLab in a headless Chromium, run all cells, and check that
the plotly figures are drawn, the ipywidgets explorers render and answer, and nothing failed on the way (no error
output, no page or console errors from the lab extensions). Screenshots and a JSON report per notebook go to the
artifacts folder (see conftest.py).

    python -m pytest -m browser tests/browser
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

RUN_TIMEOUT_S = float(os.environ.get("K2LAB_BROWSER_TIMEOUT", 900))  # all cells of one notebook, on a slow CPU
STEP_TIMEOUT_MS = 180_000  # loading the lab's scripts, starting a kernel, one widget round trip
NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


@dataclass(frozen=True)
class Expect:
    plots: int  # plotly graphs drawn, at least (those inside explorers included)
    widgets: int  # ipywidgets views, at least
    diagrams: int = 0  # Mermaid diagrams in Markdown cells drawn as SVG, at least
    texts: tuple[str, ...] = ()  # printed by some code cell (an exercise's verdict, say)


CASES = [
    # The tour: the logit-lens figure (the token boxes are plain HTML).
    pytest.param("00_tour.ipynb", Expect(plots=1, widgets=0, diagrams=1), id="00_tour"),
    # The tokenizer: its token explorer (a text box over coloured HTML tokens), typed into.
    pytest.param("01_tokens.ipynb", Expect(plots=0, widgets=1), id="01_tokens"),
    # The router: one token's stages, the bias flips, and the router explorer (a layer dropdown, a token slider and
    # its own figure inside an Output widget): plotly in and out of widgets, and a widget round trip.
    pytest.param("04a_router.ipynb", Expect(plots=3, widgets=1), id="04a_router"),
    # The block by hand: two Mermaid diagrams; an exercise as a learner first sees it (the stub's verdict) and the
    # collapsed solution cell's check passing.
    pytest.param("04b_block.ipynb", Expect(plots=0, widgets=0, diagrams=2,
                                           texts=("✗ not written yet", "✓ RMSNorm: matches k2lab")), id="04b_block"),
]

# Text that means an output did not render: the widget manager waiting for a model that never came, a widget model
# missing from the kernel, or a mime type that no installed extension renders (e.g. plotly's lab extension missing).
BROKEN_OUTPUT = ["Loading widget", "Error displaying widget", "model not found", "No renderer could be found",
                 "Javascript Error"]

# Console errors that say nothing about the lab. Each entry: (pattern over "type: text [url]", why it is harmless).
# Deliberately absent: 404s, even for files the lab asks for optionally, because a lab extension whose scripts are
# missing shows up as exactly that; and errors on 127.0.0.1, which are the lab's own.
HARMLESS_CONSOLE = [
    (re.compile(r"net::ERR_(NAME_NOT_RESOLVED|INTERNET_DISCONNECTED|CONNECTION_REFUSED|ADDRESS_UNREACHABLE|"
                r"NETWORK_ACCESS_DENIED|TIMED_OUT)\b.*\[https?://(?!127\.0\.0\.1[:/]|localhost[:/])"),
     "a request to a host off this machine (a CDN font, a news feed): CI machines may have no network, and the lab "
     "is meant to work offline; anything the notebooks need from the network would fail the plot and widget checks"),
]


# -- JavaScript run in the page. The lab exposes itself as window.jupyterapp (LabApp.expose_app_in_browser), so the
# test runs the same commands as the Run menu instead of clicking through menus whose layout changes between versions.

FIND_PANEL = """(name) => {
  const app = window.jupyterapp;
  if (!app || !app.shell || !app.commands.hasCommand('notebook:run-all-cells')) return false;
  const panel = Array.from(app.shell.widgets('main')).find(w => w.context && w.context.path === name);
  if (!panel || !panel.context.isReady || !panel.sessionContext) return false;
  window.__k2panel = panel;
  return true;
}"""

KERNEL_IDLE = """() => {
  const s = window.__k2panel.sessionContext;
  const kernel = s.session && s.session.kernel;
  return !!(s.isReady && kernel && kernel.status === 'idle');
}"""

RUN_ALL = """async () => {
  const app = window.jupyterapp, panel = window.__k2panel;
  app.shell.activateById(panel.id);
  app.shell.collapseLeft(); app.shell.collapseRight();
  await app.commands.execute('notebook:clear-all-cell-outputs');  // judge this run, not the stored outputs
  window.__k2done = null; window.__k2quiet = 0;
  app.commands.execute('notebook:run-all-cells').then(
    ok => { window.__k2done = {ok: ok}; }, err => { window.__k2done = {error: String(err)}; });
}"""

# Done: the run-all promise settled, the kernel is idle and no cell shows [*], three polls in a row.
RUN_DONE = """() => {
  const panel = window.__k2panel, s = panel.sessionContext;
  const kernel = s.session && s.session.kernel;
  const pending = Array.from(panel.node.querySelectorAll('.jp-InputArea-prompt'))
    .some(p => p.textContent.includes('*'));
  const quiet = !!(window.__k2done && kernel && kernel.status === 'idle' && !pending);
  window.__k2quiet = quiet ? window.__k2quiet + 1 : 0;
  return window.__k2quiet >= 3;
}"""

# The widget views among a notebook's outputs, found through the cell models (the widget renderer does not mark its
# node with data-mime-type as the other renderers do) and tagged data-k2-view="i" for the locators below.
WIDGET_VIEWS = """const widgetViews = () => {
  const views = [];
  for (const cell of window.__k2panel.content.widgets) {
    if (cell.model.type !== 'code' || !cell.outputArea) continue;
    const children = Array.from(cell.outputArea.node.children);
    for (let i = 0; i < cell.model.outputs.length && i < children.length; i++) {
      if (!('application/vnd.jupyter.widget-view+json' in (cell.model.outputs.get(i).data || {}))) continue;
      const node = children[i].querySelector('.jp-OutputArea-output') || children[i];
      node.setAttribute('data-k2-view', String(views.length));
      views.push(node);
    }
  }
  return views;
};"""
CONTROLS = ".widget-dropdown, .widget-slider, .widget-textarea, .widget-checkbox"

# Outputs are drawn a little after the kernel is done (plotly.js, the widget manager): wait for the expected counts.
RENDERED = """([plots, widgets, broken]) => {""" + WIDGET_VIEWS + """
  const node = window.__k2panel.node;
  const drawn = Array.from(node.querySelectorAll('.js-plotly-plot')).filter(p => p.querySelector('.main-svg')).length;
  const views = widgetViews().filter(v => v.querySelector('CONTROLS')).length;
  const text = Array.from(node.querySelectorAll('.jp-OutputArea')).map(o => o.innerText).join('\\n');
  return drawn >= plots && views >= widgets && !broken.some(b => text.includes(b));
}""".replace("CONTROLS", CONTROLS)

REPORT = """(broken) => {""" + WIDGET_VIEWS + """
  const panel = window.__k2panel, allViews = widgetViews();
  const cells = panel.content.widgets.map((cell, index) => {
    const m = cell.model, node = cell.node;
    const out = {index, type: m.type,
                 source: m.sharedModel.getSource().split('\\n').slice(0, 2).join(' | ').slice(0, 100)};
    if (m.type === 'code') {
      const outputs = [];
      for (let i = 0; i < m.outputs.length; i++) outputs.push(m.outputs.get(i).toJSON());
      const text = o => Array.isArray(o.text) ? o.text.join('') : String(o.text);
      out.executionCount = m.executionCount;
      out.errors = outputs.filter(o => o.output_type === 'error').map(o => `${o.ename}: ${o.evalue}`);
      out.stderr = outputs.filter(o => o.output_type === 'stream' && o.name === 'stderr').map(text);
      out.outputs = outputs.flatMap(o => o.data ? Object.keys(o.data) : [`${o.output_type}:${o.name || ''}`]);
      out.stdout = outputs.filter(o => o.output_type === 'stream' && o.name === 'stdout').map(text).join('')
        .slice(0, 2000);
    } else {
      // JupyterLab draws each Mermaid block into a .jp-RenderedMermaid element (an SVG image inside it)
      out.diagrams = node.querySelectorAll('.jp-RenderedMarkdown .jp-RenderedMermaid').length;
    }
    const areaText = Array.from(node.querySelectorAll('.jp-OutputArea')).map(o => o.innerText).join('\\n');
    out.broken = broken.filter(b => areaText.includes(b));
    const shown = '.jp-OutputArea-output[data-mime-type*="stderr"], .jp-OutputArea-output[data-mime-type*="error"]';
    out.tracebacks = Array.from(node.querySelectorAll(shown))
      .map(e => e.innerText).filter(t => t.includes('Traceback')).map(t => t.slice(0, 800));
    out.plots = Array.from(node.querySelectorAll('.js-plotly-plot')).map(p => {
      const svg = p.querySelector('.main-svg'), r = (svg || p).getBoundingClientRect();
      return {drawn: !!svg, width: Math.round(r.width), height: Math.round(r.height),
              title: (p.querySelector('.gtitle') || {}).textContent || ''};
    });
    out.widgets = allViews.filter(w => node.contains(w)).map(w => ({
      view: Number(w.getAttribute('data-k2-view')),
      rendered: !!w.querySelector('.jupyter-widgets'),
      controls: w.querySelectorAll('CONTROLS').length,
      plots: Array.from(w.querySelectorAll('.js-plotly-plot')).filter(p => p.querySelector('.main-svg')).length,
      // Explorer shows a failed render as "SomeError: message" in a <pre> (ipywidgets would swallow the exception)
      errors: Array.from(w.querySelectorAll('pre')).map(p => p.innerText)
        .filter(t => /\\b\\w+(Error|Exception): /.test(t)),
      text: w.innerText.slice(0, 200)}));
    return out;
  });
  return {kernel: (panel.sessionContext.session && panel.sessionContext.session.kernel || {}).status || null,
          runAll: window.__k2done, cells};
}""".replace("CONTROLS", CONTROLS)

WIDGET_OUTPUT_TEXT = """(i) => {
  const w = document.querySelector(`[data-k2-view="${i}"]`);
  const out = w && w.querySelector('.widget-output');
  return out ? out.textContent : null;
}"""

FIT_VIEWPORT = """() => {
  // The notebook scrolls inside its panel: scroll it to the top and say how much taller the page must be to show
  // all of it at once.
  const panel = window.__k2panel;
  const scroller = [panel.content.node, ...panel.content.node.querySelectorAll('*')]
    .find(e => e.scrollHeight > e.clientHeight + 1 && getComputedStyle(e).overflowY !== 'visible');
  if (!scroller) return 0;
  scroller.scrollTop = 0;
  return scroller.scrollHeight - scroller.clientHeight;
}"""


def _stored_counts(path: Path) -> tuple[int, int]:
    """Plotly outputs and widget views stored in the committed notebook: the run must show at least as many."""
    nb = json.loads(path.read_text())
    mimes = [m for cell in nb["cells"] for out in cell.get("outputs", []) for m in out.get("data", {})]
    return mimes.count("application/vnd.plotly.v1+json"), mimes.count("application/vnd.jupyter.widget-view+json")


def _console_entry(msg) -> str:
    url = (msg.location or {}).get("url") or ""
    return f"{msg.type}: {msg.text}" + (f" [{url}]" if url else "")


def _is_harmless(text: str) -> bool:
    return any(pattern.search(text) for pattern, _why in HARMLESS_CONSOLE)


def _screenshot(page, path: Path) -> None:
    extra = page.evaluate(FIT_VIEWPORT)
    size = page.viewport_size
    page.set_viewport_size({"width": size["width"], "height": min(size["height"] + extra, 16_000)})
    page.wait_for_timeout(2_000)  # plotly relayouts to the new size
    page.screenshot(path=str(path), full_page=True)
    page.set_viewport_size(size)


def _poke_widgets(page) -> list[dict]:
    """Change every explorer's first control (a dropdown to another option, else a text box to new text) and wait for
    its output to be redrawn by the kernel: the browser -> comm -> kernel -> Output widget -> browser round trip,
    which only a browser can test."""
    pokes = []
    for i in range(page.locator("[data-k2-view]").count()):
        view = page.locator(f'[data-k2-view="{i}"]')
        if view.locator(".widget-output").count() == 0:
            continue  # an explorer is controls over an Output widget; a plain widget has nothing to redraw
        select, text = view.locator(".widget-dropdown select"), view.locator(".widget-textarea textarea")
        before = page.evaluate(WIDGET_OUTPUT_TEXT, i)
        figure = view.locator(".widget-output .js-plotly-plot:has(.main-svg)")
        had_plot = figure.count() > 0
        if select.count():
            options = select.first.locator("option").all_inner_texts()
            choice = options[-1] if select.first.input_value() != options[-1] else options[0]
            select.first.select_option(label=choice)
        elif text.count():
            choice = "def k2lab_browser_test(x):\n    return x ** 2  # typed in the browser"
            text.first.fill(choice)
            text.first.blur()  # a text box with continuous_update=False sends its value on blur
        else:
            continue
        try:
            page.wait_for_function(f"(before) => ({WIDGET_OUTPUT_TEXT})({i}) !== before", arg=before,
                                   timeout=STEP_TIMEOUT_MS, polling=500)
            if had_plot:
                figure.first.wait_for(timeout=30_000)
            changed = True
        except Exception:  # noqa: BLE001 - reported by problems()
            changed = False
        pokes.append({"view": i, "chose": choice, "output_changed": changed, "plots_before": int(had_plot),
                      "plots_after": figure.count(), "text_after": (page.evaluate(WIDGET_OUTPUT_TEXT, i) or "")[:200]})
    return pokes


def run_in_lab(chromium, lab, artifacts: Path, name: str, plots: int, widgets: int) -> dict:
    """Open ``name`` in the lab, clear its outputs, Run All Cells, wait until the kernel is idle and the outputs are
    drawn, screenshot it, change the explorers' dropdowns; return what the page showed (also saved as JSON)."""
    stem = Path(name).stem
    context = chromium.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(STEP_TIMEOUT_MS)
    console: list[str] = []
    page.on("console", lambda msg: console.append(_console_entry(msg)) if msg.type == "error" else None)
    page.on("pageerror", lambda err: console.append(f"pageerror: {err}"))

    started = time.monotonic()
    report: dict = {"notebook": name, "expected": {"plots": plots, "widgets": widgets}}
    try:
        page.goto(f"{lab.url}/lab/tree/{name}?reset")
        page.wait_for_function(FIND_PANEL, arg=name, polling=500)
        page.wait_for_function(KERNEL_IDLE, polling=500)
        report["opened_s"] = round(time.monotonic() - started, 1)
        page.evaluate(RUN_ALL)
        page.wait_for_function(RUN_DONE, timeout=RUN_TIMEOUT_S * 1000, polling=1000)
        report["ran_s"] = round(time.monotonic() - started, 1)
        try:
            page.wait_for_function(RENDERED, arg=[plots, widgets, BROKEN_OUTPUT], timeout=60_000, polling=500)
        except Exception:  # noqa: BLE001 - the report says what is missing
            pass
        report.update(page.evaluate(REPORT, BROKEN_OUTPUT))
        _screenshot(page, artifacts / f"{stem}.png")
        report["widget_pokes"] = _poke_widgets(page)
        if report["widget_pokes"]:
            _screenshot(page, artifacts / f"{stem}-after-widget-change.png")
    except Exception:
        try:
            page.screenshot(path=str(artifacts / f"{stem}-failure.png"))
        except Exception:  # noqa: BLE001 - keep the original error
            pass
        raise
    finally:
        report["seconds"] = round(time.monotonic() - started, 1)
        report["console"] = console
        (artifacts / f"{stem}.json").write_text(json.dumps(report, indent=1))
        try:  # free the kernel's memory and CPU for the next notebook
            page.evaluate("() => window.__k2panel && window.__k2panel.sessionContext.shutdown()")
        except Exception:  # noqa: BLE001
            pass
        context.close()
    return report


def problems(report: dict) -> list[str]:
    """Everything a learner would see go wrong, from a ``run_in_lab`` report; empty when all is well."""
    found = []
    cells, want = report["cells"], report["expected"]
    code = [c for c in cells if c["type"] == "code"]
    if report["runAll"] != {"ok": True}:
        found.append(f"Run All Cells did not succeed: {report['runAll']}")
    if unrun := [c["index"] for c in code if c["executionCount"] is None]:
        found.append(f"cells left unrun: {unrun}")
    found += [f"cell {c['index']}: error output {e}" for c in code for e in c["errors"]]
    found += [f"cell {c['index']}: traceback shown {t[:200]!r}" for c in cells for t in c["tracebacks"]]
    found += [f"cell {c['index']}: output not rendered ({b!r})" for c in cells for b in c["broken"]]
    plots = [p for c in cells for p in c["plots"]]
    drawn = [p for p in plots if p["drawn"] and p["width"] > 50 and p["height"] > 50]
    if len(drawn) < want["plots"]:
        found.append(f"{len(drawn)} plotly graphs drawn, want {want['plots']}: {plots}")
    views = [w for c in cells for w in c["widgets"]]
    if len(views) < want["widgets"]:
        found.append(f"{len(views)} widget views, want {want['widgets']}")
    found += [f"widget view {w['view']} shows no controls: {w['text']!r}" for w in views
              if not (w["rendered"] and w["controls"])]
    found += [f"widget view {w['view']} shows render errors: {w['errors']}" for w in views if w["errors"]]
    for poke in report["widget_pokes"]:
        if not poke["output_changed"]:
            found.append(f"explorer {poke['view']} did not redraw after choosing {poke['chose']!r}")
        elif poke["plots_after"] < poke["plots_before"]:
            found.append(f"explorer {poke['view']} lost its figure after choosing {poke['chose']!r}")
    found += [f"browser console: {m}" for m in report["console"] if not _is_harmless(m)]
    return found


@pytest.mark.parametrize(("name", "expect"), CASES)
def test_notebook_runs_in_jupyterlab(lab, chromium, artifacts: Path, name: str, expect: Expect):
    stored_plots, stored_widgets = _stored_counts(NOTEBOOKS / name)
    report = run_in_lab(chromium, lab, artifacts, name, plots=max(expect.plots, stored_plots),
                        widgets=max(expect.widgets, stored_widgets))
    stem = Path(name).stem
    found = problems(report)
    diagrams = sum(c.get("diagrams", 0) for c in report["cells"])
    if diagrams < expect.diagrams:
        found.append(f"{diagrams} Mermaid diagrams drawn, expected at least {expect.diagrams}")
    printed = "\n".join(c.get("stdout", "") for c in report["cells"])
    found += [f"no cell printed {text!r}" for text in expect.texts if text not in printed]
    assert not found, f"{name} in JupyterLab ({artifacts / stem}.json, .png):\n  " + "\n  ".join(found)


def test_a_broken_notebook_is_caught(lab, chromium, artifacts: Path):
    """The control: a notebook with a working widget, a console error, an exception and a cell after it. The checks
    above must see the console error, the exception and the unrun cell, and still see the widget, so that their
    passing means something."""
    sources = ["import ipywidgets\nipywidgets.Dropdown(options=[1, 2], description='x')",
               "from IPython.display import Javascript\nJavascript(\"console.error('k2lab control')\")",
               "1 / 0", "print('never runs')"]
    cells = [{"cell_type": "code", "execution_count": None, "id": f"control-{i}", "metadata": {}, "outputs": [],
              "source": source} for i, source in enumerate(sources)]
    notebook = {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                            "language": "python"}},
                "nbformat": 4, "nbformat_minor": 5}
    (lab.root / "zz_control.ipynb").write_text(json.dumps(notebook))
    report = run_in_lab(chromium, lab, artifacts, "zz_control.ipynb", plots=0, widgets=1)
    found = problems(report)
    assert any("ZeroDivisionError" in p for p in found), found
    assert any("cells left unrun: [3]" in p for p in found), found
    assert any("browser console: error: k2lab control" in p for p in found), found
    assert not [p for p in found if "widget" in p or "explorer" in p], found

