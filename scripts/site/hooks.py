"""MkDocs hooks that make k2lab's documentation site (``mkdocs.yml`` names this file under ``hooks:``).

The site is made from the files the repository already has, so nothing is written twice:

- ``index.md`` and ``start.md`` (real pages in docs/): their ``<!-- readme: SECTION -->`` markers are replaced by
  README's sections, "lead" (what k2lab is) and "after the lead" (the rest of README's first screen) among them;
- ``course/``: notebooks/README.md as the course's index, notebooks/GLOSSARY.md, and a page per ``notebooks/*.ipynb``
  from its stored outputs (``notebook_page.py``; nothing is executed), its plotly figures drawn by the plotly.js of
  the installed ``plotly`` package, copied into the site, its Mermaid diagrams shown as their committed SVG pictures
  (``diagrams.py``: a diagram whose picture is missing or stale is a warning, and shows its source);
- ``api/``: a page per module of the public API and per public class in it, from the modules' ``__all__`` (else
  their public names, as griffe sees them), rendered by mkdocstrings.

After the build it checks the site: no page, script or stylesheet asks for anything off this machine (no CDN, no web
font), each notebook page holds as many plotly figures as its notebook stores, and every public name has its anchor.
A failed check stops the build.
"""

from __future__ import annotations

import html
import json
import logging
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.utils import get_relative_url

sys.path.insert(0, str(Path(__file__).resolve().parent))
import api_pages  # noqa: E402  (this folder, put on the path above: MkDocs loads hooks by file name)
import diagrams  # noqa: E402
import notebook_page  # noqa: E402

log = logging.getLogger("mkdocs.hooks.k2lab")  # under "mkdocs": a warning here fails `mkdocs build --strict`

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
ASSETS = "assets/k2lab"  # where the site's own scripts and plotly.js go
DIAGRAM_LABEL = re.compile(r'\w+\s*[\[(]+\s*"([^"]*)"')  # a Mermaid node's label: id["label"], id(("label"))

# What makes a browser fetch: a tag's src or href (a <link> that is only a reference, such as rel="canonical" under
# `mkdocs serve`, fetches nothing), and a stylesheet's url() and @import. Absolute URLs are off the machine.
FETCHING_TAG = re.compile(r"<(?:script|link|img|iframe|source|video|audio|embed|object|track)\b[^>]*>", re.I)
TAG_URL = re.compile(r"""\s(?:src|href|data|srcset)\s*=\s*["']?\s*((?:https?:)?//[^"'\s>]+)""", re.I)
REFERENCE_ONLY = re.compile(r"""\srel\s*=\s*["']?(?:canonical|alternate|author|license|help|next|prev)\b""", re.I)
CSS_URL = re.compile(r"""(?:@import\s+(?:url\()?|url\()\s*["']?((?:https?:)?//[^"')\s]+)""", re.I)


def external_requests(text: str, css: bool = False) -> list[str]:
    """The URLs off this machine that a page (or, ``css``, a stylesheet) would make the browser fetch."""
    found = [m.group(1) for m in CSS_URL.finditer(text)] if css else []
    if not css:
        for tag in FETCHING_TAG.finditer(text):
            if tag.group(0)[:5].lower() == "<link" and REFERENCE_ONLY.search(tag.group(0)):
                continue
            found += [m.group(1) for m in TAG_URL.finditer(tag.group(0))]
        found += [m.group(1) for m in CSS_URL.finditer(text)]  # <style> blocks and style="" attributes
    return found


@dataclass
class State:
    pages: dict[str, notebook_page.Page] = field(default_factory=dict)  # src_uri -> rendered notebook
    api: api_pages.Reference | None = None  # the API pages, made once per build (on_config)


STATE = State()


# ---------------------------------------------------------------------------------------------------------------------
# README's pieces


def _readme_sections() -> dict[str, str]:
    """README.md as {name: Markdown}: each second-level section's body under its title; "lead", the first paragraph
    after the title (what k2lab is); "after the lead", the rest of the first screen (before the first ``##``)."""
    text = (REPO / "README.md").read_text()
    parts = re.split(r"^## +(.+?)\s*$", text, flags=re.M)
    opening = re.sub(r"^# .*\n", "", parts[0], count=1).strip("\n")
    lead, _, rest = opening.partition("\n\n")
    sections = {parts[i]: parts[i + 1].strip("\n") for i in range(1, len(parts), 2)}
    return {**sections, "lead": lead, "after the lead": rest.strip("\n")}


def _link_for_course(target: str) -> str:
    """A link target written for notebooks/ (Markdown or a notebook), as seen from the site's course/ folder."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
        return target  # a URL or mailto:
    name = target.rsplit("/", 1)[-1]
    if target.endswith(".ipynb") and "/" not in target:
        return name[: -len(".ipynb")] + ".md"  # a missing notebook stays missing: --strict names the broken link
    if target == "GLOSSARY.md":
        return "glossary.md"
    if target == "README.md":
        return "index.md"
    if target.startswith("../docs/"):
        return "../" + target[len("../docs/"):]
    return target


def _course_markdown(text: str) -> str:
    return notebook_page.LINK.sub(lambda m: m.group(1) + _link_for_course(m.group(2)) + m.group(3), text)


# ---------------------------------------------------------------------------------------------------------------------
# MkDocs events


def on_config(config):
    stems = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    STATE.api = api_pages.build(REPO)
    for problem in STATE.api.undocumented:  # a warning each: `mkdocs build --strict` fails, naming them all
        log.warning(problem)
    course = [{"The notebooks": "course/index.md"}]
    course += [{_notebook_title(stem): f"course/{stem}.md"} for stem in stems]
    course.append({"Glossary": "course/glossary.md"})
    listed = {uri for uri in _nav_uris(config["nav"] or [])}
    unlisted = sorted(p.name for p in Path(config["docs_dir"]).glob("*.md")
                      if p.name not in listed and p.name not in ("index.md",))
    nav = []
    for item in config["nav"] or []:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if value == "course/index.md":
            nav.append({next(iter(item)): course})
        elif value == "api/index.md":
            nav.append({next(iter(item)): STATE.api.nav})
        elif isinstance(item, dict) and next(iter(item)) == "Reference" and isinstance(value, list):
            # docs/ pages that mkdocs.yml does not list yet (a new reference page): under Reference, by their title
            nav.append({"Reference": value + [{_md_title(Path(config["docs_dir"]) / name): name}
                                              for name in unlisted]})
        else:
            nav.append(item)
    config["nav"] = nav
    return config


def _nav_uris(items) -> list[str]:
    out = []
    for item in items:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out += _nav_uris(value) if isinstance(value, list) else [value]
    return out


def _md_title(path: Path) -> str:
    m = re.search(r"^#\s+(.+)$", path.read_text(), re.M)
    return m.group(1).strip() if m else path.stem


def _notebook_title(stem: str) -> str:
    """The nav title of a notebook: its number and its first heading's words after the number ("04a The router")."""
    nb = json.loads((NOTEBOOKS / f"{stem}.ipynb").read_text())
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown":
            m = re.search(r"^#\s+(.+)$", notebook_page._text(cell["source"]), re.M)
            if m:
                title = re.sub(r"^\d+\w*\s*[·:.-]\s*", "", m.group(1)).strip()
                return f"{stem.split('_')[0]} · {title}"
    return stem


def on_files(files: Files, config) -> Files:
    stems = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))

    def add(uri: str, content: str | None = None, path: Path | None = None) -> None:
        existing = files.get_file_from_path(uri)
        if existing is not None:
            files.remove(existing)
        if path is not None:
            files.append(File.generated(config, uri, abs_src_path=str(path)))
        else:
            files.append(File.generated(config, uri, content=content))

    add("course/index.md", _course_markdown((NOTEBOOKS / "README.md").read_text()))
    add("course/glossary.md", _course_markdown((NOTEBOOKS / "GLOSSARY.md").read_text()))
    STATE.pages.clear()
    drawn = set()  # the SVG files of the notebooks' diagrams
    for stem in stems:
        nb = json.loads((NOTEBOOKS / f"{stem}.ipynb").read_text())
        found = diagrams.notebook_diagrams(stem, nb)
        drawn |= {d.name for d in found}
        page = notebook_page.render(nb, _link_for_course, _diagram_html(stem, found, config))
        STATE.pages[f"course/{stem}.md"] = page
        note = (f'!!! info "Read-only"\n    The notebook `notebooks/{stem}.ipynb` as it was last run (its stored '
                "outputs). To run it and change it: [Start here](../start.md).\n\n")
        add(f"course/{stem}.md", _insert_after_title(page.markdown, note))
    for uri, content in STATE.api.pages.items():
        add(uri, content)

    import plotly

    add(f"{ASSETS}/plotly.min.js", path=Path(plotly.__file__).parent / "package_data" / "plotly.min.js")
    for svg in sorted(diagrams.OUT.glob("*.svg")):
        if svg.name not in drawn:
            log.warning(f"{svg.relative_to(REPO)} draws a diagram that no notebook has any more: python "
                        "scripts/site/diagrams.py removes it")
    return files


def _diagram_html(stem: str, found: list[diagrams.Diagram], config) -> Callable[[int, str], str]:
    """How notebook ``stem``'s page shows its n-th Mermaid diagram (of ``found``): its committed SVG
    (``diagrams.py``), a link to the picture at full size around it; else, with a warning, its source."""
    by_number = {d.number: d for d in found}
    page_url = File.generated(config, f"course/{stem}.md", content="").url

    def html_of(number: int, source: str) -> str:
        diagram = by_number[number]
        state = diagram.state()
        if state != "ok":
            log.warning(f"notebooks/{stem}.ipynb: its Mermaid diagram {number} has a {state} SVG "
                        f"(docs/assets/diagrams/{diagram.name}); redraw with python scripts/site/diagrams.py (npm); "
                        "the page shows the diagram's source meanwhile")
            return notebook_page.mermaid_source(number, source)
        src = get_relative_url(f"{diagrams.SITE_FOLDER}/{diagram.name}", page_url)
        labels = [" ".join(re.sub(r"<br\s*/?>", " ", label).split()) for label in DIAGRAM_LABEL.findall(source)]
        alt = html.escape("A diagram: " + "; ".join(label for label in labels if label), quote=True)
        return (f'<figure class="k2-diagram"><a href="{src}" title="the diagram at full size">'
                f'<img src="{src}" alt="{alt}"></a></figure>')

    return html_of


def _insert_after_title(markdown: str, text: str) -> str:
    m = re.search(r"^# .+\n", markdown, re.M)
    if not m:
        return text + markdown
    return markdown[: m.end()] + "\n" + text + markdown[m.end():]


def _link_for_docs(target: str) -> str:
    """A link target written for docs/ in the repository (to ../notebooks/, ../README.md), as seen on the site."""
    if target.startswith("../notebooks/"):
        inner = _link_for_course(target[len("../notebooks/"):])
        return "course/" + inner if not re.match(r"^[a-z][a-z0-9+.-]*:", inner, re.I) else inner
    if target == "../README.md":
        return "index.md"
    return target


def on_page_markdown(markdown: str, page, config, files):
    if not page.file.generated_by and "/" not in page.file.src_uri:  # docs/*.md, written for the repository
        markdown = notebook_page.LINK.sub(lambda m: m.group(1) + _link_for_docs(m.group(2)) + m.group(3), markdown)
    if page.file.src_uri in ("start.md", "index.md"):
        sections = _readme_sections()

        def section(m: re.Match) -> str:
            title = m.group(1).strip()
            if title not in sections:
                log.warning(f"{page.file.src_uri} asks for README's section {title!r}, which README.md does not have")
                return ""
            return sections[title]

        markdown = re.sub(r"<!--\s*readme:\s*(.+?)\s*-->", section, markdown)
    return markdown


def on_page_content(html: str, page, config, files):
    rendered = STATE.pages.get(page.file.src_uri)
    if rendered is None:
        return html
    html = notebook_page.unstash(html, rendered.stash)
    left = notebook_page.STASH_WORD.findall(html)
    if left:
        raise PluginError(f"{page.file.src_uri}: placeholders left in the page: {left[:5]}")
    scripts = []
    if rendered.plots:
        scripts.append(f"{ASSETS}/plotly.min.js")
    scripts.append(f"{ASSETS}/notebook.js")
    tags = "".join(f'<script src="{get_relative_url(s, page.url)}"></script>' for s in scripts)
    return html + tags


def on_post_build(config):
    site = Path(config["site_dir"])
    problems = []
    for path in sorted(site.rglob("*")):
        if path.suffix not in (".html", ".css") or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for url in external_requests(text, css=path.suffix == ".css"):
            problems.append(f"{path.relative_to(site)} asks for something off this machine: {url}")
    for uri, rendered in STATE.pages.items():
        html_path = site / uri.replace(".md", "") / "index.html"
        if not config["use_directory_urls"]:
            html_path = site / uri.replace(".md", ".html")
        drawn = html_path.read_text().count('class="k2-plotly"')
        if drawn != rendered.plots or rendered.plots < rendered.stored_plots:
            problems.append(f"{uri}: {drawn} plotly figures on the page, {rendered.plots} rendered, "
                            f"{rendered.stored_plots} stored in the notebook's cells")
    for name, uri in STATE.api.anchors.items():
        html_path = site / uri.replace(".md", "") / "index.html"
        if f'id="{name}"' not in html_path.read_text():
            problems.append(f"{uri}: no anchor for the public name {name}")
    if problems:
        raise PluginError("the built site fails its checks:\n  " + "\n  ".join(problems))
    total = sum(p.plots for p in STATE.pages.values())
    log.info(f"k2lab site: {len(STATE.pages)} notebook pages, {total} plotly figures, {STATE.api.modules} API "
             f"modules, {len(STATE.api.anchors)} API anchors checked, no request off this machine")
