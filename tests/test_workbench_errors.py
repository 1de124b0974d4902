"""Mistakes a researcher makes at the workbench get an error that names the argument, the value given and what is
allowed, not a message from deep inside numpy, json or tuple()."""

from __future__ import annotations

import json
import re

import pytest
import torch

from k2lab import K2Config
from k2lab.weights.quant.fp8 import FP8Format


def test_router_token_figure_names_an_expert_id_past_the_scores():
    pytest.importorskip("plotly")
    from k2lab.viz import router_token_figure
    from k2lab.viz.style import CHOSEN

    scores, bias, weights = torch.rand(8), torch.zeros(8), torch.tensor([0.6, 0.4])
    with pytest.raises(ValueError, match=r"chosen must hold expert ids in 0\.\.7 \(scores holds 8 experts\); got 9"):
        router_token_figure(scores, bias, torch.tensor([1, 9]), weights)
    with pytest.raises(ValueError, match=r"chosen must hold expert ids in 0\.\.7 .*got -1"):
        router_token_figure(scores, bias, torch.tensor([-1, 2]), weights)  # not read as expert 7 from the end
    with pytest.raises(ValueError, match=r"unbiased must hold expert ids in 0\.\.7 .*got 8"):
        router_token_figure(scores, bias, torch.tensor([1, 2]), weights, unbiased=torch.tensor([1, 8]))
    with pytest.raises(ValueError, match=r"unbiased must hold expert ids .*got 1\.5"):
        router_token_figure(scores, bias, torch.tensor([1, 2]), weights, unbiased=[1.5, 2])
    fig = router_token_figure(scores, bias, torch.tensor([0, 7]), weights, unbiased=torch.tensor([0, 7]))
    score_bars = fig.data[0]  # the first panel without logits: s per expert, the chosen ones filled
    assert [e for e, color in enumerate(score_bars.marker.color) if color == CHOSEN] == [0, 7]  # both edges allowed


def _released() -> dict:
    return K2Config.kimi_k2().to_hf()


def test_from_hf_refuses_a_config_that_is_not_a_json_object(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps([_released()]))  # a list holding the config, not the config
    with pytest.raises(ValueError, match=r"config\.json must hold a JSON object .*got list \[\{"):
        K2Config.from_hf(path)
    with pytest.raises(ValueError, match="must hold a JSON object"):
        K2Config.from_hf(tmp_path)  # the folder: the same file
    with pytest.raises(TypeError, match=r"source must be a path to config\.json .* or the parsed dict, got list"):
        K2Config.from_hf([_released()])


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("value", ["yarn", ["yarn", 32.0]])
def test_from_hf_names_a_rope_setting_that_is_not_an_object(key, value):
    raw = {k: v for k, v in _released().items() if k != "rope_parameters"}
    expected = rf"config: {key} must be an object such as \{{\"type\": \"yarn\", .*or null for plain RoPE; got "
    with pytest.raises(ValueError, match=expected + re.escape(repr(value))):
        K2Config.from_hf({**raw, key: value})


@pytest.mark.parametrize("block", [5, None, "128", (128,), (1, 2, 3), (0, 128), (128, 2.0), (True, 128)])
def test_fp8_format_says_block_is_a_pair_of_positive_ints(block):
    with pytest.raises(ValueError, match=r"FP8 block must be a \(rows, cols\) pair of positive integers, e\.g\. "
                                         r"FP8Format\(block=\(128, 128\)\); got block="):
        FP8Format(block=block)


def test_fp8_format_takes_a_list_or_tuple_pair():
    assert FP8Format(block=[32, 48]).block == (32, 48) == FP8Format((32, 48)).block
