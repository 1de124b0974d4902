"""The training command's overrides: ``python -m k2lab.train --set key=value ...``."""

from __future__ import annotations

import pytest

from k2lab.train import TrainConfig, train_config_from


def test_overrides_take_each_fields_type():
    tc = train_config_from(["steps=300", "lr=1e-2", "threads=1", "test_suite_share=0"])
    assert (tc.steps, tc.lr, tc.threads, tc.test_suite_share) == (300, 0.01, 1, 0.0)
    assert isinstance(tc.test_suite_share, float)
    assert tc.eval_every == 300  # a short trial still evaluates at its end
    assert TrainConfig().steps != 300  # the defaults are untouched


@pytest.mark.parametrize("pair, named", [("step=300", "'step=300'"), ("steps", "'steps'"),
                                         ("steps=1.5", "steps takes int"), ("lr=fast", "lr takes float")])
def test_a_bad_override_is_named(pair, named):
    with pytest.raises(ValueError, match=named):
        train_config_from([pair])
