"""k2lab.routing: the router's selection rule, the per-layer trace, and bias flips."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from tiny import GROUPED, TINY, random_model, token_ids

from k2lab.analysis.interventions import edit_bias, force_route
from k2lab.analysis.routing import RoutingTrace, select_experts, trace

pytestmark = pytest.mark.usefixtures("no_grad")

_ids = partial(token_ids, TINY, length=11)


@pytest.mark.parametrize("cfg", [TINY, GROUPED], ids=["one_group", "grouped"])
def test_trace_matches_the_router_probes(cfg):
    model = random_model(cfg)
    _, cache = model.run_with_cache(_ids(), names=".mlp.gate.")
    tr = trace(model, _ids())
    assert tr.layers == [1, 2]
    assert tr.indices.shape == (2, 2, 11, 4) and tr.scores.shape == (2, 2, 11, 16)
    for j, layer in enumerate(tr.layers):
        p = f"layers.{layer}.mlp.gate."
        assert torch.equal(tr.indices[j], cache[p + "hook_topk_idx"])
        assert torch.equal(tr.weights[j], cache[p + "hook_topk_weights"])
        assert torch.equal(tr.scores[j], cache[p + "hook_scores"])
        assert torch.equal(tr.choice_scores[j], cache[p + "hook_choice_scores"])
        # the selection rule, groups included, reproduces the router exactly
        assert torch.equal(select_experts(tr.choice_scores[j], 4, cfg.n_group, cfg.topk_group), tr.indices[j])
    assert tr.row(2) == 1
    with pytest.raises(ValueError, match="not a MoE layer"):
        tr.row(0)


@pytest.mark.parametrize("cfg", [TINY, GROUPED], ids=["one_group", "grouped"])
def test_bias_flips_are_where_the_bias_changed_the_chosen_set(cfg):
    model = random_model(cfg, seed=2)
    tr = trace(model, _ids())
    for j, layer in enumerate(tr.layers):
        with edit_bias(model, {layer: 0.0}):  # the router itself without this layer's bias; inputs unchanged
            unbiased = trace(model, _ids())
        assert torch.equal(tr.unbiased_indices[j], unbiased.indices[j])
        changed = (tr.indices[j].sort(-1).values != unbiased.indices[j].sort(-1).values).any(-1)  # [B, T]
        assert torch.equal(tr.bias_flips[j], changed)
        assert unbiased.flip_counts[j] == 0
    assert tr.bias_flips.any() and not tr.bias_flips.all()  # the random bias flips some tokens, not all
    assert torch.equal(tr.flip_counts, tr.bias_flips.flatten(1).sum(-1))
    reordered = (tr.indices != tr.unbiased_indices).any(-1) & ~tr.bias_flips
    assert reordered.any()  # the same set in another order is not a flip


def test_trace_sees_interventions_and_needs_the_gate_probes():
    model = random_model(TINY)
    with force_route(model, {2: [0, 1, 2, 3]}):
        tr = trace(model, _ids())
    assert (tr.indices[1] == torch.tensor([0, 1, 2, 3])).all()
    _, partial = model.run_with_cache(_ids(), names="hook_topk_idx")
    with pytest.raises(KeyError, match="needs the gate probes"):
        RoutingTrace.from_cache(partial)
    with pytest.raises(ValueError, match="no MoE layer"):
        trace(random_model(TINY.replace(first_k_dense_replace=3)), _ids())


def test_a_trace_of_texts_keeps_the_pad_mask_the_tokenizer_made():
    """A list of texts of different lengths is left-padded by the model's tokenizer; the trace must hold that mask,
    as it does for the same ids given with their attention_mask, so that its metrics count real tokens only."""
    import k2lab
    from k2lab.analysis.routing import expert_counts

    model, tok = k2lab.load_nano()
    texts = ["import os\n", "def main(argv):\n    return", "x = 1"]
    ids, mask = tok.encode_padded(texts)
    from_text, from_ids = trace(model, texts), trace(model, ids, attention_mask=mask)
    assert from_text.token_mask is not None and not from_text.token_mask.all()
    assert torch.equal(from_text.token_mask, mask.bool())
    assert torch.equal(from_text.indices, from_ids.indices)
    k = model.config.num_experts_per_tok
    assert torch.equal(expert_counts(from_text).sum(-1), torch.full((len(from_text.layers),), int(mask.sum()) * k))
