"""The documentation site as a visitor sees it: the built site (mkdocs.yml) served from a local http.server, opened in
Debian's headless Chromium. Checks the home page (its first screen: install, code, a figure), the notebook pages
(every plotly figure the notebook stores drawn, none missing; the saved explorers shown; solutions folded; no cell
tags; outputs inside their boxes; the Mermaid diagrams as pictures), the API page of ``K2Model``, and the search box
(``hook_topk_idx``, ``YaRN``, ``attribution_patch``), with no failed request, no request off this machine and no
console error. Screenshots go to the artifacts folder (see conftest.py), in site/.

    python -m pytest -m browser tests/browser/test_site_in_browser.py

The site is built into a temporary folder with ``mkdocs build --strict`` (about 5-10 s), or taken from
``K2LAB_SITE`` when that names a built site (CI builds it once, .ci/run). Without mkdocs (``pip install -e
".[docs]"``), playwright or a Chromium it skips with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
STEP_TIMEOUT_MS = 60_000
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
SEARCHES = ["hook_topk_idx", "YaRN", "attribution_patch"]


def _stored(name: str) -> dict:
    """What the committed notebook stores: plotly outputs in its cells, plotly outputs inside the saved Output widgets
    that its widget views show, widget views, and cells tagged solution (code) or folded solution Markdown."""
    nb = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())
    outputs = [out for cell in nb["cells"] for out in cell.get("outputs", [])]
    state = nb.get("metadata", {}).get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    models = state.get("state", {})

    def plots_in(model_id: str, seen: set) -> int:
        if model_id in seen or model_id not in models:
            return 0
        seen.add(model_id)
        s = models[model_id]["state"]
        n = sum(PLOTLY in o.get("data", {}) for o in s.get("outputs", []))
        children = [c[len("IPY_MODEL_"):] for c in s.get("children", []) if isinstance(c, str)]
        return n + sum(plots_in(c, seen) for c in children)

    views = [o["data"][WIDGET_VIEW]["model_id"] for o in outputs if WIDGET_VIEW in o.get("data", {})]
    return {
        "plots": sum(PLOTLY in o.get("data", {}) for o in outputs),
        "widget_plots": sum(plots_in(v, set()) for v in views if v in models),
        "widgets": sum(v in models for v in views),
        "solutions": sum("solution" in c.get("metadata", {}).get("tags", []) for c in nb["cells"]),
    }


# ---------------------------------------------------------------------------------------------------------------------
# The site and its server


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("K2LAB_SITE")
    if given:
        if not (Path(given) / "index.html").is_file():
            pytest.fail(f"K2LAB_SITE={given} holds no built site (index.html)")
        return Path(given)
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError:
        pytest.skip('mkdocs, mkdocs-material or mkdocstrings is not installed (pip install -e ".[docs]")')
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return out


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


@pytest.fixture(scope="session")
def server(chromium: object, site: Path) -> Iterator[str]:
    """The site on a free localhost port (asks for ``chromium`` first: no browser, no server)."""
    handler = functools.partial(_Quiet, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="session")
def shots(artifacts: Path) -> Path:
    folder = artifacts / "site"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class Visit:
    """A browser tab that records everything that went wrong: failed requests, HTTP errors, requests to any host but
    the local server (blocked, so nothing leaves the machine), console errors and uncaught page errors."""

    def __init__(self, chromium, base: str, width: int = 1280, height: int = 900):
        self.base = base
        self.context = chromium.new_context(viewport={"width": width, "height": height})
        self.problems: list[str] = []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.set_default_timeout(STEP_TIMEOUT_MS)
        self.page.on("console", lambda m: self.problems.append(f"console {m.type}: {m.text} {m.location}")
                     if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("requestfailed", lambda r: self.problems.append(f"request failed: {r.url} ({r.failure})"))
        self.page.on("response", lambda r: self.problems.append(f"HTTP {r.status}: {r.url}")
                     if r.status >= 400 else None)

    def _route(self, route) -> None:
        url = route.request.url
        if url.startswith(("data:", "blob:")) or urlparse(url).netloc == urlparse(self.base).netloc:
            route.continue_()
        else:
            self.problems.append(f"request off this machine (blocked): {url}")
            route.abort()

    def open(self, path: str) -> None:
        self.page.goto(f"{self.base}/{path}", wait_until="load")
        self.page.wait_for_load_state("networkidle")

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def visit(chromium, server) -> Iterator[Visit]:
    tab = Visit(chromium, server)
    try:
        yield tab
    finally:
        tab.close()


# ---------------------------------------------------------------------------------------------------------------------
# The pages


FIRST_SCREEN = """() => {
  const article = document.querySelector('article');
  const inView = e => !!e && e.getBoundingClientRect().bottom <= window.innerHeight
                         && e.getBoundingClientRect().width > 0;
  const blocks = Array.from(article.querySelectorAll('pre'));
  const install = blocks.find(p => p.innerText.includes('pip install'));
  const code = blocks.find(p => p.innerText.includes('k2lab.load_nano()'));
  const figure = article.querySelector('figure.k2-home-figure img');
  return {install: inView(install), code: inView(code), codeLines: code ? code.innerText.trim().split('\\n').length : 0,
          figure: inView(figure), figureLoaded: !!figure && figure.complete && figure.naturalWidth > 500,
          figureWidth: figure ? figure.getBoundingClientRect().width : 0};
}"""


def test_home_page(chromium, server, shots: Path):
    """The home page's first screen, at 1280x800, shows the install command, the five-line code sample and a figure
    from the course; below it, README's opening and the way onward."""
    visit = Visit(chromium, server, width=1280, height=800)
    try:
        visit.open("")
        page = visit.page
        assert page.title().startswith("k2lab")
        assert page.locator("article h1").first.inner_text().startswith("k2lab")
        text = page.locator("article").inner_text()
        assert "Kimi K2" in text and "K2-nano" in text and "Start here" in text
        first = page.evaluate(FIRST_SCREEN)
        assert first["install"] and first["code"] and first["codeLines"] == 5, first
        assert first["figure"] and first["figureLoaded"] and first["figureWidth"] > 300, first
        nav = page.locator("nav.md-nav--primary").inner_text()
        for entry in ("Start here", "Course", "API reference", "For researchers"):
            assert entry in nav, f"the navigation lacks {entry!r}: {nav[:500]}"
        fonts = page.evaluate("() => Array.from(document.fonts).map(f => f.family)")
        page.screenshot(path=str(shots / "home-first-screen.png"))
        page.screenshot(path=str(shots / "home.png"), full_page=True)
        assert not visit.problems, visit.problems
        assert not [f for f in fonts if "Roboto" in f], f"a web font is declared: {fonts}"
    finally:
        visit.close()


FIGURES = """() => {
  const divs = Array.from(document.querySelectorAll('.k2-plotly'));
  const drawn = divs.filter(d => d.dataset.k2Drawn === 'yes' && d.querySelector('.main-svg')
                              && d.getBoundingClientRect().width > 50 && d.getBoundingClientRect().height > 50);
  return {divs: divs.length, drawn: drawn.length,
          inWidgets: drawn.filter(d => d.closest('.k2-widget')).length,
          failed: divs.filter(d => d.dataset.k2Drawn === 'failed').length};
}"""

LAYOUT = """() => {
  const article = document.querySelector('article');
  const box = article.getBoundingClientRect();
  // Anything wider than the article must scroll inside its own box, not stick out of the page.
  const outside = Array.from(article.querySelectorAll('pre, .k2-out, .k2-plot, table'))
    .filter(e => e.getBoundingClientRect().right > box.right + 2 && !e.closest('[style*="overflow"]'))
    .map(e => e.className || e.tagName);
  const scrolls = Array.from(article.querySelectorAll('pre.k2-out'))
    .filter(e => e.scrollWidth > e.clientWidth + 1).length;
  const folds = Array.from(article.querySelectorAll('details.k2-solution'));
  return {pageWidth: document.documentElement.scrollWidth, viewport: window.innerWidth, outside,
          scrolls, folds: folds.length, openFolds: folds.filter(d => d.open).length,
          hiddenCode: folds.filter(d => d.querySelector('.k2-cell')).length,
          math: article.querySelectorAll('math').length, widgets: article.querySelectorAll('.k2-widget').length,
          text: article.innerText};
}"""


def _notebook_page(visit: Visit, name: str, shots: Path | None) -> tuple[dict, dict]:
    visit.open(f"course/{name}/")
    page = visit.page
    stored = _stored(name)
    want = stored["plots"] + stored["widget_plots"]
    with contextlib.suppress(Exception):  # the assertions below say what is missing
        page.wait_for_function(f"() => document.querySelectorAll('.k2-plotly[data-k2-drawn=\"yes\"]').length >= {want}",
                               timeout=STEP_TIMEOUT_MS, polling=200)
    figures = page.evaluate(FIGURES)
    layout = page.evaluate(LAYOUT)
    if shots is not None:
        page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
        first = page.locator(".k2-cell:has(.k2-plotly)").first  # the first figure with its code, to look at quickly
        if first.count():
            first.scroll_into_view_if_needed()
            first.screenshot(path=str(shots / f"{name}-first-figure.png"))
    return stored, {**figures, **layout}


@pytest.mark.parametrize("name", sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")))
def test_notebook_page_draws_every_stored_figure(visit: Visit, shots: Path, name: str):
    stored, seen = _notebook_page(visit, name, shots)
    # Every plotly output of the notebook's cells is drawn, plus those inside its saved explorers; none failed.
    assert seen["failed"] == 0, seen
    assert seen["drawn"] == seen["divs"] == stored["plots"] + stored["widget_plots"], (stored, seen)
    assert seen["drawn"] - seen["inWidgets"] == stored["plots"], (stored, seen)
    assert seen["widgets"] == stored["widgets"], (stored, seen)
    # Solutions stay folded (their code inside the fold); no cell tag is shown; nothing sticks out of the page.
    assert seen["openFolds"] == 0, seen["openFolds"]
    if stored["solutions"]:
        assert seen["folds"] > 0 and seen["hiddenCode"] > 0, seen
    for tag in ("nbval-ignore-output", "nbval-skip", "nbval-check-output"):  # tags (the NBVAL_ comments are code)
        assert tag not in seen["text"], f"the cell tag {tag!r} shows on the page"
    assert seen["pageWidth"] <= seen["viewport"], f"the page scrolls sideways: {seen['pageWidth']} > viewport"
    assert not seen["outside"], f"outputs stick out of the article: {seen['outside'][:5]}"
    assert not visit.problems, visit.problems


def test_solution_fold_opens_and_draws(visit: Visit):
    """A solution opened shows its code, which starts with its mark, and the fold of its output (as the notebook
    stored it, k2lab.lab.solutions), which opens in turn; a figure first drawn inside a fold gets its width then."""
    visit.open("course/04a_router/")
    page = visit.page
    fold = page.locator("details.k2-solution:has(.k2-cell)").first
    assert not fold.evaluate("d => d.open")
    assert not fold.locator(".k2-cell").is_visible()
    fold.locator("summary").first.click()
    cell = fold.locator(".k2-cell").first
    assert cell.is_visible() and "# Solution (click to show)" in cell.inner_text()
    output = cell.locator("details.k2lab-solution-output").first
    assert output.is_visible() and not output.evaluate("d => d.open")
    assert "✓" not in cell.inner_text()  # the verdict waits in the output's own fold
    output.locator("summary").click()
    assert "✓" in cell.inner_text()
    assert not visit.problems, visit.problems


def test_formulas_and_saved_explorer(visit: Visit, shots: Path):
    """02's YaRN formulas as MathML, and its explorer as saved: the sliders at their saved values over its figure."""
    stored, seen = _notebook_page(visit, "02_yarn", None)
    assert seen["math"] >= 5, seen["math"]
    widget = visit.page.locator(".k2-widget").first
    assert widget.locator("input[type=range]").count() >= 1
    assert widget.locator(".k2-plotly[data-k2-drawn=yes]").count() == stored["widget_plots"]
    widget.screenshot(path=str(shots / "02_yarn-explorer.png"))
    assert not visit.problems, visit.problems


@pytest.mark.parametrize("name", ["00_tour", "04b_block"])
def test_mermaid_diagrams(visit: Visit, shots: Path, name: str):
    """The notebooks' Mermaid diagrams as their committed SVG pictures (scripts/site/diagrams.py): one picture per
    Mermaid block of the notebook, each loaded and drawn at a readable size, none shown as source, nothing fetched off
    this machine."""
    nb = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())
    blocks = sum("".join(c["source"]).count("```mermaid") for c in nb["cells"] if c["cell_type"] == "markdown")
    visit.open(f"course/{name}/")
    page = visit.page
    pictures = page.locator("figure.k2-diagram img")
    assert pictures.count() == blocks >= 1 and page.locator(".k2-mermaid-source").count() == 0
    sizes = pictures.evaluate_all("imgs => imgs.map(i => [i.complete, i.naturalWidth, i.clientWidth])")
    assert all(done and natural > 100 and shown > 100 for done, natural, shown in sizes), sizes
    assert "RMSNorm" in pictures.first.get_attribute("alt")  # the labels, for a reader who cannot see the picture
    svg = page.request.get(pictures.first.evaluate("i => i.src")).text()
    assert "RMSNorm" in svg and "<foreignObject" not in svg  # labels as SVG text: the same in any browser
    pictures.first.screenshot(path=str(shots / f"{name}-diagram.png"))
    assert not visit.problems, visit.problems


def test_api_page_of_k2model(visit: Visit, shots: Path):
    visit.open("api/k2lab.K2Model/")
    page = visit.page
    assert "K2Model" in page.locator("article h1").first.inner_text()
    assert page.locator('[id="k2lab.K2Model"]').count() == 1
    text = page.locator("article").inner_text()
    for member in ("run_with_cache", "new_cache", "hook_names", "[B, T, V]"):
        assert member in text, f"{member!r} not on K2Model's page"
    page.screenshot(path=str(shots / "api-K2Model.png"), full_page=False)
    assert not visit.problems, visit.problems


@pytest.mark.parametrize("query", SEARCHES)
def test_search_finds(visit: Visit, shots: Path, query: str):
    visit.open("")
    page = visit.page
    page.locator("label.md-search__icon, .md-search__input").first.click()
    box = page.locator("input.md-search__input")
    box.press_sequentially(query, delay=20)  # typed: the search box answers key events
    results = page.locator(".md-search-result__item")
    results.first.wait_for(timeout=STEP_TIMEOUT_MS)
    found = results.all_inner_texts()
    assert found, f"no search result for {query!r}"
    assert any(query.lower() in r.lower() for r in found), f"{query!r}: results do not show it: {found[:3]}"
    page.screenshot(path=str(shots / f"search-{query}.png"))
    # The first result leads to a page of this site that names it.
    results.first.locator("a").first.click()
    page.wait_for_load_state("load")
    assert query.lower() in page.locator("article").inner_text().lower()
    assert not visit.problems, visit.problems
