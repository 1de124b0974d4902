"""scripts/site/api_pages.py: the API reference covers every public module and name, documents each once, where it is
first made public, and names every public module, class, function, method and property that has no docstring (which
fails ``mkdocs build --strict``). Needs griffe (``pip install -e ".[docs]"``); skips without it."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("griffe", reason='griffe comes with the docs extra: pip install -e ".[docs]"')

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "site"))
import api_pages  # noqa: E402


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "toy" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    return root


TOY = {
    "__init__.py": '''
        """A toy package."""
        from .core import Engine, run
        from . import extra
        __all__ = ["Engine", "extra", "run", "VERSION"]
        VERSION = "1"
    ''',
    "core.py": '''
        """The engine."""
        import os
        from pathlib import Path

        LIMIT = 3

        class Engine:
            """Runs things."""

            def start(self) -> None:
                """Start it."""

            def stop(self) -> None:
                pass

            @property
            def speed(self) -> int:
                return 1

            def _hidden(self) -> None:
                pass

            def __len__(self) -> int:
                return 0

        def run() -> None:
            """Run once."""

        def helper() -> None:
            pass
    ''',
    "extra/__init__.py": '''
        """Extras."""
    ''',
    "extra/tools.py": '''
        def tool() -> None:
            """A tool."""
    ''',
    "_private.py": '''
        def secret() -> None:
            pass
    ''',
    "__main__.py": '''
        def main() -> None:
            pass
    ''',
}


def test_every_undocumented_public_name_is_named_with_its_file_and_line(tmp_path):
    ref = api_pages.build(_package(tmp_path, TOY), "toy")
    assert ref.undocumented == [
        "toy/__init__.py:5: the constant (in toy.__all__) toy.VERSION has no docstring",
        "toy/core.py:13: the method toy.core.Engine.stop has no docstring",
        "toy/core.py:17: the property toy.core.Engine.speed has no docstring",
        "toy/core.py:29: the function toy.core.helper has no docstring",
        "toy/extra/tools.py:1: the module toy.extra.tools has no docstring",
    ]  # not: _hidden, __len__, the private module, __main__, os and Path (imported), LIMIT (a constant nobody exports)


def test_pages_for_every_public_module_and_each_name_documented_where_first_made_public(tmp_path):
    ref = api_pages.build(_package(tmp_path, TOY), "toy")
    assert set(ref.pages) == {"api/index.md", "api/toy.md", "api/toy.Engine.md", "api/toy.core.md",
                              "api/toy.extra.md", "api/toy.extra.tools.md"}
    # Engine and run are public in toy (its __all__) and in toy.core (defined there): documented as toy.*
    assert ref.anchors == {"toy.Engine": "api/toy.Engine.md", "toy.run": "api/toy.md",
                           "toy.core.helper": "api/toy.core.md", "toy.extra.tools.tool": "api/toy.extra.tools.md"}
    assert "::: toy.run" in ref.pages["api/toy.md"] and "::: toy.Engine" in ref.pages["api/toy.Engine.md"]
    core = ref.pages["api/toy.core.md"]
    assert "[`toy.Engine`](toy.Engine.md)" in core and "[`toy.run`](toy.md#toy.run)" in core
    assert "::: toy.core.helper" in core and "LIMIT" not in core  # an undocumented constant stays hidden
    assert "[`toy.extra.tools`](toy.extra.tools.md)" in ref.pages["api/toy.extra.md"]


def test_k2lab_has_a_docstring_on_every_public_name_and_its_main_names_where_users_import_them():
    ref = api_pages.build(REPO)
    assert ref.undocumented == []
    for name, page in [("k2lab.K2Model", "api/k2lab.K2Model.md"), ("k2lab.generate", "api/k2lab.md"),
                       ("k2lab.model.MultiHeadLatentAttention", "api/k2lab.model.MultiHeadLatentAttention.md"),
                       ("k2lab.model.Router", "api/k2lab.model.Router.md"), ("k2lab.model.HookPoint",
                       "api/k2lab.model.HookPoint.md"), ("k2lab.distributed.PipelinedK2",
                       "api/k2lab.distributed.PipelinedK2.md"), ("k2lab.analysis.splicing.splice",
                       "api/k2lab.analysis.splicing.md")]:
        assert ref.anchors.get(name) == page, name
    for module in ("k2lab.model.speed.linear", "k2lab.weights.quant.fp8", "k2lab.tokenizer", "k2lab.viz",
                   "k2lab.training.optim", "k2lab.analysis.dictionary", "k2lab.lab.exercises", "k2lab.hf_config"):
        assert f"api/{module}.md" in ref.pages, module


def test_a_public_name_imported_from_outside_the_package_is_refused_by_name(tmp_path):
    files = {"__init__.py": '"""Toy."""\nfrom pathlib import Path\n__all__ = ["Path"]\n'}
    with pytest.raises(ValueError, match=r"toy makes 'Path' public, imported from pathlib.Path, outside the package"):
        api_pages.build(_package(tmp_path, files), "toy")
