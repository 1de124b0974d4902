"""The notebooks' Mermaid diagrams as committed SVG files: the site shows pictures, and its build fetches nothing.

JupyterLab (4.1 and later) draws a Markdown cell's Mermaid block itself; a static site would need Mermaid's
JavaScript. So each block is rendered once, here, into ``docs/assets/diagrams/<notebook>-<n>.svg`` (n counts the
notebook's Mermaid blocks from 1), and the site's notebook pages show that picture in place of the block
(``notebook_page.py``). Each SVG starts with a comment holding the SHA-256 of the source it was drawn from: the build
warns (which fails ``mkdocs build --strict``) when a diagram has no SVG or its source changed since, and names the
command that redraws them:

    python scripts/site/diagrams.py            # every diagram whose SVG is missing or stale (--all: every one)
    python scripts/site/diagrams.py --check    # say which are missing or stale; exit 1 if any

Drawing needs npm (it runs Mermaid's CLI, pinned below, from the npm registry) and a Chromium (``K2LAB_CHROMIUM``,
else /usr/bin/chromium); puppeteer's own browser download is skipped. The build itself needs neither.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import notebook_page  # noqa: E402  (this folder; also run as a script)

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
OUT = REPO / "docs" / "assets" / "diagrams"
SITE_FOLDER = "assets/diagrams"  # where the SVGs are on the site
MERMAID_CLI = "@mermaid-js/mermaid-cli@11.17.0"  # the last line that runs on Node 20; Mermaid 11, as JupyterLab 4
# The classic look in the system's sans-serif (no web font embedded), labels as SVG text: the picture reads the same
# in an <img>, in any browser, offline. An edge's label hides the edge under it (Mermaid's half-opaque box lets the
# line cross the shape).
MERMAID_CONFIG = {"theme": "default", "look": "classic", "fontFamily": "Helvetica, Arial, sans-serif",
                  "htmlLabels": False, "flowchart": {"htmlLabels": False, "wrappingWidth": 320},
                  "themeCSS": ".edgeLabel rect { opacity: 1; fill: #f4f4f4; }"}
STAMP = re.compile(r"<!-- k2lab diagram: source sha256 ([0-9a-f]{64})")


@dataclass
class Diagram:
    """One Mermaid block of a notebook's Markdown cells, and its SVG."""

    notebook: str  # the notebook's stem: "00_tour"
    number: int  # 1 for the notebook's first Mermaid block
    source: str

    @property
    def name(self) -> str:
        return f"{self.notebook}-{self.number}.svg"

    @property
    def path(self) -> Path:
        return OUT / self.name

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.source.strip().encode()).hexdigest()

    def state(self) -> str:
        """"ok", "missing" or "stale" (the SVG was drawn from another source)."""
        if not self.path.is_file():
            return "missing"
        found = STAMP.search(self.path.read_text()[:300])
        return "ok" if found and found.group(1) == self.digest else "stale"


def blocks(markdown: str) -> list[str]:
    """The sources of the Mermaid blocks in a Markdown text, in order (the fences the notebook pages see)."""
    return [m.group("body") for m in notebook_page.FENCE.finditer(markdown) if notebook_page.is_mermaid(m)]


def notebook_diagrams(stem: str, nb: dict) -> list[Diagram]:
    """Every Mermaid block of notebook ``stem``'s Markdown cells (its JSON ``nb``), numbered from 1."""
    sources = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown":
            text = cell.get("source", "")
            sources += blocks("".join(text) if isinstance(text, list) else text)
    return [Diagram(stem, i, source) for i, source in enumerate(sources, 1)]


def all_diagrams() -> list[Diagram]:
    return [d for path in sorted(NOTEBOOKS.glob("*.ipynb"))
            for d in notebook_diagrams(path.stem, json.loads(path.read_text()))]


def sized(svg: str) -> str:
    """Mermaid's SVG with its own width and height (its viewBox's) in place of width="100%": as an <img> it then has a
    natural size, which the page's CSS scales down to the column."""
    box = re.search(r'viewBox="[-\d.]+ [-\d.]+ ([\d.]+) ([\d.]+)"', svg)
    if box is None:
        raise ValueError("Mermaid's SVG has no viewBox")
    width, height = (round(float(v), 1) for v in box.groups())
    head = re.compile(r'<svg ([^>]*?)width="100%"([^>]*?) style="max-width: [\d.]+px;')
    return head.sub(rf'<svg \1width="{width}" height="{height}"\2 style="', svg, count=1)


def draw(diagrams: list[Diagram]) -> None:
    """Render each diagram with Mermaid's CLI into its SVG, stamped with its source's digest."""
    npx = shutil.which("npx")
    if npx is None:
        sys.exit("diagrams.py: drawing needs npm's npx (apt-get install npm)")
    chromium = os.environ.get("K2LAB_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(chromium, os.X_OK):
        sys.exit(f"diagrams.py: no Chromium at {chromium} (apt-get install chromium, or set K2LAB_CHROMIUM)")
    OUT.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PUPPETEER_SKIP_DOWNLOAD": "true"}  # puppeteer's browser download: not needed, not reachable
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "puppeteer.json").write_text(json.dumps({
            "executablePath": chromium, "args": ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]}))
        (work / "mermaid.json").write_text(json.dumps(MERMAID_CONFIG))
        for diagram in diagrams:
            (work / "in.mmd").write_text(diagram.source)
            subprocess.run([npx, "--yes", "-p", MERMAID_CLI, "mmdc", "--quiet", "-p", str(work / "puppeteer.json"),
                            "-c", str(work / "mermaid.json"), "-b", "white", "-i", str(work / "in.mmd"),
                            "-o", str(work / "out.svg")], check=True, env=env, timeout=600)
            svg = sized((work / "out.svg").read_text())
            stamp = (f"<!-- k2lab diagram: source sha256 {diagram.digest}; the Mermaid block {diagram.number} of "
                     f"notebooks/{diagram.notebook}.ipynb, drawn by scripts/site/diagrams.py ({MERMAID_CLI}) -->\n")
            diagram.path.write_text(stamp + svg.rstrip() + "\n")
            print(f"drew {diagram.path.relative_to(REPO)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say which SVGs are missing or stale")
    parser.add_argument("--all", action="store_true", help="redraw every diagram, not only those missing or stale")
    args = parser.parse_args()
    diagrams = all_diagrams()
    todo = [d for d in diagrams if args.all or d.state() != "ok"]
    if args.check:
        for d in todo:
            print(f"{d.state()}: {d.path.relative_to(REPO)} (notebooks/{d.notebook}.ipynb, Mermaid block {d.number})")
        print(f"{len(diagrams) - len(todo)} of {len(diagrams)} diagrams drawn from their current source")
        sys.exit(1 if todo else 0)
    draw(todo)
    names = {d.name for d in diagrams}
    for old in sorted(OUT.glob("*.svg")):
        if old.name not in names:  # a diagram that no notebook has any more
            old.unlink()
            print(f"removed {old.relative_to(REPO)}")


if __name__ == "__main__":
    main()
