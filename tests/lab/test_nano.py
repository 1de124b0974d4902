"""The bundled K2-nano: it loads offline, it is the K2 architecture, and it learned something."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import k2lab
from k2lab.lab.nano import NANO_DIR
from k2lab.training.train import bits_per_byte, token_stream, unigram_bits_per_byte


@pytest.fixture(scope="module")
def nano():
    return k2lab.load_nano()


def test_load_nano_offline_and_fast():
    """A fresh interpreter loads it offline. How long that takes is measured by ``python -m benchmarks.load_nano``."""
    code = "import k2lab; m, tok = k2lab.load_nano(); print(m.config.vocab_size, tok.vocab_size)"
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    vocab, tok_vocab = out.stdout.split()
    assert int(vocab) == int(tok_vocab) == 8192


def test_nano_keeps_every_k2_switch(nano):
    cfg = nano[0].config
    assert cfg.first_k_dense_replace == 1 and cfg.q_lora_rank and cfg.rope_type == "yarn"
    assert cfg.n_shared_experts == 1 and cfg.num_experts_per_tok >= 2 and cfg.n_routed_experts >= 16
    biases = torch.stack([layer.mlp.gate.e_score_correction_bias for layer in nano[0].layers[1:]])
    assert biases.abs().sum() > 0  # balancing moved the correction bias during training
    assert sum(f.stat().st_size for f in NANO_DIR.iterdir()) < 30e6


def test_heldout_code_beats_the_unigram_baseline(nano):
    model, tok = nano
    heldout = token_stream(tok, "heldout", "code")[: 48 * 256]
    baseline = unigram_bits_per_byte(token_stream(tok, "train"), tok, heldout, seq_len=256)
    bpb = bits_per_byte(model, tok, heldout, seq_len=256)
    assert bpb < baseline - 0.5, (bpb, baseline)


def test_training_log_is_complete():
    log = json.loads((NANO_DIR / "training_log.json").read_text())
    steps = log["steps"]
    assert len(steps) == log["train"]["steps"]
    assert steps[-1]["loss"] < steps[0]["loss"] - 3
    assert len(steps[0]["max_logits"]) == log["model"]["num_hidden_layers"]
    assert len(steps[0]["expert_load"][0]) == log["model"]["n_routed_experts"]


def test_token_healing_repairs_a_prompt_that_ends_mid_token(nano):
    model, tok = nano
    ids = torch.tensor([tok.encode("import ")])
    assert tok.token_bytes(ids[0, -1].item()) == b" "  # a space the tokenizer would have merged into " os"
    healed = k2lab.generate(model, ids, max_new_tokens=4, tokenizer=tok, token_healing=True)
    assert healed.shape == (1, ids.shape[1] - 1 + 4)
    assert tok.decode(healed[0]).startswith("import ")
    # The first new token is the model's best among the tokens that start with the dropped one's bytes.
    with torch.no_grad():
        logits = model(ids[:, :-1])[0, -1]
    candidates = [i for i in range(tok.vocab_size)
                  if tok.token_bytes(i).startswith(b" ") and i not in tok.special_tokens.values()]
    best = candidates[int(logits[candidates].argmax())]
    assert healed[0, ids.shape[1] - 1].item() == best
    assert tok.token_bytes(best) != b" "  # healed: the space now starts a word


def test_token_healing_refuses_what_it_cannot_heal(nano):
    model, tok = nano
    with pytest.raises(ValueError, match="needs the tokenizer"):
        k2lab.generate(model, torch.tensor([[5, 6]]), 2, token_healing=True)
    with pytest.raises(ValueError, match="at least 2"):
        k2lab.generate(model, torch.tensor([[5]]), 2, tokenizer=tok, token_healing=True)
