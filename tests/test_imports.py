"""The import boundaries: data flows config -> model -> analysis -> viz and weights -> model, so the model package
imports no checkpoint, hub, tokenizer or figure library, ``import k2lab`` loads no figure library, and
``k2lab.viz`` brings plotly when it is asked for. Each check runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

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
