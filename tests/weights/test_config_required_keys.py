"""config.json keys without a documented default are required: a missing one is an error naming it (issue 18), while
the keys with documented defaults (``OPTIONAL_KEYS``) may be left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k2lab import K2Config
from k2lab.hf_config import OPTIONAL_KEYS

RELEASED = json.loads((Path(__file__).parent.parent / "data" / "kimi_k2_instruct_config.json").read_text())


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "n_routed_experts", "num_experts_per_tok",
                                 "routed_scaling_factor", "first_k_dense_replace", "max_position_embeddings"])
def test_a_missing_required_key_is_named(key):
    raw = {k: v for k, v in RELEASED.items() if k != key}
    with pytest.raises(ValueError, match=rf"required key\(s\) \['{key}'\] missing"):
        K2Config.from_hf(raw)


def test_documented_defaults_fill_what_is_left_out():
    raw = {k: v for k, v in RELEASED.items() if k not in OPTIONAL_KEYS}
    cfg = K2Config.from_hf(raw)
    assert cfg.q_lora_rank is None and (cfg.n_group, cfg.topk_group) == (1, 1)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (None, None) and cfg.rope_interleave and cfg.rms_norm_eps == 1e-6
