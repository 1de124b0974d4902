"""Build the lab's notebooks from their sources: notebooks/src/NN_name.py (jupytext "percent" format) ->
notebooks/NN_name.ipynb, executed with the bundled K2-nano so the committed notebooks carry their outputs.

    python scripts/build_notebooks.py              # all of them
    python scripts/build_notebooks.py 03 05        # those whose names start with 03 or 05
    python scripts/build_notebooks.py --check      # fail if a .ipynb's cells differ from its source (no execution)

Source format: a line ``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell whose lines are written as
``# text``; ``# %% tags=["nbval-ignore-output"]`` gives a cell tags. Exercises keep their answers folded, one click
away: a code cell tagged ``solution`` is stored with its source and its outputs collapsed (``jupyter.source_hidden``,
``outputs_hidden``, and the ``collapsed`` flag JupyterLab adds beside them; still run by nbval), its first line the
mark ``# Solution (click to show)`` (written in when the source does not start with it: the folded cell shows that
line, and ``k2lab.lab.solutions`` folds what the cell prints when it runs); a markdown cell tagged ``solution`` or
``hint`` is wrapped in ``<details>`` under a "Solution" or "Hint" summary (its first line, when that is a
``**bold**`` title, becomes the summary instead). The notebook's kernelspec is the one JupyterLab writes (its display
name "Python 3 (ipykernel)"), so that a notebook opens unmodified.
K2LAB_* variables are cleared for the build, so the stored outputs are K2-nano's, unless ``--keep-env`` (to build
with another model's outputs). Kernels run with OMP_NUM_THREADS=1 unless it is set, and with this checkout first on
PYTHONPATH; run nbval the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import nbformat

from k2lab.lab.solutions import SOLUTION_MARK, is_solution

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
# ipykernel's kernelspec as JupyterLab writes it into a notebook when the kernel starts
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
_HEADER = re.compile(r"# %%(?P<markdown> \[markdown\])?(?: tags=(?P<tags>\[.*\]))?\s*$")


def parse(source: str) -> nbformat.NotebookNode:
    """Cells of a percent-format source, as an unexecuted notebook."""
    cells, kind, tags, lines = [], None, [], []

    def close() -> None:
        text = "\n".join(lines).strip("\n")
        if kind == "markdown":
            text = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in text.splitlines())
            folded = [tag for tag in ("solution", "hint") if tag in tags]
            if folded:
                text = fold(text, folded[0].capitalize())
            cells.append(nbformat.v4.new_markdown_cell(text, metadata={"tags": tags} if tags else {}))
        elif kind == "code":
            metadata = {"tags": tags} if tags else {}
            if "solution" in tags:
                # JupyterLab writes collapsed beside outputs_hidden when it opens the notebook: written here, the
                # notebook opens unmodified
                metadata |= {"collapsed": True, "jupyter": {"source_hidden": True, "outputs_hidden": True}}
                text = text if is_solution(text) else f"{SOLUTION_MARK}\n{text}"
            cells.append(nbformat.v4.new_code_cell(text, metadata=metadata))

    for line in source.splitlines():
        header = _HEADER.match(line)
        if header:
            close()
            kind = "markdown" if header["markdown"] else "code"
            tags, lines = json.loads(header["tags"]) if header["tags"] else [], []
        else:
            lines.append(line)
    close()
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def fold(text: str, summary: str) -> str:
    """Markdown ``text`` inside ``<details>``: closed until the learner opens it. A first line ``**Title**`` is the
    summary; else ``summary``."""
    first, _, rest = text.partition("\n")
    title = re.fullmatch(r"\*\*(.+)\*\*", first.strip())
    if title:
        summary, text = title.group(1), rest.strip("\n")
    return f"<details><summary>{summary}</summary>\n\n{text}\n\n</details>"


def build(src: Path, timeout: int = 300) -> float:
    """Parse, execute in notebooks/ and write ``notebooks/<name>.ipynb``; returns the seconds it took."""
    from nbclient import NotebookClient  # only for building; --check runs no kernel

    nb = parse(src.read_text())
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    for i, cell in enumerate(nb.cells):  # ids are random per build; stable ones keep the diffs to what changed
        cell.id = f"{src.stem[:2]}-{i:03d}"
    nbformat.write(nb, NOTEBOOKS / f"{src.stem}.ipynb")
    return time.perf_counter() - start


def stale(src: Path) -> bool:
    """Whether the committed notebook differs from what ``src`` says: its cells (kinds, sources, tags, the folds'
    metadata) or its kernelspec."""
    target = NOTEBOOKS / f"{src.stem}.ipynb"
    if not target.is_file():
        return True

    def key(nb: nbformat.NotebookNode) -> list:
        cells = [(c.cell_type, c.source, c.metadata.get("tags", []), c.metadata.get("collapsed"),
                  c.metadata.get("jupyter")) for c in nb.cells]
        return [nb.metadata.get("kernelspec"), *cells]

    return key(nbformat.read(target, as_version=4)) != key(parse(src.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("prefixes", nargs="*", help="build only notebooks whose names start with these")
    parser.add_argument("--check", action="store_true", help="only check that the notebooks match their sources")
    parser.add_argument("--keep-env", action="store_true", help="keep K2LAB_* variables (default: K2-nano)")
    args = parser.parse_args()
    sources = sorted(p for p in (NOTEBOOKS / "src").glob("*.py") if not args.prefixes or p.stem.startswith(
        tuple(args.prefixes)))
    if args.check:
        out_of_date = [p.stem for p in sources if stale(p)]
        if out_of_date:
            sys.exit(f"notebooks out of date with notebooks/src: {out_of_date}; run python scripts/build_notebooks.py")
        print(f"{len(sources)} notebooks match their sources")
        return
    for name in [k for k in os.environ if k.startswith("K2LAB_") and not args.keep_env]:
        del os.environ[name]
    # The learner's module of this build: a fresh file, so that no mine.py of a developer's own (notebooks/mine.py)
    # reaches the stored outputs; the notebooks of one build share it, as a learner's do.
    os.environ.setdefault("K2LAB_MINE", str(Path(tempfile.mkdtemp(prefix="k2lab-build-")) / "mine.py"))
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Kernels inherit this environment: put this checkout first, so the notebooks import the k2lab beside them
    # (not another installed copy) and the stored outputs are this tree's.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    # One thread: a float sum then rounds the same on every machine, so nbval's re-run reproduces the checked
    # outputs; the nano model gains little from more (and loses much on a busy machine).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    total = 0.0
    for src in sources:
        seconds = build(src)
        total += seconds
        print(f"{src.stem + '.ipynb':<28} {seconds:6.1f} s", flush=True)
    print(f"{'all':<28} {total:6.1f} s")


if __name__ == "__main__":
    main()
