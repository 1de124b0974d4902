"""The workbench habits of a TransformerLens or nnsight user (issue #40): ids padded by ``to_tokens`` and run without a
mask get each row's own logits (the mask is inferred), a probe the forward never reads refuses a replacement,
a model nnsight wrapped is observed for good, ``run_with_hooks`` and ``add_hook`` work as TransformerLens's, and wrong
constructor arguments are refused by name."""

from __future__ import annotations

import pytest
import torch
from tiny import MICRO, TINY, random_model, token_ids

import k2lab
from k2lab import K2Config, K2Model, LatentCache
from k2lab.model.hooks import HookPoint

TEXTS = ["def add(a, b):\n    return a + b", "x = 1", "import os"]


@pytest.fixture(scope="module")
def nano():
    model, tok = k2lab.load_nano()
    return model, tok


def padded(nano, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """TEXTS as to_tokens pads them on ``side``, and their mask [B, T] bool."""
    model, _ = nano
    ids, mask = model.to_tokens(TEXTS, padding_side=side, return_mask=True)
    return ids, mask.bool()


# ---- 1. the attention mask of ids padded without one -----------------------------------------------------------------
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_ids_without_a_mask_give_each_row_its_own_logits(nano, side):
    model, tok = nano
    ids, mask = padded(nano, side)
    assert (~mask).any(), "the batch must hold pads"
    with torch.no_grad():
        batch = model(ids)  # no attention_mask: inferred from the [PAD] tokens at the edges
        for row in range(len(TEXTS)):
            alone = model(torch.tensor([tok.encode(TEXTS[row])]))[0]  # [T_row, V]
            torch.testing.assert_close(batch[row, mask[row]], alone, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.infer_attention_mask(ids), mask)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_ids_without_a_mask_route_each_row_as_alone(nano, side):
    model, tok = nano
    ids, mask = padded(nano, side)
    names = ["mlp.gate.hook_topk_idx", "mlp.gate.hook_topk_weights", "hook_resid_post"]
    with torch.no_grad():
        _, batch = model.run_with_cache(ids, names=names)
        for row in range(len(TEXTS)):
            _, alone = model.run_with_cache(torch.tensor([tok.encode(TEXTS[row])]), names=names)
            for name in alone:
                if name.endswith("hook_topk_idx"):
                    assert torch.equal(batch[name][row, mask[row]], alone[name][0]), name
                else:
                    torch.testing.assert_close(batch[name][row, mask[row]], alone[name][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_generate_infers_the_mask_of_padded_ids(nano, side):
    model, tok = nano
    ids, mask = padded(nano, side)
    inferred = k2lab.generate(model, ids, 4)
    assert torch.equal(inferred, k2lab.generate(model, ids, 4, attention_mask=mask))
    for row in range(len(TEXTS)):  # greedy: each row continues as it would alone
        alone = k2lab.generate(model, torch.tensor([tok.encode(TEXTS[row])]), 4, stop_at_eos=False)[0]
        prompt = int(mask[row].sum())
        new = inferred[row, ids.shape[1]:]
        assert torch.equal(inferred[row, :ids.shape[1]][mask[row]], alone[:prompt])
        done = (new == model.config.eos_token_id).nonzero()
        stop = int(done[0]) + 1 if len(done) else len(new)  # a row that stopped is padded with eos after
        assert torch.equal(new[:stop], alone[prompt:prompt + stop])


def test_an_explicit_mask_wins_over_the_inferred_one(nano):
    model, _ = nano
    ids, _ = padded(nano, "left")
    ones = torch.ones_like(ids)
    with torch.no_grad():
        given = model(ids, attention_mask=ones)
        tokenizer, model.tokenizer = model.tokenizer, None  # no tokenizer: nothing to infer from
        try:
            unmasked = model(ids)
        finally:
            model.tokenizer = tokenizer
        inferred = model(ids)
    torch.testing.assert_close(given, unmasked, rtol=0, atol=0)
    assert not torch.allclose(given[1:], inferred[1:], atol=1e-3)  # the padded rows: pads attended to, or not


def test_eos_at_a_row_end_and_a_pad_inside_a_row_are_tokens(nano):
    model, tok = nano
    pad, eos = tok.special_tokens["[PAD]"], model.config.eos_token_id
    words = tok.encode(TEXTS[0])
    first, second = words[:4], words[4:8]
    ids = torch.tensor([[pad, *first, eos], [*second[:1], pad, *second[1:], eos]])
    expected = torch.ones_like(ids, dtype=torch.bool)
    expected[0, 0] = False
    assert torch.equal(model.infer_attention_mask(ids), expected)
    assert model.infer_attention_mask(ids[:1, 1:]) is None  # no pad at an edge: no mask
    with torch.no_grad():
        batch = model(ids)
        torch.testing.assert_close(batch[0, 1:], model(ids[:1, 1:])[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch[1], model(ids[1:])[0], rtol=1e-5, atol=1e-5)


def test_a_row_of_pads_only_is_refused_by_its_index(nano):
    model, tok = nano
    pad = tok.special_tokens["[PAD]"]
    ids = torch.tensor([tok.encode("a b c"), [pad] * 3])
    with pytest.raises(ValueError, match=r"row 1 holds only \[PAD\] tokens"):
        model(ids)
    with pytest.raises(ValueError, match=r"row 1 holds only \[PAD\] tokens"):
        model.infer_attention_mask(ids)


def test_a_pad_token_at_a_decode_step_is_not_masked(nano):
    """Only a forward that starts a sequence infers pads: after a prefill, a new [PAD] is a token like any other."""
    model, tok = nano
    pad = tok.special_tokens["[PAD]"]
    ids = torch.tensor([[*tok.encode("x = 1"), pad]])
    with torch.no_grad():
        cache = model.new_cache(1)
        model(ids[:, :-1], cache=cache)
        step = model(ids[:, -1:], cache=cache)[0, -1]
        whole = model(ids, attention_mask=torch.ones_like(ids))[0, -1]
    torch.testing.assert_close(step, whole, rtol=1e-5, atol=1e-5)


def test_without_a_tokenizer_nothing_is_inferred(model):
    assert model.tokenizer is None and model.infer_attention_mask(token_ids(TINY)) is None


# ---- 2. read-only probes ---------------------------------------------------------------------------------------------
def perturbed(t: torch.Tensor, hook: HookPoint) -> torch.Tensor:
    """A replacement of ``t`` unlike it everywhere: other experts for indices, seeded noise for values."""
    if not t.is_floating_point():
        return (t + 1) % hook.index_bound
    return t + torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to(t)


@pytest.mark.parametrize("attn_impl", ["naive", "absorbed"])
def test_the_probes_whose_replacement_changes_nothing_are_exactly_the_read_only_ones(attn_impl):
    model = random_model(MICRO)  # a dense block and a MoE block: every kind of probe
    ids = token_ids(MICRO, batch=2, length=6)
    with torch.no_grad():
        plain = model(ids, attn_impl=attn_impl)
        ignored = set()
        for name in model.hook_names():
            point = model.hook_point(name)
            read_only, point.read_only = point.read_only, None  # what a replacement would do, were it allowed
            try:
                with model.hooks(fwd_hooks=[(name, perturbed)]):
                    edited = model(ids, attn_impl=attn_impl)
            finally:
                point.read_only = read_only
            if torch.equal(edited, plain):
                ignored.add(name)
    flagged = {name for name in model.hook_names() if model.hook_point(name).read_only is not None}
    assert ignored == flagged
    assert flagged == {f"layers.{i}.self_attn.hook_max_logit" for i in range(MICRO.num_hidden_layers)}
    for name in flagged:
        with model.hooks(fwd_hooks=[(name, perturbed)]), pytest.raises(ValueError) as err:
            model(ids, attn_impl=attn_impl)
        assert f"{name} is read-only" in str(err.value)
        assert name.replace("hook_max_logit", "hook_attn_scores") + " instead" in str(err.value)


def test_reading_a_read_only_probe_still_works(model):
    ids = token_ids(TINY, batch=2, length=6)
    seen = []
    with torch.no_grad(), model.hooks(fwd_hooks=[("layers.1.self_attn.hook_max_logit", lambda t, h: seen.append(t))]):
        model(ids)
    assert len(seen) == 1 and seen[0].shape == (2, TINY.num_attention_heads)


# ---- 3. is_observed and nnsight --------------------------------------------------------------------------------------
def test_a_model_nnsight_wrapped_is_observed_for_good_and_gives_the_same_answers():
    """NNsight(model) leaves its wrapper on every module's forward, and k2lab reads nothing of nnsight's own state to
    tell whether a trace runs: from then on every probe counts as active (attention writes its pattern out for any
    trace that reads it) and the model as observed (generate(compile=True) runs eagerly). Outside a trace the
    wrapped model still computes what an unwrapped one does, to float32 rounding."""
    nnsight = pytest.importorskip("nnsight")
    model, ids = random_model(), token_ids(TINY)
    assert not model.is_observed()
    wrapped = nnsight.NNsight(model)
    assert "forward" in model.layers[1].mlp.__dict__  # nnsight's wrapper stays installed between traces
    assert model.is_observed() and model.hook_point("layers.1.self_attn.hook_pattern").active
    with torch.no_grad():
        with wrapped.trace(ids):
            saved = wrapped.layers[1].self_attn.hook_pattern.output.save()
        assert saved.shape == (2, TINY.num_attention_heads, 17, 17)
        torch.testing.assert_close(model(ids), random_model()(ids), rtol=1e-5, atol=1e-5)
    with pytest.warns(UserWarning, match="a wrapper such as nnsight's"):
        out = k2lab.generate(model, ids, 3, compile=True)
    assert torch.equal(out, k2lab.generate(random_model(), ids, 3))


# ---- 4. TransformerLens spellings: run_with_hooks, add_hook ----------------------------------------------------------
def zero(t: torch.Tensor, hook: HookPoint) -> torch.Tensor:
    return torch.zeros_like(t)


@pytest.mark.parametrize("selector", ["layers.1.hook_attn_out", "blocks.1.hook_attn_out"])
def test_run_with_hooks_is_one_forward_inside_a_hooks_block(model, ids, selector):
    with torch.no_grad():
        with model.hooks(fwd_hooks=[("layers.1.hook_attn_out", zero)]):
            expected = model(ids, return_type="both")
        got = model.run_with_hooks(ids, fwd_hooks=[(selector, zero)], return_type="both")
    assert not any(model.hook_point(name).active for name in model.hook_names())
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.allclose(got[0], model(ids), atol=1e-4)


def test_run_with_hooks_without_reset_keeps_the_hooks_for_backward(model, ids):
    def record(into):
        def keep(grad, hook):
            into[hook.name] = grad.clone()
        return keep

    manual, kept = {}, {}
    with model.hooks(fwd_hooks=[("layers.1.hook_attn_out", zero)], bwd_hooks=[("hook_resid_mid", record(manual))]):
        model(ids, return_type="loss").backward()
    model.zero_grad(set_to_none=True)
    loss = model.run_with_hooks(ids, fwd_hooks=[("blocks.1.hook_attn_out", zero)],
                                bwd_hooks=[("hook_resid_mid", record(kept))], reset_hooks_end=False,
                                return_type="loss")
    assert model.hook_point("layers.1.hook_attn_out").active and model.is_observed()
    loss.backward()  # after run_with_hooks returned: the backward hooks are still attached
    model.zero_grad(set_to_none=True)
    assert kept.keys() == manual.keys() == {f"layers.{i}.hook_resid_mid" for i in range(TINY.num_hidden_layers)}
    for name in manual:
        torch.testing.assert_close(kept[name], manual[name], rtol=0, atol=0)
    model.reset_hooks()
    assert not model.is_observed()


def test_run_with_hooks_refuses_backward_hooks_it_would_detach_before_the_backward(model, ids):
    with pytest.raises(ValueError, match="reset_hooks_end=True detaches them"):
        model.run_with_hooks(ids, bwd_hooks=[("hook_resid_mid", lambda g, hook: None)])
    with pytest.raises(ValueError, match="reset_hooks_end must be True or False"):
        model.run_with_hooks(ids, reset_hooks_end="no")
    assert not model.is_observed()


def test_add_hook_attaches_until_reset_hooks(model, ids):
    manual_grads, grads = [], []
    with model.hooks(fwd_hooks=[("hook_attn_out", zero)],
                     bwd_hooks=[("layers.0.hook_resid_post", lambda g, hook: manual_grads.append(g.clone()))]):
        expected = model(ids, return_type="loss")
        expected.backward()
    model.add_hook("hook_attn_out", zero)  # a substring: every layer's
    model.add_hook("blocks.0.hook_resid_post", lambda g, hook: grads.append(g.clone()), dir="bwd")
    try:
        for _ in range(2):  # still attached at the second forward
            loss = model(ids, return_type="loss")
            loss.backward()
            torch.testing.assert_close(loss, expected, rtol=0, atol=0)
        assert len(grads) == 2 and len(manual_grads) == 1
        torch.testing.assert_close(grads[1], manual_grads[0], rtol=0, atol=0)
    finally:
        model.reset_hooks()
        model.zero_grad(set_to_none=True)
    assert not model.is_observed()
    with pytest.raises(ValueError, match="dir must be 'fwd' or 'bwd', got 'backward'"):
        model.add_hook("hook_attn_out", zero, dir="backward")
    with pytest.raises(ValueError, match="a hook is a function"):
        model.add_hook("hook_attn_out", "zero")
    assert not model.is_observed()


# ---- 5. wrong arguments, refused by name; the full K2 on meta --------------------------------------------------------
@pytest.mark.parametrize("batch_size", [-1, 0, 1.5, True, "2"])
def test_a_cache_of_no_rows_is_refused_by_name(model, batch_size):
    with pytest.raises(ValueError, match=f"batch_size must be a whole number of rows >= 1, got {batch_size!r}"):
        LatentCache(TINY, batch_size=batch_size)
    with pytest.raises(ValueError, match="batch_size must be"):
        model.new_cache(batch_size=batch_size)


def test_a_device_this_machine_lacks_is_refused_by_name():
    missing = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    with pytest.raises(ValueError, match=rf"device='{missing}' is not available on this machine \(available here: "
                                         r"cpu, meta"):
        K2Model(TINY, device=missing)
    with pytest.raises(ValueError, match=r"device='gpu' is not available on this machine .*torch knows no such device"):
        K2Model(TINY, device="gpu")


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, "bfloat16"])
def test_a_dtype_that_is_not_floating_point_is_refused_by_name(dtype):
    with pytest.raises(ValueError, match=rf"dtype must be a floating-point torch dtype .* got {dtype!r}"):
        K2Model(TINY, dtype=dtype)


@pytest.fixture(scope="module")
def full_k2_on_meta():
    return K2Model(K2Config(), device="meta")


@pytest.mark.parametrize("ids_device", ["cpu", "meta"])
def test_the_full_k2_on_meta_gives_shapes_of_logits_and_losses(full_k2_on_meta, ids_device):
    model, V = full_k2_on_meta, full_k2_on_meta.config.vocab_size
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], device=ids_device)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], device=ids_device)
    logits = model(ids)
    assert logits.device.type == "meta" and logits.shape == (2, 4, V) and logits.dtype == torch.float32
    assert model(ids, attention_mask=mask).shape == (2, 4, V)
    loss = model(ids, return_type="loss", attention_mask=mask)
    assert loss.device.type == "meta" and loss.shape == ()
    assert model(ids, return_type="loss", loss_per_token=True).shape == (2, 3)
    with pytest.raises(ValueError, match="meta device has none"):
        k2lab.generate(model, ids, 2)


# ---- the block norms' probes ------------------------------------------------------------------------------------
def test_the_norm_probes_hold_the_normalised_inputs_of_attention_and_of_the_moe(nano):
    """``input_layernorm.hook_out`` is RMSNorm(resid_pre) and ``post_attention_layernorm.hook_out`` RMSNorm(resid_mid),
    computed here from the formula; replacing the second changes what the MoE sees (its router and its output)."""
    model, _ = nano
    ids = model.to_tokens("for i in range(3):\n    print(i)")
    _, cache = model.run_with_cache(ids)
    for i, layer in enumerate(model.layers):
        pairs = ((layer.input_layernorm, "hook_resid_pre"), (layer.post_attention_layernorm, "hook_resid_mid"))
        for norm, stream in pairs:
            x = cache[f"layers.{i}.{stream}"].double()  # [B, T, D]
            expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
            name = "ln1" if stream == "hook_resid_pre" else "ln2"
            torch.testing.assert_close(cache[name, i].double(), expected, rtol=1e-5, atol=1e-5)
    halved = lambda x, hook: x * 0.5
    with model.hooks(fwd_hooks=[("blocks.2.ln2.hook_normalized", halved)]):
        _, edited = model.run_with_cache(ids, names=["layers.2.mlp.gate.hook_logits", "layers.2.hook_mlp_out"])
    torch.testing.assert_close(edited["layers.2.mlp.gate.hook_logits"], cache["layers.2.mlp.gate.hook_logits"] * 0.5,
                               rtol=1e-4, atol=1e-5)  # the router is linear in its input
    assert not torch.allclose(edited["layers.2.hook_mlp_out"], cache["layers.2.hook_mlp_out"])
