"""nnsight interop: ``nnsight.NNsight(model)`` reads and edits module outputs of a K2Model (optional dependency,
tested with nnsight 0.8.1)."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import relative_error

nnsight = pytest.importorskip("nnsight", reason="nnsight is an optional test dependency (pip install nnsight)")


def test_nnsight_reads_and_edits_mlp_outputs(model, ids):
    with torch.no_grad():
        plain, cache = model.run_with_cache(ids, names="hook_mlp_out")
        with model.hooks(fwd_hooks=[("layers.1.hook_mlp_out", lambda t, hook: torch.zeros_like(t))]):
            zeroed = model(ids)
    wrapped = nnsight.NNsight(model)
    with torch.no_grad():
        with wrapped.trace(ids):
            read = wrapped.layers[2].mlp.output.save()
            logits = wrapped.output.save()
        with wrapped.trace(ids):
            wrapped.layers[1].mlp.output[:] = 0
            edited = wrapped.output.save()
    # To float32 rounding, not bit for bit: inside an nnsight trace every probe is live, so attention takes the
    # explicit scores where a plain prefill takes the fused kernel (attn_impl="auto" picks the expanded path).
    torch.testing.assert_close(read, cache["layers.2.hook_mlp_out"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, plain, rtol=1e-5, atol=1e-5)
    assert relative_error(edited, zeroed) < 1e-6
    assert relative_error(edited, plain) > 1e-3
