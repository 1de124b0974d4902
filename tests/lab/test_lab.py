"""k2lab.lab: the notebooks' parameter cell (settings from the environment, loading, fallback, notebook setup)."""

from __future__ import annotations

import pytest
import torch

from k2lab import lab
from k2lab.lab.nano import NANO_DIR

needs_nano = pytest.mark.skipif(not (NANO_DIR / "config.json").is_file(), reason="no K2-nano checkpoint in assets/nano")


def test_defaults_are_the_bundled_nano_on_the_cpu():
    settings = lab.LabSettings.from_env({})
    assert settings == lab.LabSettings() and settings.is_nano
    assert settings.device_map is None and settings.num_layers is None and settings.expert_budget_bytes is None


def test_every_variable_is_read():
    settings = lab.LabSettings.from_env({
        "K2LAB_MODEL": "moonshotai/Kimi-K2-Instruct", "K2LAB_DEVICE_MAP": "auto", "K2LAB_NUM_LAYERS": "4",
        "K2LAB_EXPERT_BUDGET_GIB": "1.5", "K2LAB_DTYPE": "bfloat16",
    })
    assert settings == lab.LabSettings("moonshotai/Kimi-K2-Instruct", "auto", 4, int(1.5 * 2**30), torch.bfloat16)
    assert not settings.is_nano


@pytest.mark.parametrize(("text", "device_map"), [
    ("", None), ("cpu", None), ("auto", "auto"), ("cuda:1", {"": "cuda:1"}),
    ('{"": "cuda:0", "lm_head": "cuda:1"}', {"": "cuda:0", "lm_head": "cuda:1"}),
])
def test_device_maps(text, device_map):
    assert lab.LabSettings.from_env({"K2LAB_DEVICE_MAP": text}).device_map == device_map


@pytest.mark.parametrize(("name", "value", "message"), [
    ("K2LAB_NUM_LAYERS", "four", "K2LAB_NUM_LAYERS must be an integer"),
    ("K2LAB_NUM_LAYERS", "0", "K2LAB_NUM_LAYERS must be a positive integer"),
    ("K2LAB_EXPERT_BUDGET_GIB", "-1", "K2LAB_EXPERT_BUDGET_GIB must be >= 0"),
    ("K2LAB_DTYPE", "fp8", "K2LAB_DTYPE must be one of"),
    ("K2LAB_DEVICE_MAP", "{cuda", "K2LAB_DEVICE_MAP is not valid JSON"),
])
def test_bad_values_name_their_variable(name, value, message):
    with pytest.raises(ValueError, match=message):
        lab.LabSettings.from_env({name: value})


@needs_nano
def test_load_model_default_is_nano_in_float32():
    model, tok, about = lab.load_model(lab.LabSettings())
    assert model.dtype == torch.float32 and not model.training
    assert tok.vocab_size == model.config.vocab_size == 8192
    assert about.startswith("K2-nano (bundled): 6 blocks, 32 routed experts (top-4) + 1 shared")
    assert about.endswith("float32 on cpu")


@needs_nano
def test_load_model_passes_the_slice_on():
    model, _, about = lab.load_model(lab.LabSettings(num_layers=2))
    assert len(model.layers) == 2 and "2 blocks" in about


@needs_nano
def test_fallback_to_nano_says_why(tmp_path):
    missing = lab.LabSettings(model=str(tmp_path / "no-such-checkpoint"))
    with pytest.raises(FileNotFoundError):
        lab.load_model(missing)
    model, _, about = lab.load_model(missing, fallback_to_nano=True)
    assert len(model.layers) == 6
    assert about.startswith("K2-nano (bundled)") and "no-such-checkpoint" in about and "could not be loaded" in about


def test_tokenizer_alone():
    assert lab.tokenizer(lab.LabSettings()).vocab_size == 8192


def test_setup_notebook():
    import plotly.io as pio

    renderer, grad = pio.renderers.default, torch.is_grad_enabled()
    try:
        lab.setup_notebook()
        assert pio.renderers.default == "plotly_mimetype" and not torch.is_grad_enabled()
    finally:
        pio.renderers.default = renderer
        torch.set_grad_enabled(grad)
