"""Solution cells in a running notebook: their output stays folded, and the learner's own answers stay theirs.

A solution cell is a code cell whose first line is ``SOLUTION_MARK`` (``scripts/build_notebooks.py`` writes it at
the top of every cell tagged ``solution``). JupyterLab shows a hidden cell's output again as soon as the cell runs
(Run All, or stepping on with Shift+Enter), and no cell metadata keeps it hidden; so what a solution prints is
caught while it runs and shown inside a fold of its own, closed until the learner opens it.

A solution also defines the exercise's function under the learner's name (``my_mla``), which would replace the
learner's own answer for every cell below. After a solution cell, each function the learner had written before it
under a name the solution redefined is put back, and the solution's is kept as ``solution_<name>``; where the
learner's was still the stub (its body only ``raise NotImplementedError``), the solution's stays, so that the rest of
the notebook runs. The fold's title says which of the two each name now is.

    from k2lab.lab import solutions
    solutions.install()        # lab.setup_notebook() does this
"""

from __future__ import annotations

import ast
import html
import inspect
import re
import textwrap
import types
from typing import Any

SOLUTION_MARK = "# Solution (click to show)"

_ANSI_COLOURS = {"31": "#cf222e", "32": "#1a7f37"}  # red and green, as the verdicts print them
_ANSI = re.compile(r"\x1b\[([0-9;]*)m")


def is_solution(source: str) -> bool:
    """Whether a cell's source is a solution cell's: its first line is the solution mark."""
    return source.lstrip().startswith(SOLUTION_MARK)


def is_stub(fn: Any) -> bool:
    """Whether ``fn`` is an exercise's unwritten stub: a function whose body, apart from its docstring, is only
    ``raise NotImplementedError`` (False when its source cannot be read)."""
    if not isinstance(fn, types.FunctionType):
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef) else []
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    raised = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(raised, ast.Name) and raised.id == "NotImplementedError"


def _ansi_to_html(text: str) -> str:
    """Escaped text with the verdicts' ANSI colours as coloured spans (other ANSI codes dropped)."""
    out, open_span = [], False
    for i, piece in enumerate(_ANSI.split(text)):
        if i % 2 == 0:
            out.append(html.escape(piece))
            continue
        if open_span:
            out.append("</span>")
            open_span = False
        colour = _ANSI_COLOURS.get(piece)
        if colour:
            out.append(f'<span style="color:{colour};font-weight:bold">')
            open_span = True
    return "".join(out) + ("</span>" if open_span else "")


def _user_functions(namespace: dict[str, Any]) -> dict[str, types.FunctionType]:
    """The functions defined in the notebook itself (not imported), by name."""
    return {name: value for name, value in namespace.items()
            if isinstance(value, types.FunctionType) and value.__module__ == "__main__" and not name.startswith("_")}


class SolutionCells:
    """The IPython event handlers: ``pre_run_cell`` starts catching a solution cell's output, ``post_run_cell``
    puts the learner's answers back and shows the output in a fold."""

    def __init__(self, shell: Any):
        self.shell = shell
        self.capture: Any = None
        self.before: dict[str, types.FunctionType] = {}

    def pre_run_cell(self, info: Any) -> None:
        """IPython's event before a cell runs: a solution cell's output starts being captured, and the learner's
        functions are noted."""
        if not is_solution(getattr(info, "raw_cell", "") or ""):
            return
        from IPython.utils.capture import capture_output

        self.before = _user_functions(self.shell.user_ns)
        self.capture = capture_output(stdout=True, stderr=True, display=True)
        self.captured = self.capture.__enter__()

    def post_run_cell(self, result: Any) -> None:
        """IPython's event after a cell ran: a solution cell's output is shown in a closed fold, and any learner's
        function the solution replaced is put back (the solution's kept as ``solution_<name>``)."""
        if self.capture is None:
            return
        capture, self.capture = self.capture, None
        capture.__exit__(None, None, None)
        kept, used = self._keep_answers()
        self._show(self.captured, kept, used)

    def _keep_answers(self) -> tuple[list[str], list[str]]:
        """Put back each learner's function the solution redefined -> (names kept as the learner's, names now the
        solution's because the learner's was a stub)."""
        kept, used = [], []
        namespace = self.shell.user_ns
        for name, theirs in self.before.items():
            now = namespace.get(name)
            if now is theirs or not isinstance(now, types.FunctionType):
                continue
            if is_stub(theirs):
                used.append(name)
            else:
                namespace[f"solution_{name}"] = now
                namespace[name] = theirs
                kept.append(name)
        return kept, used

    def _show(self, captured: Any, kept: list[str], used: list[str]) -> None:
        from IPython.display import display

        text = captured.stdout + captured.stderr
        notes = [f"your own {name} is kept; the solution's is solution_{name}" for name in kept]
        notes += [f"your {name} was not written yet, so the solution's {name} is used from here on" for name in used]
        title = "Solution's output (click to show)" + (": " + "; ".join(notes) if notes else "")
        if text.strip():
            body = (f'<details class="k2lab-solution-output"><summary>{html.escape(title)}</summary>'
                    f'<pre style="white-space:pre-wrap">{_ansi_to_html(text)}</pre></details>')
            display({"text/html": body, "text/plain": f"{title}\n{_ANSI.sub('', text)}"}, raw=True)
        elif notes:
            display({"text/html": f"<p>{html.escape('; '.join(notes).capitalize())}</p>",
                     "text/plain": "; ".join(notes)}, raw=True)
        for output in captured.outputs:  # figures and other rich outputs: shown as they came
            display(output)


_INSTALLED: dict[int, SolutionCells] = {}


def install(shell: Any = None) -> bool:
    """Register the solution cells' handlers with the running IPython (once per shell); False outside IPython."""
    if shell is None:
        try:
            from IPython import get_ipython
        except ImportError:
            return False
        shell = get_ipython()
    if shell is None or id(shell) in _INSTALLED:
        return shell is not None
    handlers = _INSTALLED[id(shell)] = SolutionCells(shell)
    shell.events.register("pre_run_cell", handlers.pre_run_cell)
    shell.events.register("post_run_cell", handlers.post_run_cell)
    return True
