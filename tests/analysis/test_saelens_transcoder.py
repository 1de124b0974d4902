"""k2lab's TopK transcoders in SAELens (dictionary.to_saelens): the converted module computes what k2lab's does and
splices into K2-nano alike; the stated limit, that SAELens saves it as a ReLU transcoder, holds."""

from __future__ import annotations

import pytest
import torch

from k2lab.analysis import dictionary as dl
from k2lab.analysis.splicing import splice

sae_lens = pytest.importorskip("sae_lens", reason="sae-lens is an optional test dependency")
pytestmark = pytest.mark.usefixtures("no_grad")


def test_a_converted_transcoder_computes_what_k2labs_does_and_splices_alike():
    import k2lab

    model, tok = k2lab.load_nano()
    ours = dl.load_shipped("transcoder_nano_l4_moe")
    theirs = dl.to_saelens(ours)
    assert isinstance(theirs, sae_lens.Transcoder)
    assert theirs.cfg.metadata.hook_name_out == "layers.4.hook_mlp_out" and theirs.cfg.d_out == 128
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(theirs.encode(x), ours.encode(x))
    assert int((theirs.encode(x) > 0).sum(-1).max()) <= ours.k
    ids = torch.tensor([tok.encode("def f(x):\n    return [x, x + 1]\n")])
    with splice(model, ours.probe, ours):
        want = model(ids)
    with splice(model, ours.probe, theirs):
        got = model(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_converted_sae_is_saelens_topk_sae():
    sae = dl.load_shipped("sae_nano_l3_resid_post")
    theirs = dl.to_saelens(sae)
    assert isinstance(theirs, sae_lens.TopKSAE)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(theirs.decode(theirs.encode(x)), sae(x))


def test_the_stated_limit_saelens_reloads_a_saved_transcoder_as_relu(tmp_path):
    ours = dl.load_shipped("transcoder_nano_l4_moe")
    dl.to_saelens(ours).save_model(tmp_path)
    reloaded = sae_lens.SAE.load_from_disk(tmp_path)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(2))
    assert (reloaded.encode(x) > 0).sum(-1).min() > ours.k  # every positive pre-activation fires, not only k
    back = dl.to_saelens(dl.load(ours.save(tmp_path / "k2lab")))  # k2lab's folder keeps k
    torch.testing.assert_close(back.encode(x), ours.encode(x))


def test_to_saelens_refuses_what_is_not_a_k2lab_dictionary():
    with pytest.raises(TypeError, match="converts k2lab's TopKSAE and Transcoder"):
        dl.to_saelens(torch.nn.Linear(2, 2))
