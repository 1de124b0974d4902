"""The learner's own module (k2lab.lab.learner): @lab.mine checks an exercise's function and keeps it in mine.py
with what it needs to run on its own; lab.mine.load() gives the learner's pieces where they passed and k2lab's
references elsewhere, says which, and re-checks a block edited by hand. Learners' notebooks are stood in for by
modules written to a temporary folder (inspect.getsource reads functions from files, as it reads a notebook's
cells through IPython)."""

from __future__ import annotations

import importlib
import sys
import textwrap
import uuid

import pytest
import torch

from k2lab.lab import learner
from k2lab.lab.learner import Mine, is_stub, module_source, read_blocks
from k2lab.lab.pieces import PIECES


@pytest.fixture
def mine(tmp_path, monkeypatch):
    monkeypatch.setenv("K2LAB_MINE", str(tmp_path / "mine.py"))
    return Mine()


@pytest.fixture
def notebook(tmp_path, monkeypatch):
    """Write a learner's cell as a module and import it: returns its namespace."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def cell(source: str):
        name = f"cell_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        module = importlib.import_module(name)
        return module

    yield cell
    for name in [n for n in sys.modules if n.startswith("cell_")]:
        del sys.modules[name]


RIGHT_NORM = """
    import torch

    EPS_FLOOR = 0.0


    def mean_square(x):
        return x.pow(2).mean(-1, keepdim=True) + EPS_FLOOR


    def my_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return weight * x / torch.sqrt(mean_square(x) + eps)
"""


def test_a_stub_is_never_recorded(mine, notebook, capsys):
    cell = notebook('''
        def my_rms_norm(x, weight, eps):
            """doc"""
            raise NotImplementedError
    ''')
    assert is_stub(cell.my_rms_norm)
    assert mine(cell.my_rms_norm) is cell.my_rms_norm
    assert "not written yet" in capsys.readouterr().out
    assert not mine.path.exists()


def test_a_passing_answer_is_kept_with_its_helpers_and_constants_and_loaded_as_the_learners(mine, notebook, capsys):
    cell = notebook(RIGHT_NORM)
    mine(cell.my_rms_norm)
    out = capsys.readouterr().out
    assert "✓" in out and "kept in" in out
    (block,) = read_blocks(mine.path)
    assert block.passed and block.check == "check_rms_norm" and not block.edited
    assert "import torch" in block.body and "EPS_FLOOR = 0.0" in block.body and "def mean_square" in block.body
    assert "@" not in block.body  # the decorator is not recorded: importing the file records nothing
    module = mine.load("my_rms_norm")
    assert "yours" in capsys.readouterr().out
    assert mine.yours(module, "my_rms_norm")
    x = torch.randn(3, 8)
    assert torch.allclose(module.my_rms_norm(x, torch.ones(8), 1e-6), cell.my_rms_norm(x, torch.ones(8), 1e-6))


def test_a_failing_answer_is_kept_but_the_reference_stands_in(mine, notebook, capsys):
    cell = notebook("""
        import torch


        def my_rms_norm(x, weight, eps):
            return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True))  # eps forgotten
    """)
    mine(cell.my_rms_norm)
    out = capsys.readouterr().out
    assert "✗" in out and "the notebooks after this one use k2lab's reference" in out
    module = mine.load("my_rms_norm")
    report = capsys.readouterr().out
    assert "the reference" in report and "yours fails check_rms_norm" in report
    assert not mine.yours(module, "my_rms_norm")
    assert module.my_rms_norm is module.__references__["my_rms_norm"]


def test_running_a_cell_again_replaces_its_block_and_a_stub_keeps_the_earlier_answer(mine, notebook, capsys):
    mine(notebook(RIGHT_NORM).my_rms_norm)
    mine(notebook(RIGHT_NORM.replace("+ eps)", "+ eps)  # again")).my_rms_norm)
    assert len(read_blocks(mine.path)) == 1 and "# again" in read_blocks(mine.path)[0].body
    capsys.readouterr()
    mine(notebook("""
        def my_rms_norm(x, weight, eps):
            raise NotImplementedError()
    """).my_rms_norm)
    assert "keeps your earlier my_rms_norm" in capsys.readouterr().out
    assert "# again" in read_blocks(mine.path)[0].body


def test_a_block_edited_by_hand_is_checked_again(mine, notebook, capsys):
    mine(notebook(RIGHT_NORM).my_rms_norm)
    text = mine.path.read_text().replace("+ eps)", ")")  # the learner breaks it in the file
    mine.path.write_text(text)
    module = mine.load("my_rms_norm")
    assert "edited in mine.py and fails" in capsys.readouterr().out
    assert not mine.yours(module, "my_rms_norm")


def test_a_block_that_does_not_run_falls_back_with_the_reason(mine, notebook, capsys):
    mine(notebook(RIGHT_NORM).my_rms_norm)
    mine.path.write_text(mine.path.read_text().replace("def mean_square(x):", "def mean_square(x)"))
    module = mine.load("my_rms_norm")
    assert "does not run: SyntaxError" in capsys.readouterr().out
    assert not mine.yours(module, "my_rms_norm")


def test_a_notebook_variable_that_cannot_be_kept_is_refused_by_name(mine, notebook, capsys):
    cell = notebook("""
        import torch

        WEIGHTS = {"g": torch.ones(8)}


        def my_rms_norm(x, weight, eps):
            return WEIGHTS["g"] * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    """)
    with pytest.raises(learner.RecordingError, match="`WEIGHTS` \\(a dict\\)"):
        module_source(cell.my_rms_norm)
    mine(cell.my_rms_norm)
    assert "not kept in mine.py" in capsys.readouterr().out
    assert not mine.path.exists()


def test_only_the_courses_exercises_are_recorded(mine, notebook):
    with pytest.raises(ValueError, match="my_norm.*is none of them"):
        mine(notebook("def my_norm(x):\n    return x\n").my_norm)
    with pytest.raises(TypeError, match="decorates an exercise's function"):
        mine(print)
    with pytest.raises(ValueError, match="no exercise of the course is called"):
        mine.load("my_norm")


def test_a_piece_that_calls_another_resolves_it_in_the_module(mine, notebook, capsys):
    """09's model calls the pieces of the module it was written beside: inside mine.py they resolve to the chosen
    piece (the learner's where it passed, the reference elsewhere), not to a copy."""
    mine(notebook(RIGHT_NORM).my_rms_norm)
    module = mine.load(quiet=True)
    assert PIECES["my_k2"].where.startswith("09")
    cell = notebook("""
        import torch

        from k2lab.lab.learner import mine as lab_mine

        mine = lab_mine.load(quiet=True)


        def my_logit_lens(resid, norm, head):
            return head(mine.my_rms_norm(resid, norm.weight, norm.eps)).float()
    """)
    mine(cell.my_logit_lens)
    assert "import" not in read_blocks(mine.path)[1].body  # `mine` is bound by the loader, not imported
    module = mine.load("my_logit_lens")
    assert mine.yours(module, "my_logit_lens")
    namespace = module.__namespaces__["my_logit_lens"]
    assert namespace["mine"] is module and module.my_rms_norm is namespace["mine"].my_rms_norm


def test_load_without_a_file_gives_every_reference(mine):
    module = mine.load(quiet=True)
    assert set(PIECES) <= set(vars(module))
    assert not any(mine.yours(module, name) for name in PIECES)


def test_observe_records_what_qk_clip_and_the_bias_step_need_and_restores(mine):
    module = mine.load(quiet=True)
    mla, router = module.my_mla, module.my_router
    from k2lab.lab.exercises import small_k2

    model = small_k2()
    state = {n: t.detach() for n, t in model.state_dict().items()}
    ids = torch.tensor([[5, 17, 2, 88, 41, 9]])
    with mine.observe(module) as seen:
        logits = module.my_k2(state, model.config, ids)
    assert module.my_mla is mla and module.my_router is router
    assert len(seen.max_logits) == model.config.num_hidden_layers
    moe = [i for i in range(model.config.num_hidden_layers) if model.config.is_moe_layer(i)]
    assert len(seen.counts) == len(moe) and all(int(c.sum()) == ids.numel() * model.config.num_experts_per_tok
                                                for c in seen.counts)
    _, cache = model.run_with_cache(ids, names="hook_max_logit")
    assert torch.allclose(torch.stack(seen.max_logits), cache.stack("hook_max_logit").amax(1), atol=1e-5)
    assert torch.allclose(logits, model(ids), atol=1e-5)


def test_the_module_lives_where_k2lab_mine_says_else_in_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("K2LAB_MINE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert Mine().path == tmp_path / "mine.py"
    monkeypatch.setenv("K2LAB_MINE", str(tmp_path / "elsewhere" / "own.py"))
    assert Mine().path == tmp_path / "elsewhere" / "own.py"


@pytest.mark.parametrize("name", sorted(PIECES))
def test_every_reference_passes_its_exercises_check(mine, name):
    """What stands in for a skipped piece is right by the piece's own checker (which does not hold against a reference
    that it calls k2lab's own implementation, what it is made of)."""
    from k2lab.lab.exercises.checking import judging_references

    module = mine.load(quiet=True)
    with judging_references():
        verdict = PIECES[name].check(getattr(module, name))
    assert verdict.ok, verdict.message
