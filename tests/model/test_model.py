"""Model behaviour beyond fidelity: input checks, the meta device, the cache object, sampling, loader errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hf_oracle import hf_model
from safetensors.torch import load_file, save_file

import k2lab
from k2lab import K2Config, K2Model

CFG = K2Config.mini().replace(vocab_size=512, num_hidden_layers=3, max_position_embeddings=64, rope_factor=1.0,
                              rope_type=None)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K2Model(CFG).eval()


def test_token_outside_vocabulary_names_id_and_size(model):
    with pytest.raises(ValueError, match=r"token id 512 .* vocabulary of 512"):
        model(torch.tensor([[1, 2, 512]]))
    with pytest.raises(ValueError, match=r"token id -1"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="integer token ids"):
        model(torch.zeros(1, 3))


def test_sequence_longer_than_positions(model):
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.zeros(1, 60, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"60 cached \+ 5 new"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    assert cache.length == 60  # the refused call changed nothing


def test_unknown_attention_path(model):
    with pytest.raises(ValueError, match="attn_impl"):
        model(torch.zeros(1, 3, dtype=torch.long), attn_impl="flash")


def test_cache_holds_only_latents(model):
    cache = model.new_cache(2)
    with torch.no_grad():
        model(torch.zeros(2, 7, dtype=torch.long), cache=cache)
    assert cache.length == 7
    assert cache.latents(0).shape == (2, 7, CFG.kv_lora_rank + CFG.qk_rope_head_dim)
    assert cache.nbytes == 2 * 7 * CFG.num_hidden_layers * (CFG.kv_lora_rank + CFG.qk_rope_head_dim) * 4


def test_kimi_k2_on_meta_device_allocates_nothing():
    # A fresh interpreter, so the peak resident memory belongs to this build alone.
    code = (
        "import resource, torch, k2lab\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "m = k2lab.K2Model(k2lab.K2Config.kimi_k2(), device='meta')\n"
        "assert all(p.is_meta for p in m.parameters())\n"
        "print(sum(p.numel() for p in m.parameters()), "
        "(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) == 1_026_408_232_448 - 60 * 384  # the correction biases are buffers
    assert int(out[1]) < 200 * 2**20


def test_generate_greedy_is_argmax_of_forward(model):
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    out = k2lab.generate(model, ids, max_new_tokens=4)
    seq = ids
    with torch.no_grad():
        for _ in range(4):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_sampling_is_reproducible_and_respects_top_k(model):
    ids = torch.tensor([[3, 1, 4]])
    a = k2lab.generate(model, ids, 6, temperature=1.0, top_k=3, seed=7)
    b = k2lab.generate(model, ids, 6, temperature=1.0, top_k=3, seed=7)
    assert torch.equal(a, b)
    from k2lab.model.generate import sample_next

    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0]])
    draws = {sample_next(logits, 1.0, top_k=2, generator=torch.Generator().manual_seed(s)).item() for s in range(50)}
    assert draws == {1, 2}
    # top_p keeps the smallest head reaching p: probabilities ~[.67, .24, .09]; p=0.5 keeps only the best.
    draws = {sample_next(logits, 1.0, top_p=0.5, generator=torch.Generator().manual_seed(s)).item() for s in range(50)}
    assert draws == {1}


def test_generation_stops_per_row_at_eos(model):
    ids = torch.tensor([[3, 1, 4], [2, 7, 1]])
    free = k2lab.generate(model, ids, max_new_tokens=6)
    eos = free[0, 4].item()  # the second token row 0 would produce
    out = k2lab.generate(model, ids, max_new_tokens=6, eos_token_id=eos)
    row0 = out[0, 3:].tolist()
    stop = row0.index(eos)
    assert all(t == eos for t in row0[stop:])  # padded with eos after stopping
    assert out.shape[1] <= free.shape[1]
    if eos not in free[1, 3:].tolist():
        assert torch.equal(out[1], free[1, : out.shape[1]])


def test_bad_generate_arguments(model):
    ids = torch.tensor([[1, 2]])
    for kwargs, named in [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": 0}, "top_k")]:
        with pytest.raises(ValueError, match=named):
            k2lab.generate(model, ids, 3, **kwargs)


def test_router_bias_stays_float32_in_bfloat16():
    m = K2Model(CFG).to(torch.bfloat16)
    assert m.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert m.layers[1].mlp.gate.weight.dtype == torch.bfloat16
    assert m(torch.tensor([[1, 2, 3]])).dtype == torch.float32


@pytest.fixture()
def saved(tmp_path):
    hf_model(CFG.replace(max_position_embeddings=4096), seed=1).save_pretrained(tmp_path)
    return tmp_path


def test_missing_tensor_is_named(saved):
    file = saved / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        k2lab.load(saved)


def test_shape_disagreeing_with_config_names_both_shapes(saved):
    config = json.loads((saved / "config.json").read_text())
    config["kv_lora_rank"] = 48
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"kv_a_proj_with_mqa\.weight has shape \(80, 256\).*\(64, 256\)"):
        k2lab.load(saved)


def test_malformed_config_in_checkpoint(saved):
    config = json.loads((saved / "config.json").read_text())
    config["num_attention_heads"] = -4
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_attention_heads"):
        k2lab.load(saved)


def test_load_dtype(saved):
    m = k2lab.load(saved, dtype=torch.bfloat16)
    assert m.dtype == torch.bfloat16 and m.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
