"""The import boundaries: data flows config -> model -> analysis -> viz and weights -> model, so the model package
imports no checkpoint, hub, tokenizer or figure library and nothing above it (not even the package root), the config
and its HF translation no checkpoint code, training nothing of the lab, ``import k2lab`` loads no figure library, and
``k2lab.viz`` brings plotly when it is asked for; and no module of k2lab imports, however indirectly, a module that
imports it back. The loading checks run in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FIGURES = ["plotly", "ipywidgets"]
CHECKPOINTS_AND_TEXT = ["safetensors", "huggingface_hub", "tokenizers"]


def _modules_after(code: str) -> set[str]:
    """The names in sys.modules after running ``code`` in a fresh interpreter."""
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return set(json.loads(done.stdout.splitlines()[-1]))


def _loaded(modules: set[str], roots: list[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in roots or any(m.startswith(r + ".") for r in roots))


def test_the_model_package_imports_no_checkpoint_tokenizer_figure_or_analysis_code():
    modules = _modules_after("import k2lab.model")
    assert "k2lab.model.transformer" in modules  # the check did import the model
    assert _loaded(modules, FIGURES + CHECKPOINTS_AND_TEXT) == []
    assert _loaded(modules, ["k2lab.analysis", "k2lab.weights", "k2lab.tokenizer", "k2lab.viz"]) == []


def test_import_k2lab_loads_no_figure_library_and_its_names_load_on_use():
    modules = _modules_after("import k2lab")
    assert _loaded(modules, FIGURES + ["k2lab.viz"]) == []
    modules = _modules_after("import k2lab\nk2lab.load_nano\nk2lab.routing.trace\nk2lab.count_parameters")
    assert "k2lab.weights.load" in modules and "k2lab.analysis.routing" in modules
    assert _loaded(modules, FIGURES + ["k2lab.viz"]) == []


def test_k2lab_viz_brings_plotly():
    modules = _modules_after("import k2lab.viz")
    assert "plotly" in modules and "k2lab.viz" in modules


def _imported_modules(path, root, run_only: bool = False) -> set[str]:
    """Every module an ``import`` statement in the file ``path`` names, wherever it stands (in a function, under
    TYPE_CHECKING), relative imports resolved against its package (``root``: the k2lab folder). ``from pkg import
    name`` names ``pkg.name`` where that is a module of k2lab. ``run_only``: leave out the imports under ``if
    TYPE_CHECKING:``, which never run."""
    import ast

    tree = ast.parse(Path(path).read_text())
    skipped = set()
    if run_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped |= {id(child) for child in ast.walk(node)}
    parts = path.relative_to(root.parent).with_suffix("").parts
    package = ".".join(parts if parts[-1] != "__init__" else parts[:-1])  # the package a relative import starts in
    package = package if parts[-1] == "__init__" else package.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            submodules = [f"{module}.{alias.name}" for alias in node.names
                          if _module_file(f"{module}.{alias.name}", root) is not None]
            names |= set(submodules) if len(submodules) == len(node.names) else {module, *submodules}
    return names


def _module_file(module: str, root: Path) -> Path | None:
    """The file of a k2lab module (a package's __init__.py), or None when ``module`` is not one."""
    if module != "k2lab" and not module.startswith("k2lab."):
        return None
    base = root.parent.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_no_back_doors_between_the_layers():
    """The model imports no analysis, weights, tokenizer or figure code, not even inside a function; the config no
    weights code; training no lab code."""
    from pathlib import Path

    import k2lab

    root = Path(k2lab.__file__).parent
    rules = [(root / "model", ["k2lab.analysis", "k2lab.weights", "k2lab.tokenizer", "k2lab.viz", "k2lab.lab",
                               "k2lab.training", "k2lab.distributed", "k2lab.hub"]),
             (root / "config.py", ["k2lab.weights"]), (root / "training", ["k2lab.lab"])]
    for place, forbidden in rules:
        for path in [place] if place.is_file() else sorted(place.rglob("*.py")):
            imported = _imported_modules(path, root)
            bad = sorted(m for m in imported if any(m == f or m.startswith(f + ".") for f in forbidden))
            assert bad == [], f"{path.relative_to(root)} imports {bad}"


def test_a_forward_a_probe_run_and_generate_load_no_code_beyond_the_model():
    modules = _modules_after(
        "import torch\nfrom k2lab.config import K2Config\nfrom k2lab.model import K2Model, generate\n"
        "model = K2Model(K2Config.nano())\nids = torch.tensor([[1, 2, 3, 4]])\nmodel(ids)\n"
        "model(ids, return_type='loss').backward()\nlogits, cache = model.run_with_cache(ids)\n"
        "cache.decompose_resid(); cache.logit_lens()\ngenerate(model, ids, 3)\n"
        "model(ids[:, :1], cache=model.new_cache(1))")
    assert "k2lab.model.activation_cache" in modules  # the check did run the probes
    assert _loaded(modules, ["k2lab.analysis", "k2lab.weights", "k2lab.tokenizer", "k2lab.viz", "k2lab.lab"]) == []
    assert _loaded(modules, FIGURES + CHECKPOINTS_AND_TEXT) == []


def test_the_model_imports_nothing_above_it_not_even_the_package_root():
    """``import k2lab`` re-exports every room; a model module importing it would tie the model to all of them."""
    import k2lab

    root = Path(k2lab.__file__).parent
    for path in sorted((root / "model").rglob("*.py")):
        assert "k2lab" not in _imported_modules(path, root), f"{path.relative_to(root)} imports the package root"


def test_no_import_cycle_anywhere_in_k2lab():
    """Every import that runs (at the top of a module or inside a function; not those under TYPE_CHECKING, which only
    type checkers read) as an edge between k2lab's modules: the graph has no cycle."""
    import k2lab

    root = Path(k2lab.__file__).parent
    files = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}
    edges = {name: {m for m in _imported_modules(path, root, run_only=True) if m in files and m != name}
             for name, path in files.items()}
    done, stack = set(), []

    def visit(name: str) -> None:
        if name in stack:
            raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(name):], name]))
        if name in done:
            return
        stack.append(name)
        for target in sorted(edges[name]):
            visit(target)
        stack.pop()
        done.add(name)

    for name in sorted(files):
        visit(name)
