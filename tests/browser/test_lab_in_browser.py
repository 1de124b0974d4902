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

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the verdicts' colours, in the printed text
RUN_TIMEOUT_S = float(os.environ.get("K2LAB_BROWSER_TIMEOUT", 900))  # all cells of one notebook, on a slow CPU
STEP_TIMEOUT_MS = 180_000  # loading the lab's scripts, starting a kernel, one widget round trip
NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


@dataclass(frozen=True)
class Expect:
    plots: int  # plotly graphs drawn, at least (those inside explorers included)
    widgets: int  # ipywidgets views, at least
    diagrams: int = 0  # Mermaid diagrams in Markdown cells drawn as SVG, at least
    texts: tuple[str, ...] = ()  # printed or shown by some cell's output (an exercise's verdict, say)
    # A learner's answer typed into the exercise cell whose source starts with the key, before Run All runs it and
    # steps on past its solution; and a cell added at the end, which prints what the notebook then holds.
    answers: tuple[tuple[str, str], ...] = ()
    probe: str = ""
    reopen: bool = False  # saved after the run and opened again (for explorers: is their stored state found?)


# 04b's first exercise answered by a learner who forgot the eps; Run All then runs the folded solution after it.
WRONG_RMS_NORM = ("@lab.mine\n"
                  "def my_rms_norm(x, weight, eps):\n"
                  "    return weight * x / x.pow(2).mean(-1, keepdim=True).sqrt()  # my answer, eps left out\n")
KEPT_PROBE = ('print("learner\'s answer kept:", not exercises.check_rms_norm(my_rms_norm).ok, '
              '"eps left out" in lab.mine.path.read_text())')

CASES = [
    # The tour: the logit-lens figure (the token boxes are plain HTML).
    pytest.param("00_tour.ipynb", Expect(plots=1, widgets=0, diagrams=1), id="00_tour"),
    # The tokenizer: its token explorer (a text box over coloured HTML tokens), typed into.
    pytest.param("01_tokens.ipynb", Expect(plots=0, widgets=1, reopen=True), id="01_tokens"),
    # The router: one token's stages, the bias flips, and the router explorer (a layer dropdown, a token slider and
    # its own figure inside an Output widget): plotly in and out of widgets, and a widget round trip.
    pytest.param("04a_router.ipynb", Expect(plots=3, widgets=1, reopen=True), id="04a_router"),
    # The block by hand: two Mermaid diagrams; exercises as a learner sees them (a stub's verdict, a wrong answer's
    # reason), run past their folded solutions: the learner's answer is kept in mine.py and the solution's output stays
    # folded.
    pytest.param("04b_block.ipynb", Expect(plots=0, widgets=0, diagrams=2,
                                           texts=("✗ not written yet", "✗ RMSNorm: you forgot the eps",
                                                  "learner's answer kept: True True"),
                                           answers=(("@lab.mine\ndef my_rms_norm", WRONG_RMS_NORM),), probe=KEPT_PROBE),
                 id="04b_block"),
]

# Notebooks opened only (their explorers before any cell runs, and whether opening marks them changed).
OPENED_ONLY = ["02_yarn.ipynb", "03_mla.ipynb"]
RUN_TO_EXPLORE = "Explorer: run this cell to explore"  # k2lab.viz.widgets.RUN_TO_EXPLORE, the text before a run
SOLUTION_SUMMARY = "Solution's output (click to show)"  # k2lab.lab.solutions: the fold of a solution's output

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

# Before any cell runs: the notebook as JupyterLab holds it and as the file says (to tell what opening changed),
# whether it is marked changed, and what each explorer's output shows.
OPEN_STATE = """async () => {""" + WIDGET_VIEWS + """
  const panel = window.__k2panel;
  const file = await window.jupyterapp.serviceManager.contents.get(panel.context.path, {content: true});
  return {dirty: panel.context.model.dirty, model: panel.context.model.toJSON(), file: file.content,
          explorers: widgetViews().map(v => v.innerText.slice(0, 200))};
}"""

# A learner's answer typed into a cell (found by the start of its source), and a cell added at the end.
TYPE_ANSWERS = """([answers, probe]) => {
  const panel = window.__k2panel, cells = panel.content.model.sharedModel;
  const missing = [];
  for (const [start, source] of answers) {
    const cell = panel.content.widgets.find(c => c.model.type === 'code' &&
                                              c.model.sharedModel.getSource().startsWith(start));
    if (cell) cell.model.sharedModel.setSource(source); else missing.push(start);
  }
  if (probe) cells.insertCell(cells.cells.length, {cell_type: 'code', source: probe});
  return missing;
}"""

# What each solution cell shows once it ran: its output must stay folded (nothing open, no verdict in sight).
SOLUTIONS_SHOWN = """() => window.__k2panel.content.widgets
  .filter(c => c.model.type === 'code' && (c.model.getMetadata('tags') || []).includes('solution'))
  .map(c => ({index: window.__k2panel.content.widgets.indexOf(c),
              first: c.model.sharedModel.getSource().split('\\n')[0],
              visible: c.outputArea ? c.outputArea.node.innerText : '',
              open: c.outputArea ? c.outputArea.node.querySelectorAll('details[open]').length : 0}))"""

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
    out.shown = areaText.slice(0, 2000);  // what the learner reads: printed text and rendered verdicts alike
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


def open_in_lab(page, lab, name: str) -> None:
    """Open ``name`` in the lab page and wait until its kernel is idle (``window.__k2panel`` is its panel)."""
    page.goto(f"{lab.url}/lab/tree/{name}?reset")
    page.wait_for_function(FIND_PANEL, arg=name, polling=500)
    page.wait_for_function(KERNEL_IDLE, polling=500)
    page.wait_for_timeout(2_000)  # the kernel's info (kernelspec, language) reaches the notebook's metadata


def reopen(page, name: str) -> dict:
    """Save the notebook, close it with its kernel, open it again and wait for its outputs: -> whether it opened
    marked changed and which outputs show as broken (a widget whose model is not found, say)."""
    page.evaluate("async () => { await window.__k2panel.context.save(); "
                  "await window.__k2panel.sessionContext.shutdown(); window.__k2panel.dispose(); }")
    page.evaluate("(name) => window.jupyterapp.commands.execute('docmanager:open', {path: name})", name)
    page.wait_for_function(FIND_PANEL, arg=name, polling=500)
    page.wait_for_function(KERNEL_IDLE, polling=500)
    try:  # the widget manager restores the saved state once the kernel is there
        page.wait_for_function("() => window.__k2panel.node.querySelectorAll('.jupyter-widgets').length > 0",
                               timeout=30_000, polling=500)
    except Exception:  # noqa: BLE001 - no widget on the page: reported by the checks
        pass
    page.wait_for_timeout(3_000)
    text = page.evaluate("() => Array.from(window.__k2panel.node.querySelectorAll('.jp-OutputArea'))"
                         ".map(o => o.innerText).join('\\n')")
    changes, _ = opening_changes(page.evaluate(OPEN_STATE))
    views = page.evaluate("() => {" + WIDGET_VIEWS + " return widgetViews().map(v => ({controls: "
                          "v.querySelectorAll('" + CONTROLS + "').length, plots: v.querySelectorAll("
                          "'.js-plotly-plot').length, text: v.innerText.slice(0, 100)})); }")
    return {"changes": changes, "broken": [b for b in BROKEN_OUTPUT if b in text],
            "dumps": [line[:100] for line in text.splitlines() if line.startswith(("VBox(", "HBox("))],
            "views": views}


def run_in_lab(chromium, lab, artifacts: Path, name: str, plots: int, widgets: int,
               answers: tuple[tuple[str, str], ...] = (), probe: str = "", reopen_after: bool = True) -> dict:
    """Open ``name`` in the lab, note what it shows before any cell runs, type the learner's ``answers`` and add the
    ``probe`` cell, clear its outputs, Run All Cells, wait until the kernel is idle and the outputs are drawn,
    screenshot it, change the explorers' dropdowns, then (``reopen_after``) save it and open it again; return what
    the page showed (also saved as JSON)."""
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
        open_in_lab(page, lab, name)
        report["opened_s"] = round(time.monotonic() - started, 1)
        report["at_open"] = page.evaluate(OPEN_STATE)
        report["at_open_changes"], report["plotly_snapshots"] = opening_changes(report["at_open"])
        report["answers_not_found"] = page.evaluate(TYPE_ANSWERS, [list(map(list, answers)), probe])
        page.evaluate(RUN_ALL)
        page.wait_for_function(RUN_DONE, timeout=RUN_TIMEOUT_S * 1000, polling=1000)
        report["ran_s"] = round(time.monotonic() - started, 1)
        try:
            page.wait_for_function(RENDERED, arg=[plots, widgets, BROKEN_OUTPUT], timeout=60_000, polling=500)
        except Exception:  # noqa: BLE001 - the report says what is missing
            pass
        report.update(page.evaluate(REPORT, BROKEN_OUTPUT))
        _screenshot(page, artifacts / f"{stem}.png")
        report["solutions"] = page.evaluate(SOLUTIONS_SHOWN)
        report["widget_pokes"] = _poke_widgets(page)
        if report["widget_pokes"]:
            _screenshot(page, artifacts / f"{stem}-after-widget-change.png")
        if reopen_after:
            report["console_before_reopening"] = len(console)
            report["reopened"] = reopen(page, name)
            _screenshot(page, artifacts / f"{stem}-reopened.png")
    except Exception:
        try:
            page.screenshot(path=str(artifacts / f"{stem}-failure.png"))
        except Exception:  # noqa: BLE001 - keep the original error
            pass
        raise
    finally:
        report["seconds"] = round(time.monotonic() - started, 1)
        report["console"] = console
        saved = {k: v for k, v in report.items() if k != "at_open"}  # the notebook itself stays out of the JSON
        (artifacts / f"{stem}.json").write_text(json.dumps(saved, indent=1))
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
    first_after = report.get("console_before_reopening", len(report["console"]))
    found += [f"{'saved and opened again, ' if i >= first_after else ''}browser console: {m}"
              for i, m in enumerate(report["console"]) if not _is_harmless(m)]
    found += opening_problems(report["at_open"])
    found += [f"the learner's answer could not be typed: no cell starts with {start!r}"
              for start in report["answers_not_found"]]
    for cell in report["solutions"]:
        if not cell["first"].startswith("# Solution"):
            found.append(f"solution cell {cell['index']} starts with {cell['first']!r}, not a '# Solution' mark")
        shown = [line for line in cell["visible"].splitlines() if line.strip() and not line.startswith(
            (SOLUTION_SUMMARY, "Your ", "your "))]
        if cell["open"] or shown:
            found.append(f"solution cell {cell['index']} shows its output after running: {shown[:2]}")
    reopened = report.get("reopened", {"changes": [], "broken": [], "dumps": []})
    found += [f"saved and opened again, opening changed it: {change}" for change in reopened["changes"]]
    found += [f"saved and opened again, an output shows {b!r}" for b in reopened["broken"]]
    found += [f"saved and opened again, an output shows a widget's repr: {d!r}" for d in reopened["dumps"]]
    found += [f"saved and opened again, explorer {i} shows no controls from its stored state: {v['text']!r}"
              for i, v in enumerate(reopened.get("views", [])) if not v["controls"]]
    return found


PLOTLY = "application/vnd.plotly.v1+json"


def _as_saved(nb: dict) -> dict:
    """A notebook as its file would hold it, whichever of JupyterLab's in-memory forms it is in: sources and texts
    as one string, no empty attachments, no "trusted" flag (JupyterLab's own, never written), and without the PNG
    that plotly's lab extension adds to each figure it draws (``opening_changes`` names those apart)."""
    joined = lambda v: "".join(v) if isinstance(v, list) else v  # noqa: E731
    cells = []
    for cell in nb.get("cells", []):
        cell = {k: v for k, v in cell.items() if not (k == "attachments" and not v)}
        cell["source"] = joined(cell.get("source", ""))
        cell["metadata"] = {k: v for k, v in cell.get("metadata", {}).items() if k != "trusted"}
        outputs = []
        for out in cell.get("outputs", []):
            out = dict(out)
            if "text" in out:
                out["text"] = joined(out["text"])
            if "data" in out:
                out["data"] = {m: joined(v) for m, v in out["data"].items()
                               if not (m == "image/png" and PLOTLY in out["data"])}
            outputs.append(out)
        if "outputs" in cell:
            cell["outputs"] = outputs
        cells.append(cell)
    return {"metadata": nb.get("metadata", {}), "cells": cells}


def opening_changes(at_open: dict) -> tuple[list[str], int]:
    """What opening the notebook changed in it, other than plotly's PNG snapshots (-> the changes, in words; the
    number of snapshots added)."""
    model, file = at_open["model"], at_open["file"]
    changes = [f"metadata {key!r}: {file['metadata'].get(key)!r} -> {value!r}"[:160]
               for key, value in model.get("metadata", {}).items() if file["metadata"].get(key) != value]
    saved_model, saved_file = _as_saved(model), _as_saved(file)
    for i, (now, then) in enumerate(zip(saved_model["cells"], saved_file["cells"], strict=False)):
        for key in set(now) | set(then):
            if now.get(key) != then.get(key):
                changes.append(f"cell {i} {key}: {str(then.get(key))[:60]!r} -> {str(now.get(key))[:60]!r}")
    snapshots = sum("image/png" in out.get("data", {}) and "image/png" not in old.get("data", {})
                    for now, then in zip(model["cells"], file["cells"], strict=False)
                    for out, old in zip(now.get("outputs", []), then.get("outputs", []), strict=False)
                    if PLOTLY in out.get("data", {}))
    return changes, snapshots


def opening_problems(at_open: dict) -> list[str]:
    """What a learner sees wrong on opening a notebook: something in it changed at once (so that closing it asks to
    save), or an explorer's output that is not the sentence asking to run it. Plotly's lab extension writes a PNG of
    each figure it draws into the notebook (jupyterlab-plotly's renderer, unless the output carries one already):
    that change is the extension's, reported in the JSON as ``plotly_snapshots`` and not counted here."""
    changes, _ = opening_changes(at_open)
    found = [f"opening the notebook changed it: {change}" for change in changes]
    found += [f"before any cell runs, an explorer shows {text[:80]!r}, not the sentence asking to run it"
              for text in at_open["explorers"] if RUN_TO_EXPLORE not in text]
    return found


@pytest.mark.parametrize(("name", "expect"), CASES)
def test_notebook_runs_in_jupyterlab(lab, chromium, artifacts: Path, name: str, expect: Expect):
    stored_plots, stored_widgets = _stored_counts(NOTEBOOKS / name)
    report = run_in_lab(chromium, lab, artifacts, name, plots=max(expect.plots, stored_plots),
                        widgets=max(expect.widgets, stored_widgets), answers=expect.answers, probe=expect.probe,
                        reopen_after=expect.reopen)
    stem = Path(name).stem
    found = problems(report)
    diagrams = sum(c.get("diagrams", 0) for c in report["cells"])
    if diagrams < expect.diagrams:
        found.append(f"{diagrams} Mermaid diagrams drawn, expected at least {expect.diagrams}")
    printed = ANSI.sub("", "\n".join(c.get("stdout", "") + "\n" + c["shown"] for c in report["cells"]))
    found += [f"no cell printed {text!r}" for text in expect.texts if text not in printed]
    assert not found, f"{name} in JupyterLab ({artifacts / stem}.json, .png):\n  " + "\n  ".join(found)


@pytest.mark.parametrize("name", OPENED_ONLY)
def test_notebook_opens_unchanged_with_its_explorers_described(lab, chromium, artifacts: Path, name: str):
    """The notebooks not run above, as first opened: not marked changed once the kernel is up, and each explorer's
    output a sentence asking to run it (not a widget's repr, not an error)."""
    context = chromium.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(STEP_TIMEOUT_MS)
    try:
        open_in_lab(page, lab, name)
        at_open = page.evaluate(OPEN_STATE)
        page.evaluate("() => window.__k2panel.sessionContext.shutdown()")
    finally:
        context.close()
    assert at_open["explorers"], f"{name}: no explorer found among its stored outputs"
    found = opening_problems(at_open)
    assert not found, f"{name} in JupyterLab:\n  " + "\n  ".join(found)


def test_a_broken_notebook_is_caught(lab, chromium, artifacts: Path):
    """The control: a notebook with a working widget, a solution cell whose output shows, a console error, an
    exception and a cell after it, and no language_info (JupyterLab writes it when the kernel starts, so the notebook
    opens changed). The checks above must see each of these, and still see the widget, so that their passing means
    something."""
    sources = ["import ipywidgets\nipywidgets.Dropdown(options=[1, 2], description='x')",
               "print('the answer is 42')",  # tagged solution below, without the mark: its output shows
               "from IPython.display import Javascript\nJavascript(\"console.error('k2lab control')\")",
               "1 / 0", "print('never runs')"]
    cells = [{"cell_type": "code", "execution_count": None, "id": f"control-{i}",
              "metadata": {"tags": ["solution"]} if i == 1 else {}, "outputs": [], "source": source}
             for i, source in enumerate(sources)]
    notebook = {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                                            "language": "python"}},
                "nbformat": 4, "nbformat_minor": 5}
    (lab.root / "zz_control.ipynb").write_text(json.dumps(notebook))
    report = run_in_lab(chromium, lab, artifacts, "zz_control.ipynb", plots=0, widgets=1)
    found = problems(report)
    assert any("ZeroDivisionError" in p for p in found), found
    assert any("cells left unrun: [4]" in p for p in found), found
    assert any("solution cell 1 shows its output after running" in p for p in found), found
    assert any("opening the notebook changed it: metadata 'language_info'" in p for p in found), found
    assert any("browser console: error: k2lab control" in p for p in found), found
    # a plain widget (not an explorer) saved after a run has no stored state: opened again, its model is not found
    assert any("saved and opened again, an output shows" in p for p in found), found
    assert not [p for p in found if ("widget" in p or "explorer" in p) and "opened again" not in p], found

