"""K2LAB_MODEL may name an architecture preset: config only (notebook 08's scale tables); loading one falls back."""

from __future__ import annotations

import pytest

from k2lab import K2Config
from k2lab.lab.settings import PRESETS, LabSettings, load_model


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_name_gives_its_config(name):
    settings = LabSettings.from_env({"K2LAB_MODEL": name})
    assert settings.is_preset and not settings.is_nano
    assert settings.config() == getattr(K2Config, name)()


def test_nano_config_is_read_without_weights():
    assert LabSettings().config() == K2Config.nano()


def test_loading_a_preset_is_refused_or_falls_back_to_nano():
    settings = LabSettings(model="kimi_k2_thinking")
    with pytest.raises(ValueError, match="architecture preset"):
        load_model(settings)
    model, _, about = load_model(settings, fallback_to_nano=True)
    assert model.config == K2Config.nano() and "kimi_k2_thinking" in about
