"""Solution cells in a running IPython (k2lab.lab.solutions), the notebook build that marks them
(scripts/build_notebooks.py), and the explorers' display (k2lab.viz.widgets): a solution's output stays in a fold of
its own, the learner's own answer stays theirs (the solution's is kept beside it), a stub gives way to the solution,
and an explorer's view keeps one id across runs of its cell and says "run the cell to explore" where it cannot be
drawn."""

from __future__ import annotations

import importlib.util
from html import unescape
from pathlib import Path

import pytest

from k2lab.lab import solutions

IPython = pytest.importorskip("IPython")
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from IPython.utils.capture import capture_output  # noqa: E402

MARK = solutions.SOLUTION_MARK


@pytest.fixture
def shell():
    """A fresh IPython shell with the solution cells' handlers (the one IPython keeps per process, cleared)."""
    ip = InteractiveShell.instance()
    ip.reset(new_session=False)
    solutions.install(ip)
    yield ip
    ip.reset(new_session=False)


def run(shell, source: str):
    """Run a cell; (what it printed, what it displayed as rich outputs)."""
    with capture_output(display=True) as captured:
        result = shell.run_cell(source)
    assert result.success, result.error_in_exec
    return captured.stdout, captured.outputs


STUB = 'def my_double(x):\n    """x -> 2 x"""\n    raise NotImplementedError\n\n\nprint("check:", my_double.__name__)'
SOLUTION = f'{MARK}\ndef my_double(x):\n    return 2 * x\n\n\nprint("\\x1b[32m✓\\x1b[0m the answer is 2 x")'


def test_a_solution_after_a_stub_is_used_and_its_output_folded(shell):
    run(shell, STUB)
    printed, outputs = run(shell, SOLUTION)
    assert printed == ""  # nothing in plain view
    html = unescape(outputs[0].data["text/html"])
    assert html.startswith('<details class="k2lab-solution-output"><summary>') and "<details open" not in html
    assert "your my_double was not written yet, so the solution's my_double is used from here on" in html
    assert '<span style="color:#1a7f37;font-weight:bold">✓</span> the answer is 2 x' in html  # ANSI as colour
    assert shell.user_ns["my_double"](3) == 6


def test_a_learners_own_answer_is_kept_and_the_solution_kept_beside_it(shell):
    run(shell, "def my_double(x):\n    return x + x + 1  # the learner's, wrong")
    _, outputs = run(shell, SOLUTION)
    assert shell.user_ns["my_double"](3) == 7 and shell.user_ns["solution_my_double"](3) == 6
    assert "your own my_double is kept; the solution's is solution_my_double" in unescape(outputs[0].data["text/html"])


def test_other_cells_are_left_alone(shell):
    printed, outputs = run(shell, "def my_double(x):\n    return 2 * x\n\nprint('visible')")
    assert printed == "visible\n" and not outputs
    printed, _ = run(shell, "# Solution, not the mark\nprint('visible too')")
    assert printed == "visible too\n"


def test_a_failing_solution_still_shows_its_error_and_restores_output(shell):
    with capture_output(display=True):
        result = shell.run_cell(f"{MARK}\nprint('before')\n1 / 0")
    assert not result.success and isinstance(result.error_in_exec, ZeroDivisionError)
    printed, _ = run(shell, "print('after')")
    assert printed == "after\n"  # the capture ended with the failed cell


@pytest.mark.parametrize(("source", "stub"), [
    ("def f(x):\n    raise NotImplementedError\n", True),
    ('def f(x):\n    """doc"""\n    raise NotImplementedError("write me")\n', True),
    ("def f(x):\n    return x\n", False),
    ("def f(x):\n    if x:\n        raise NotImplementedError\n    return x\n", False),
])
def test_is_stub(shell, source, stub):
    shell.run_cell(source)
    assert solutions.is_stub(shell.user_ns["f"]) is stub


# --- the build marks every solution cell and writes what JupyterLab would add --------------------------------------


def build_script():
    path = Path(__file__).resolve().parents[2] / "scripts" / "build_notebooks.py"
    spec = importlib.util.spec_from_file_location("build_notebooks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_build_marks_solutions_and_writes_jupyterlabs_metadata():
    build = build_script()
    nb = build.parse('# %%\nx = 1\n\n# %% tags=["solution"]\nprint(x)\n\n'
                     f'# %% tags=["solution"]\n{MARK}\nprint(2)\n')
    plain, marked, already = nb.cells
    assert plain.source == "x = 1" and "collapsed" not in plain.metadata
    assert marked.source == f"{MARK}\nprint(x)" and already.source == f"{MARK}\nprint(2)"  # marked once
    assert marked.metadata["collapsed"] is True
    assert marked.metadata["jupyter"] == {"source_hidden": True, "outputs_hidden": True}
    assert nb.metadata["kernelspec"]["display_name"] == "Python 3 (ipykernel)"


# --- the explorers' display -----------------------------------------------------------------------------------------


def test_an_explorer_keeps_its_view_id_across_runs_of_its_cell(shell):
    cell = ("import ipywidgets\nfrom k2lab.viz import widgets as w\n"
            "explorer = w.Explorer({'n': ipywidgets.IntSlider(value=1)}, lambda n: f'<b>{n}</b>')\n"
            "bundle = explorer.widget._repr_mimebundle_()")
    shell.run_cell(cell, store_history=True)
    first = shell.user_ns["explorer"]
    first_id = first.widget.model_id
    shell.run_cell(cell, store_history=True)
    second = shell.user_ns["explorer"]
    view = "application/vnd.jupyter.widget-view+json"
    assert shell.user_ns["bundle"][view]["model_id"] == first_id == second.widget.model_id
    assert first_id.startswith("k2lab-explorer-")
    assert first.widget.comm is None and second.widget.comm is not None  # the first closed, the second live
    two = cell + "\nother = w.Explorer({'n': ipywidgets.IntSlider()}, lambda n: '')"
    shell.run_cell(two, store_history=True)
    assert shell.user_ns["other"].widget.model_id != shell.user_ns["explorer"].widget.model_id  # a second in one cell


def test_an_explorer_says_run_the_cell_where_it_cannot_be_drawn(shell):
    from k2lab.viz.widgets import RUN_TO_EXPLORE

    shell.run_cell("import ipywidgets\nfrom k2lab.viz import widgets as w\n"
                   "explorer = w.Explorer({'n': ipywidgets.IntSlider()}, lambda n: '')")
    with capture_output(display=True) as captured:
        shell.user_ns["explorer"]._ipython_display_()
    data = captured.outputs[0].data
    assert data["text/plain"] == RUN_TO_EXPLORE and RUN_TO_EXPLORE in data["text/html"]
    assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == shell.user_ns["explorer"].widget.model_id
