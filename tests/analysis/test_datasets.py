"""Data sets through the model: ``analysis.batches`` (padded batches of a list of texts), ``routing.trace_dataset``,
and what a pooled trace offers a researcher (``RoutingTrace.select`` by token class, ``to_dataframe``). Every
expectation is rebuilt here from the tokenizer's own encoding and the router's probes."""

from __future__ import annotations

import sys

import pytest
import torch
from tiny import TINY, random_model

import k2lab
from k2lab.analysis import batches
from k2lab.analysis.routing import expert_counts, select_experts, trace, trace_dataset

pytestmark = pytest.mark.usefixtures("no_grad")

TEXTS = ["import os\n", "def main(argv):\n    return argv[0]\n", "x = 1", "The cat sat on the mat.",
         "for i in range(10):\n    print(i * i)\n", "ok"]


@pytest.fixture(scope="module")
def nano():
    return k2lab.load_nano()


def _rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's real tokens, in order."""
    return [row[keep.bool()].tolist() for row, keep in zip(ids, mask, strict=True)]


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("max_len", [None, 5])
def test_batches_hold_each_texts_first_tokens_in_order_padded_on_the_side_asked(nano, padding_side, max_len):
    model, tok = nano
    encoded = [tok.encode(text)[:max_len] for text in TEXTS]  # what each row must hold
    got = list(batches(model, TEXTS, batch_size=4, max_len=max_len, padding_side=padding_side, progress=False))
    assert [len(ids) for ids, _ in got] == [4, 2]  # the last batch holds what is left
    for b, (ids, mask) in enumerate(got):
        expected = encoded[4 * b: 4 * b + 4]
        assert ids.shape == mask.shape == (len(expected), max(len(row) for row in expected))
        assert ids.device == mask.device == model.device
        assert _rows(ids, mask) == expected
        for row, keep in zip(expected, mask.tolist(), strict=True):  # pads on the side asked for, tokens together
            pads = [0] * (ids.shape[1] - len(row))
            assert keep == (pads + [1] * len(row) if padding_side == "left" else [1] * len(row) + pads)
    if max_len is not None:
        assert any(len(tok.encode(text)) > max_len for text in TEXTS)  # some texts were cut, some not
        assert any(len(tok.encode(text)) < max_len for text in TEXTS)


def test_batches_check_their_arguments_before_the_first_batch(nano):
    model, _ = nano
    wrong = [
        (dict(texts=[]), ValueError, "texts is empty"),
        (dict(texts="import os"), TypeError, "one text goes in as \\[text\\]"),
        (dict(texts=["a", 3]), TypeError, r"texts\[1\] is int 3"),
        (dict(texts=["a", ""]), ValueError, r"texts\[1\] is an empty string"),
        (dict(batch_size=0), ValueError, "batch_size must be a positive integer, got 0"),
        (dict(batch_size=-2), ValueError, "batch_size must be a positive integer, got -2"),
        (dict(batch_size=2.0), ValueError, "batch_size must be a positive integer, got 2.0"),
        (dict(batch_size=True), ValueError, "batch_size must be a positive integer, got True"),
        (dict(max_len=0), ValueError, "max_len must be None .* or a positive integer, got 0"),
        (dict(padding_side="middle"), ValueError, "padding_side must be 'left' or 'right', got 'middle'"),
        (dict(progress="yes"), ValueError, "progress must be None .* True or False, got 'yes'"),
    ]
    for kwargs, error, message in wrong:
        with pytest.raises(error, match=message):
            batches(model, **{"texts": TEXTS, **kwargs})  # not iterated: the check comes first
    with pytest.raises(ValueError, match="batches needs a tokenizer .* model.tokenizer = k2lab.load_tokenizer"):
        batches(random_model(TINY), TEXTS)


def test_the_progress_bar_counts_texts_and_shows_by_default_only_for_several_batches(nano, capsys):
    model, _ = nano
    shown = {}
    for progress, batch_size in [(None, 4), (None, len(TEXTS)), (True, len(TEXTS)), (False, 4)]:
        list(batches(model, TEXTS, batch_size=batch_size, progress=progress))
        shown[progress, batch_size] = capsys.readouterr().err
    assert f"{len(TEXTS)}/{len(TEXTS)}" in shown[None, 4] and f"{len(TEXTS)}/{len(TEXTS)}" in shown[True, len(TEXTS)]
    assert shown[None, len(TEXTS)] == shown[False, 4] == ""


@pytest.mark.parametrize("max_len", [None, 6])
def test_trace_dataset_is_the_per_batch_traces_one_text_per_row(nano, max_len):
    model, tok = nano
    pooled = trace_dataset(model, TEXTS, batch_size=4, max_len=max_len, progress=False)
    lengths = [min(len(tok.encode(text)), max_len or 10**9) for text in TEXTS]
    assert pooled.indices.shape[1:3] == (len(TEXTS), max(lengths))
    expected_mask = torch.tensor([[t < n for t in range(max(lengths))] for n in lengths])  # right-padded rows
    assert torch.equal(pooled.real_tokens(), expected_mask)
    for start in (0, 4):  # each batch traced on its own, then compared text by text
        chunk = [tok.encode(text)[:max_len] for text in TEXTS[start:start + 4]]
        width = max(len(row) for row in chunk)
        ids = torch.tensor([row + [0] * (width - len(row)) for row in chunk])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in chunk])
        alone = trace(model, ids, attention_mask=mask)
        for i, row in enumerate(chunk):
            n = len(row)
            assert pooled.token_ids[start + i, :n].tolist() == row
            for field in ("indices", "weights", "scores", "choice_scores", "unbiased_indices", "bias_flips"):
                assert torch.equal(getattr(pooled, field)[:, start + i, :n], getattr(alone, field)[:, i, :n]), field
    k = model.config.num_experts_per_tok
    assert (expert_counts(pooled).sum(-1) == sum(lengths) * k).all()  # pads counted nowhere


def test_select_splits_a_trace_by_token_class(nano):
    model, _ = nano
    tr = trace_dataset(model, TEXTS, batch_size=4, progress=False)
    even = tr.token_ids % 2 == 0  # [B, T] a token class; pads (positions past a text's end) included on purpose
    picked, rest = tr.select(even), tr.select(~even)
    real = tr.real_tokens()
    assert torch.equal(picked.real_tokens(), even & real) and torch.equal(rest.real_tokens(), ~even & real)
    for part, keep in ((picked, even & real), (rest, ~even & real)):  # counts by hand over the class's tokens
        E = tr.scores.shape[-1]
        by_hand = torch.stack([torch.bincount(tr.indices[j][keep].flatten(), minlength=E)
                               for j in range(len(tr.layers))])
        assert torch.equal(expert_counts(part), by_hand)
    assert torch.equal(expert_counts(picked) + expert_counts(rest), expert_counts(tr))
    assert picked.indices is tr.indices and picked.token_ids is tr.token_ids  # shared, not copied
    assert torch.equal(tr.select(even.long()).real_tokens(), picked.real_tokens())  # 0/1 works as bool


def test_select_refuses_a_mask_that_does_not_fit_or_picks_nothing(nano):
    model, _ = nano
    tr = trace_dataset(model, TEXTS[:2], progress=False)
    B, T = tr.indices.shape[1:3]
    with pytest.raises(ValueError, match=rf"token_mask must be bool or 0/1 \[B, T\] = \[{B}, {T}\].*\[{B}, {T + 1}\]"):
        tr.select(torch.ones(B, T + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="token_mask must be bool or 0/1 .* torch.float32"):
        tr.select(torch.ones(B, T))
    with pytest.raises(ValueError, match="values other than 0 and 1: \\[2\\]"):
        tr.select(torch.full((B, T), 2))
    with pytest.raises(ValueError, match="picks none of the trace's .* real tokens"):
        tr.select(~tr.real_tokens())  # only pads


def test_to_dataframe_is_one_row_per_real_token_layer_and_slot_as_the_router_probes_say(nano):
    model, tok = nano
    texts = TEXTS[:4]
    ids, mask = tok.encode_padded(texts, padding_side="right")
    _, cache = model.run_with_cache(ids, attention_mask=mask, names=".mlp.gate.")
    df = trace(model, ids, attention_mask=mask).to_dataframe()
    cfg = model.config
    layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    k = cfg.num_experts_per_tok
    assert list(df.columns) == ["sequence", "position", "layer", "slot", "token_id", "expert", "weight", "score",
                                "choice_score", "bias_chosen"]
    expected = []  # (sequence, position, layer, slot, token id, expert, weight, score, choice score, bias chosen)
    for b, text in enumerate(texts):
        for t, token in enumerate(tok.encode(text)):
            for layer in layers:
                gate = f"layers.{layer}.mlp.gate."
                scores = cache[gate + "hook_scores"][b, t]
                unbiased = set(select_experts(scores, k, cfg.n_group, cfg.topk_group).tolist())
                for slot in range(k):
                    e = int(cache[gate + "hook_topk_idx"][b, t, slot])
                    expected.append((b, t, layer, slot, token, e, float(cache[gate + "hook_topk_weights"][b, t, slot]),
                                     float(scores[e]), float(cache[gate + "hook_choice_scores"][b, t, e]),
                                     e not in unbiased))
    assert len(df) == len(expected) == int(mask.sum()) * len(layers) * k  # pads excluded
    rows = list(df.itertuples(index=False))
    for got, want in zip(rows, expected, strict=True):
        assert tuple(got[:6]) == want[:6] and bool(got[9]) == want[9]
        assert got[6:9] == pytest.approx(want[6:9], rel=1e-6)
    assert df["bias_chosen"].any() and not df["bias_chosen"].all()


def test_to_dataframe_names_the_lab_extra_when_pandas_is_missing(nano, monkeypatch):
    model, _ = nano
    tr = trace(model, "x = 1")
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas now raises ImportError
    with pytest.raises(ImportError, match=r'to_dataframe needs pandas.*pip install "k2lab\[lab\]"'):
        tr.to_dataframe()


def test_a_trace_of_padded_ids_without_a_mask_counts_no_pad(nano):
    """Ids padded by the tokenizer but given with no mask: the pads at the rows' edges are found
    (``model.infer_attention_mask``), so the trace matches the one given the tokenizer's mask; a mask given
    explicitly is used as it is."""
    model, tok = nano
    for padding_side in ("left", "right"):
        ids, mask = tok.encode_padded(TEXTS[:3], padding_side=padding_side)
        assert not mask.all()
        inferred, given = trace(model, ids), trace(model, ids, attention_mask=mask)
        assert torch.equal(inferred.real_tokens(), mask.bool())
        assert torch.equal(inferred.indices, given.indices) and torch.equal(inferred.scores, given.scores)
    everything = torch.ones_like(mask)  # the caller says the pad ids are tokens: the explicit mask wins
    assert trace(model, ids, attention_mask=everything).real_tokens().all()
    unpadded = trace(model, ids[1:2, : int(mask[1].sum())])  # no pad anywhere
    assert unpadded.token_mask is None
