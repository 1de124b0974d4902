"""Attention masks and padding: a padded row gives, at its real positions, the logits of HF transformers'
DeepseekV3 (float32, eager, with attention_mask and explicit position_ids) and of the same row run alone; the latent
cache keeps the pads hidden across decode steps; generate decodes a left-padded batch as each row alone."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import hf_model, relative_error, save_and_load
from tiny import TINY

import k2lab

LENGTHS = [9, 5, 7]  # real tokens per row


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    ref = hf_model(TINY, seed=11)
    return ref, save_and_load(ref, tmp_path_factory.mktemp("masks"))


def rows(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY.vocab_size, (n,), generator=gen) for n in LENGTHS]


def padded(seqs: list[torch.Tensor], side: str, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] and mask [B, T] (long), built here without k2lab."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[i, cols], mask[i, cols] = s, 1
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("attn_impl", ["naive", "absorbed"])
def test_padded_batch_equals_hf_with_mask_and_positions(pair, side, attn_impl):
    ref, model = pair
    ids, mask = padded(rows(), side, pad=7)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # HF is told the positions; k2lab works them out from the mask
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        ours = model(ids, attn_impl=attn_impl, attention_mask=mask)
    real = mask.bool()
    assert relative_error(ours[real], expected[real]) < 1e-5
    assert torch.isfinite(ours).all()  # pads' own rows stay finite too


@pytest.mark.parametrize("attn_impl", ["naive", "absorbed"])
def test_padded_rows_equal_rows_alone_and_pads_change_nothing(pair, attn_impl):
    _, model = pair
    seqs = rows(1)
    for side in ("left", "right"):
        ids, mask = padded(seqs, side)
        other_pads = ids.masked_fill(~mask.bool(), 500)  # what the pads hold must not matter
        with torch.no_grad():
            batch = model(ids, attn_impl=attn_impl, attention_mask=mask)
            again = model(other_pads, attn_impl=attn_impl, attention_mask=mask)
            for i, s in enumerate(seqs):
                alone = model(s[None], attn_impl=attn_impl)[0]
                assert relative_error(batch[i][mask[i].bool()], alone) < 1e-5
        # Other pad tokens route to other experts, so the real rows meet other row counts in the experts' GEMMs, which
        # the BLAS may block differently: equal to float32 rounding (a few ulps), not bit for bit.
        assert relative_error(batch[mask.bool()], again[mask.bool()]) < 1e-6


def test_all_ones_mask_is_no_mask(pair):
    _, model = pair
    ids = torch.stack([s[:5] for s in rows(2)])
    with torch.no_grad():
        assert relative_error(model(ids, attention_mask=torch.ones_like(ids)), model(ids)) < 1e-6


@pytest.mark.parametrize("attn_impl", ["naive", "absorbed"])
def test_cache_hides_pads_across_decode_steps(pair, attn_impl):
    """Left-padded prefill in two chunks, then three decode steps without a mask: each row's logits equal that row's
    whole sequence run alone without a cache."""
    _, model = pair
    seqs = rows(3)
    steps = torch.randint(0, TINY.vocab_size, (len(seqs), 3), generator=torch.Generator().manual_seed(4))
    ids, mask = padded(seqs, "left")
    cache = model.new_cache(len(seqs))
    with torch.no_grad():
        first = model(ids[:, :4], cache=cache, attn_impl=attn_impl, attention_mask=mask[:, :4])
        second = model(ids[:, 4:], cache=cache, attn_impl=attn_impl, attention_mask=mask[:, 4:])
        decoded = [model(steps[:, j : j + 1], cache=cache, attn_impl=attn_impl)[:, 0] for j in range(3)]
        prefill = torch.cat([first, second], dim=1)
        for i, s in enumerate(seqs):
            alone = model(torch.cat([s, steps[i]])[None])[0]  # [n + 3, V]
            assert relative_error(prefill[i][mask[i].bool()], alone[: len(s)]) < 1e-5
            assert relative_error(torch.stack([d[i] for d in decoded]), alone[len(s) :]) < 1e-5
    assert cache.length == ids.shape[1] + 3


@pytest.mark.parametrize("attn_impl", ["naive", "absorbed"])
def test_generate_left_padded_batch_equals_each_row_alone(pair, attn_impl):
    _, model = pair
    seqs = rows(5)
    ids, mask = padded(seqs, "left")
    out = k2lab.generate(model, ids, max_new_tokens=6, attention_mask=mask, attn_impl=attn_impl, stop_at_eos=False)
    assert out.shape == (len(seqs), ids.shape[1] + 6)
    for i, s in enumerate(seqs):
        alone = k2lab.generate(model, s[None], max_new_tokens=6, attn_impl=attn_impl, stop_at_eos=False)[0]
        assert torch.equal(out[i][-len(alone) :], alone)
        assert torch.equal(out[i][: ids.shape[1]], ids[i])  # the prompt and its pads, where they were


def test_generate_right_padded_batch_continues_each_row_from_its_last_token(pair):
    _, model = pair
    seqs = rows(6)
    ids, mask = padded(seqs, "right")
    out = k2lab.generate(model, ids, max_new_tokens=4, attention_mask=mask, stop_at_eos=False)
    for i, s in enumerate(seqs):
        alone = k2lab.generate(model, s[None], max_new_tokens=4, stop_at_eos=False)[0]
        assert torch.equal(out[i, ids.shape[1] :], alone[len(s) :])


def test_bad_masks_are_refused(pair):
    _, model = pair
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"attention_mask must be integer or bool \[B, T\] = \(2, 5\)"):
        model(ids, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask must be integer or bool"):
        model(ids, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="values other than 0 and 1: \\[1, 2\\]"):
        model(ids, attention_mask=torch.tensor([[1, 1, 2, 1, 1]] * 2))
    with pytest.raises(ValueError, match="row without any token: row 1"):
        k2lab.generate(model, ids, 2, attention_mask=torch.tensor([[1] * 5, [0] * 5]))
