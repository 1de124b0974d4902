"""Hostile settings for the lab: bad environment values and bad LabSettings fields raise naming the variable or
field when the settings are made, not later inside the loader."""

from __future__ import annotations

import pytest
import torch

from k2lab.lab.settings import LabSettings, load_model


@pytest.mark.parametrize("env, named", [
    ({"K2LAB_EXPERT_BUDGET_GIB": "nan"}, "K2LAB_EXPERT_BUDGET_GIB must be >= 0 and finite .*nan"),
    ({"K2LAB_EXPERT_BUDGET_GIB": "inf"}, "K2LAB_EXPERT_BUDGET_GIB must be >= 0 and finite .*inf"),
    ({"K2LAB_EXPERT_BUDGET_GIB": "1GB"}, "K2LAB_EXPERT_BUDGET_GIB must be a number, got '1GB'"),
    ({"K2LAB_DEVICE_MAP": "[1, 2]"}, r"K2LAB_DEVICE_MAP\[''\] = '\[1, 2\]' is not a torch device"),
    ({"K2LAB_DEVICE_MAP": "tpu"}, r"K2LAB_DEVICE_MAP\[''\] = 'tpu' is not a torch device"),
    ({"K2LAB_DEVICE_MAP": '{"": "tpu"}'}, r"K2LAB_DEVICE_MAP\[''\] = 'tpu' is not a torch device"),
    ({"K2LAB_DEVICE_MAP": '{"layers.0": [0]}'}, r"K2LAB_DEVICE_MAP\['layers.0'\] = \[0\] is not a torch device"),
    ({"K2LAB_DEVICE_MAP": '{"": "cuda:0"'}, "K2LAB_DEVICE_MAP is not valid JSON"),
    ({"K2LAB_NUM_LAYERS": "2.5"}, "K2LAB_NUM_LAYERS must be an integer, got '2.5'"),
    ({"K2LAB_DTYPE": "bf16"}, "K2LAB_DTYPE must be one of"),
])
def test_a_bad_environment_value_names_its_variable(env, named):
    with pytest.raises(ValueError, match=named):
        LabSettings.from_env(env)


@pytest.mark.parametrize("fields, named", [
    ({"device_map": {"": "tpu"}}, r"LabSettings.device_map\[''\] = 'tpu' is not a torch device"),
    ({"device_map": "gpu"}, "LabSettings.device_map = 'gpu' is not a torch device"),
    ({"device_map": 2.5}, "LabSettings.device_map must be None, 'auto', a device or a mapping"),
    ({"device_map": {0: "cpu"}}, "LabSettings.device_map: module prefixes must be strings"),
    ({"expert_budget_bytes": "1GB"}, "LabSettings.expert_budget_bytes must be None or an integer >= 0, got '1GB'"),
    ({"expert_budget_bytes": -1}, "LabSettings.expert_budget_bytes must be None or an integer >= 0"),
    ({"num_layers": 0}, "LabSettings.num_layers must be None or an integer >= 1, got 0"),
    ({"dtype": "bfloat16"}, "LabSettings.dtype must be None or a floating torch dtype, got 'bfloat16'"),
    ({"dtype": torch.int8}, "LabSettings.dtype must be None or a floating torch dtype"),
    ({"model": ""}, "LabSettings.model must be 'nano', a Hub repo id or a folder"),
    ({"model": None}, "LabSettings.model must be"),
])
def test_a_bad_settings_field_is_named_when_made(fields, named):
    with pytest.raises(ValueError, match=named):
        LabSettings(**fields)


def test_good_device_maps_pass():
    assert LabSettings.from_env({"K2LAB_DEVICE_MAP": "cuda:1"}).device_map == {"": "cuda:1"}
    assert LabSettings(device_map={"layers.0": 0, "": torch.device("cpu")}).device_map["layers.0"] == 0
    assert [LabSettings(device_map=d).device_map for d in ("cpu", "cuda:1", 0)] == ["cpu", "cuda:1", 0]
    assert LabSettings.from_env({"K2LAB_EXPERT_BUDGET_GIB": "0.5"}).expert_budget_bytes == 2**29


@pytest.mark.parametrize("device", ["mps", "xpu"])
def test_a_device_this_machine_lacks_is_named_when_the_model_loads(device):
    """Settings may name a GPU node's device on a laptop (the notebook's parameter cell is written once); loading is
    where a device this machine lacks is refused, with the field and the devices there are."""
    with pytest.raises(ValueError, match=rf"device_map='{device}' is not available on this machine \(available here"):
        load_model(LabSettings(device_map=device))
