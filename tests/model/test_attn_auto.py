"""attn_impl="auto", the default: the rule that picks a path per call, and the default call against HF
transformers' DeepseekV3 (the independent oracle) through every kind of call: prefill, long and short chunks
over a cache, decode steps, and the attention pattern probe."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import hf_model, relative_error, save_and_load
from tiny import TINY

import k2lab
from k2lab.model.attention import MultiHeadLatentAttention, choose_attn_impl

# TINY (tests/tiny.py): kv_lora_rank 64, so chunks of <= 16 new tokens absorb


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    ref = hf_model(TINY, seed=23)
    return ref, save_and_load(ref, tmp_path_factory.mktemp("auto"))


@pytest.fixture
def paths_taken(monkeypatch):
    """Records, call by call, which path each attention layer ran ("naive" or "absorbed")."""
    taken: list[str] = []
    for impl in ("naive", "absorbed"):
        original = getattr(MultiHeadLatentAttention, impl)

        def spy(self, *args, impl=impl, original=original):
            taken.append(impl)
            return original(self, *args)

        monkeypatch.setattr(MultiHeadLatentAttention, impl, spy)
    return taken


def _ids(length: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("num_new", "num_cached", "expected"), [
    (512, 0, "naive"),  # prefill without a cache: expand only the new tokens, fused kernel
    (1, 0, "naive"),  # nothing cached to reuse
    (1, 4096, "absorbed"),  # decode: read the latent cache once
    (128, 4096, "absorbed"),  # a short chunk over a long cache (K2: kv_lora_rank 512, up to 128 absorbed)
    (129, 4096, "naive"),  # a long chunk: its attention work outweighs expanding the cache
])
def test_auto_rule(num_new, num_cached, expected):
    assert choose_attn_impl("auto", num_new, num_cached, kv_lora_rank=512) == expected
    for forced in ("naive", "absorbed"):  # explicit paths are never overridden
        assert choose_attn_impl(forced, num_new, num_cached, kv_lora_rank=512) == forced


def test_unknown_attn_impl_is_refused_before_the_cache_is_touched(pair):
    _, ours = pair
    cache = ours.new_cache(batch_size=1)
    with pytest.raises(ValueError, match=r"attn_impl must be one of \('auto', 'naive', 'absorbed'\), got 'flash'"):
        ours(_ids(3, batch=1), cache=cache, attn_impl="flash")
    assert cache.length == 0


def test_default_call_matches_hf_through_prefill_chunks_and_decode(pair, paths_taken):
    ref, ours = pair
    ids = _ids(64)
    layers = TINY.num_hidden_layers
    with torch.no_grad():
        expected = ref(ids).logits
        assert relative_error(ours(ids), expected) < 1e-4  # prefill, no cache
        assert paths_taken == ["naive"] * layers
        cache = ours.new_cache(batch_size=2)
        steps = [ours(ids[:, :24], cache=cache),  # prefill into an empty cache: naive
                 ours(ids[:, 24:48], cache=cache),  # 24 new over 24 cached (> kv_lora_rank / 4): naive
                 ours(ids[:, 48:60], cache=cache)]  # 12 new over 48 cached: absorbed
        steps += [ours(ids[:, t : t + 1], cache=cache) for t in range(60, 64)]  # decode: absorbed
    assert paths_taken[layers:] == ["naive"] * 2 * layers + ["absorbed"] * 5 * layers
    assert relative_error(torch.cat(steps, dim=1), expected) < 1e-4


def test_generate_default_matches_hf(pair):
    ref, ours = pair
    ids = _ids(7, batch=1, seed=2)
    with torch.no_grad():
        expected = ref.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(k2lab.generate(ours, ids, max_new_tokens=10), expected)


def test_auto_fires_every_probe_and_the_pattern_matches_hf(pair, paths_taken):
    """Both paths fire the same probes, so "auto" exposes them all whichever path it picks; the decode step's
    pattern (absorbed under auto) is HF's attention weights."""
    ref, ours = pair
    ids = _ids(13)
    with torch.no_grad():
        fired = {}
        for attn_impl in ("naive", "absorbed"):
            cache = ours.new_cache(batch_size=2)
            ours(ids[:, :12], cache=cache)
            _, fired[attn_impl] = ours.run_with_cache(ids[:, 12:], cache=cache, attn_impl=attn_impl)
        cache = ours.new_cache(batch_size=2)
        ours(ids[:, :12], cache=cache)
        paths_taken.clear()
        _, auto = ours.run_with_cache(ids[:, 12:], cache=cache)
        expected = ref(ids, output_attentions=True).attentions  # per layer [B, H, T, T]
    assert paths_taken == ["absorbed"] * TINY.num_hidden_layers
    assert list(auto) == list(fired["naive"]) == list(fired["absorbed"])  # in firing order
    assert sorted(auto) == sorted(ours.hook_names())
    for layer in range(TINY.num_hidden_layers):
        got = auto[f"layers.{layer}.self_attn.hook_pattern"]  # [B, H, 1, 13]
        assert relative_error(got, expected[layer][:, :, 12:]) < 1e-5, layer
