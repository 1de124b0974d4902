"""TransformerLens habits on the activation cache: (short name, layer) keys, accumulated_resid and
apply_ln_to_stack, checked against the probes themselves and the model's own final norm and head."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def run(model, ids):
    with torch.no_grad():
        logits, cache = model.run_with_cache(ids)
    return model, logits, cache


def test_short_keys(run):
    _, logits, cache = run
    assert cache["resid_post", 2] is cache["layers.2.hook_resid_post"]
    assert cache["pattern", 2] is cache["layers.2.self_attn.hook_pattern"]
    assert cache["topk_idx", 1] is cache["layers.1.mlp.gate.hook_topk_idx"]
    assert cache["router_logits", -1] is cache["layers.2.mlp.gate.hook_logits"]
    assert torch.equal(cache["logits"], logits) and cache["embed"] is cache["embed_tokens.hook_out"]
    assert ("resid_pre", 0) in cache and ("topk_idx", 0) not in cache  # layer 0 is dense
    with pytest.raises(KeyError, match="layer 3 out of range for 3 layers"):
        cache["resid_post", 3]
    with pytest.raises(KeyError, match="closest"):
        cache["resid_postt", 1]


def test_accumulated_resid_stacks_the_stream_before_each_block(run):
    _, _, cache = run
    stack, labels = cache.accumulated_resid(return_labels=True)
    assert labels == ["0_pre", "1_pre", "2_pre", "final_post"] and stack.shape == (4, 2, 7, 256)
    assert torch.equal(stack[1], cache["layers.1.hook_resid_pre"])
    assert torch.equal(stack[-1], cache["layers.2.hook_resid_post"])
    mid, labels = cache.accumulated_resid(layer=2, incl_mid=True, pos=-1, return_labels=True)
    assert labels == ["0_pre", "0_mid", "1_pre", "1_mid", "2_pre"] and mid.shape == (5, 2, 256)
    assert torch.equal(mid[3], cache["layers.1.hook_resid_mid"][:, -1])
    with pytest.raises(ValueError, match=r"layer must be None or -1 \(the final residual\) or an int in 0..3, got 4"):
        cache.accumulated_resid(layer=4)


def test_apply_ln_to_stack_splits_the_final_norm_linearly(run):
    model, logits, cache = run
    labels, parts = cache.decompose_resid(pos=-1).components()  # [C, B, D] summing to the final residual
    scaled = cache.apply_ln_to_stack(parts, pos=-1)
    assert torch.allclose(scaled.sum(0), cache["norm.hook_out"][:, -1], atol=1e-4)
    per_part = scaled @ model.lm_head.weight.T  # [C, B, V]: each part's direct effect on the logits
    assert torch.allclose(per_part.sum(0), logits[:, -1], atol=1e-3)
    # the final entry of the accumulated stream, through the norm, is the final norm's output itself
    lens = cache.accumulated_resid(apply_ln=True)
    assert torch.allclose(lens[-1], cache["norm.hook_out"], atol=1e-5)
    with pytest.raises(ValueError, match=r"does not end with the residual's \(2, 256\) at pos_slice=-1"):
        cache.apply_ln_to_stack(torch.zeros(3, 2, 7, 256), pos=-1)
