"""Text wherever ids go, through the tokenizer the model carries: load_nano, lab.load_model and k2lab.load of a folder
with tokenizer files attach it; to_tokens / to_str_tokens / model(text) / generate(model, text) against the
tokenizer's own encode and decode; encode_padded; a clear error without a tokenizer."""

from __future__ import annotations

import shutil

import pytest
import torch

import k2lab
from k2lab import K2Config, K2Model, lab
from k2lab.lab.nano import NANO_DIR

TEXTS = ["import os\n", "def main(argv):\n    return", "x = 1"]


@pytest.fixture(scope="module")
def nano():
    return k2lab.load_nano()


def test_loaders_attach_the_tokenizer(nano, tmp_path):
    model, tok = nano
    assert model.tokenizer is tok and tok.vocab_size == model.config.vocab_size
    loaded, lab_tok, _ = lab.load_model(lab.LabSettings())
    assert loaded.tokenizer is lab_tok and lab_tok.encode("def f(") == tok.encode("def f(")
    assert k2lab.load(NANO_DIR).tokenizer.encode("x = 1") == tok.encode("x = 1")
    bare = tmp_path / "weights_only"
    shutil.copytree(NANO_DIR, bare, ignore=shutil.ignore_patterns("tiktoken.model", "tokenizer_config.json"))
    assert k2lab.load(bare).tokenizer is None


def test_encode_padded_left_and_right(nano):
    _, tok = nano
    rows = [tok.encode(t) for t in TEXTS]
    width = max(map(len, rows))
    pad = tok.special_tokens["[PAD]"]
    for side in ("left", "right"):
        ids, mask = tok.encode_padded(TEXTS, padding_side=side)
        assert ids.dtype == mask.dtype == torch.long and ids.shape == mask.shape == (3, width)
        for row, expected, m in zip(ids.tolist(), rows, mask.tolist(), strict=True):
            real = [i for i, keep in zip(row, m, strict=True) if keep]
            assert real == expected and all(i == pad for i, keep in zip(row, m, strict=True) if not keep)
            assert m == ([0] * (width - len(expected)) + [1] * len(expected) if side == "left"
                         else [1] * len(expected) + [0] * (width - len(expected)))
    with pytest.raises(ValueError, match="padding_side must be 'left' or 'right'"):
        tok.encode_padded(TEXTS, padding_side="middle")
    with pytest.raises(ValueError, match="non-empty list of strings"):
        tok.encode_padded("one text")


def test_text_goes_where_ids_go(nano):
    model, tok = nano
    ids = torch.tensor([tok.encode(TEXTS[1])])
    assert torch.equal(model.to_tokens(TEXTS[1]), ids)
    assert model.to_str_tokens(TEXTS[1]) == [tok.id_to_piece(i) for i in ids[0].tolist()]
    assert model.to_str_tokens(ids) == model.to_str_tokens(ids[0]) == model.to_str_tokens(TEXTS[1])
    with torch.no_grad():
        assert torch.equal(model(TEXTS[1]), model(ids))
        batch_ids, mask = tok.encode_padded(TEXTS)
        assert torch.equal(model(TEXTS), model(batch_ids, attention_mask=mask))
        assert torch.equal(model(TEXTS, return_type="loss"), model(batch_ids, attention_mask=mask, return_type="loss"))


def test_generate_on_text_returns_the_full_text(nano):
    model, tok = nano
    out = k2lab.generate(model, TEXTS[1], max_new_tokens=8)
    ids = k2lab.generate(model, torch.tensor([tok.encode(TEXTS[1])]), max_new_tokens=8)[0].tolist()
    eos = model.config.eos_token_id
    ids = ids[: ids.index(eos)] if eos in ids else ids
    assert isinstance(out, str) and out.startswith(TEXTS[1]) and out == tok.decode(ids)
    batch = k2lab.generate(model, TEXTS, max_new_tokens=8)  # a left-padded batch
    assert batch == [k2lab.generate(model, t, max_new_tokens=8) for t in TEXTS]


def test_text_without_a_tokenizer_says_how_to_attach_one():
    model = K2Model(K2Config.mini().replace(vocab_size=512, num_hidden_layers=1))
    for call in (lambda: model("def f("), lambda: model.to_tokens("x"), lambda: k2lab.generate(model, "x", 2)):
        with pytest.raises(ValueError, match=r"has none attached.*model.tokenizer = k2lab.load_tokenizer\(path"):
            call()
