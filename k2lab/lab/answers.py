"""Answers kept folded in a cell's output. A "predict, then run" solution prints its answer inside
``with lab.folded():``, so that running the cell (JupyterLab shows a solution cell's output once it runs) shows
a closed "The answer" fold, not the answer itself."""

from __future__ import annotations

import contextlib
import html
import io
from collections.abc import Iterator


@contextlib.contextmanager
def folded(summary: str = "The answer (click to show)") -> Iterator[None]:
    """Everything printed inside the block goes into one closed fold of the cell's output (``<details>``), under
    ``summary``; outside a notebook it is printed as it is, after the summary."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        yield
    text = buffer.getvalue()
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display
    except ImportError:
        get_ipython = None  # noqa: N806
    if get_ipython is None or get_ipython() is None:
        print(f"{summary}\n{text}", end="")
        return
    display(HTML(f"<details><summary>{html.escape(summary)}</summary><pre>{html.escape(text)}</pre></details>"))
