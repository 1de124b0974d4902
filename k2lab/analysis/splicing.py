"""Splicing a sparse dictionary into a probe: the model computes through the dictionary's features, which become a
probe of their own.

    with splice(model, "layers.3.hook_resid_post", sae) as features:          # features.name is the new probe
        logits, cache = model.run_with_cache(ids, names=features.name)      # [B, T, d_sae] feature activations
    with splice(model, "layers.3.hook_resid_post", sae, keep_error=True):    # forward unchanged, features visible
        with model.hooks(fwd_hooks=[("layers.3.hook_resid_post.hook_features", steer)]):
            steered = model(ids)                                            # only the edit of the features counts
    with splice(model, ("layers.3.post_attention_layernorm.hook_out", "layers.3.hook_mlp_out"), transcoder):
        ...                                                                  # the MoE's output, from its input

A dictionary is any module with ``encode(x) -> features`` and ``decode(features) -> reconstruction`` over the last
dimension: ``k2lab.analysis.dictionary``'s TopKSAE and Transcoder, or SAELens's ``SAE``. Inside the block the probe's
activation x [..., D] is replaced by

    keep_error=False:  decode(f')                          f = encode(x), f' = f after the features probe's hooks
    keep_error=True:   x + (decode(f') - decode(f))        = decode(f') + (x - decode(f)): the error term kept

so with ``keep_error=True`` and the features untouched the forward is the model's own, bit for bit, while a hook that
edits the features moves the output by exactly what the dictionary says the edit means; gradients reach x as through
the identity and reach the features through the decoder.

Any probe of floating-point activations takes a dictionary over its last axis (the residual stream, the norms'
outputs, attention's latents and heads, the router's logits, each expert's output slot ``mlp.hook_expert_out``, the
logits). Refused, with the reason: index probes (``gate.hook_topk_idx``), read-only ones (``hook_max_logit``: a
replacement would change nothing) and activations that are not finite (``hook_attn_scores``, -inf where masked).
A dictionary whose config says ``reshape_activations="hook_z"`` (SAELens's convention; ``train_sae`` on hook_z makes
one) reads attention's heads together instead: hook_z [..., H, V] flattened to [..., H * V], one feature vector per
token. A dictionary holding a NaN or an infinity is refused, naming the tensor.

The features are the probe ``<probe>.hook_features`` [..., d_sae], a HookPoint added as a child of the probe's own
module for the duration of the block, so ``run_with_cache``, ``model.hooks``, ``interventions.patch`` and nnsight
(``NNsight(model)`` made inside the block: ``m.layers[3].hook_resid_post.hook_features.output``) read and edit it by
name. It fires inside the probe, just before the probe's output. A transcoder reads its input at one probe and
replaces another; its features are ``<write probe>.hook_features`` and fire when the write probe does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..model.hooks import HookPoint, canonical_probe_name

if TYPE_CHECKING:
    from ..model.transformer import K2Model

FEATURES = "hook_features"  # the leaf name of a spliced dictionary's features probe
ProbeSpec = str | tuple[str, str]  # one probe (an SAE), or (read, write) for a transcoder


@contextmanager
def splice(model: K2Model, probe: ProbeSpec, dictionary: nn.Module, keep_error: bool = False) -> Iterator[HookPoint]:
    """Replace ``probe``'s activation by ``dictionary``'s reconstruction inside the block; yields the features probe
    (a HookPoint named ``<probe>.hook_features``). ``probe`` is a probe name, or ``(read_probe, write_probe)`` for a
    transcoder, which encodes the activation of ``read_probe`` (it must fire first) and replaces ``write_probe``'s.
    ``keep_error=True`` adds back the reconstruction error (see the module docstring). The features probe is removed
    on exit, also after an error."""
    _check_dictionary(dictionary, "splice")
    if not isinstance(keep_error, bool):
        raise TypeError(f"keep_error must be True or False, got {keep_error!r}")
    read, write = _probe_pair(model, probe)
    write_point = model.hook_point(write)
    if hasattr(write_point, FEATURES):
        raise RuntimeError(f"{write} already has a dictionary spliced in ({write}.{FEATURES}); exit that splice first")
    d_in, d_out = _widths(dictionary)
    heads, flattens_itself = _reads_heads(dictionary)
    if heads and read != write:
        raise ValueError(f"splice: a dictionary of heads flattened (reshape_activations='hook_z') replaces the probe "
                         f"it reads; got {read} -> {write}")
    parameter = next(iter(dictionary.parameters()), None)  # the dictionary's device and dtype, if it has weights
    read_inputs: list[torch.Tensor] = []  # a transcoder's input, from its read probe to its write probe

    def remember_input(x: torch.Tensor, hook: HookPoint) -> None:
        read_inputs[:] = [x]

    def replace(act: torch.Tensor, hook: HookPoint) -> torch.Tensor:  # [..., D]
        if read == write:
            x = act
        elif read_inputs:
            x = read_inputs.pop()
        else:
            raise RuntimeError(f"splice: the read probe {read} did not fire before the write probe {write} in this "
                               f"forward; a transcoder reads a probe that fires earlier (e.g. "
                               f"layers.3.post_attention_layernorm.hook_out -> layers.3.hook_mlp_out)")
        if not torch.isfinite(x).all():  # -inf at masked attention scores: encode(x) would be NaN
            raise ValueError(f"splice: {read} holds non-finite values, which a dictionary cannot encode (attention "
                             f"scores are -inf where the mask hides a key: splice hook_pattern instead)")
        if heads and (x.dim() < 2 or x.shape[-2] * x.shape[-1] != d_in):
            raise ValueError(f"splice: {read} is {tuple(x.shape)} but the dictionary reads its last two axes "
                             f"flattened (reshape_activations='hook_z') into d_in={d_in}")
        if not heads and d_in is not None and x.shape[-1] != d_in:
            raise ValueError(f"splice: {read} is {x.shape[-1]} wide ({tuple(x.shape)}) but the dictionary encodes "
                             f"d_in={d_in}")
        if parameter is not None:
            x = x.to(parameter.device, parameter.dtype)
        lead = x.shape[:-2] if heads else x.shape[:-1]  # one feature vector per token (heads: not per head)
        features = dictionary.encode(x.flatten(-2) if heads and not flattens_itself else x)  # [..., d_sae]
        if not isinstance(features, torch.Tensor) or features.shape[:-1] != lead:
            got = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
            raise ValueError(f"splice: the dictionary's encode maps {tuple(x.shape)} to {got}; expected "
                             f"{tuple(lead)} + (d_sae,)")

        def decode(f: torch.Tensor) -> torch.Tensor:  # [..., d_sae] -> [..., D], or [..., H, V] for heads
            out = dictionary.decode(f)
            return out.unflatten(-1, x.shape[-2:]) if heads and not flattens_itself else out

        clean = decode(features) if keep_error else None  # [..., D] before any hook edits the features
        # A copy goes to the probe: its hooks (or nnsight) may edit it in place, and ``features`` stays as encoded.
        edited = features_point(features.clone() if keep_error else features)
        recon = decode(edited)  # [..., D]
        if recon.shape != act.shape:
            width = f"d_out={d_out}" if d_out is not None else f"shape {tuple(recon.shape)}"
            raise ValueError(f"splice: the dictionary decodes to {width} but {write} is {act.shape[-1]} wide "
                             f"({tuple(act.shape)})")
        if keep_error:
            return act + (recon - clean).to(act.device, act.dtype)  # the difference first: exactly 0 when unedited
        return recon.to(act.device, act.dtype)

    features_point = HookPoint()
    write_point.add_module(FEATURES, features_point)
    try:
        model.name_hook_points()
        fwd_hooks = [(write, replace)] if read == write else [(read, remember_input), (write, replace)]
        with model.hooks(fwd_hooks=fwd_hooks):
            yield features_point
    finally:
        delattr(write_point, FEATURES)
        model.name_hook_points()


def _probe_pair(model: K2Model, probe: ProbeSpec) -> tuple[str, str]:
    """(read, write) probe names, each an existing probe in k2lab's spelling; a read probe in a later block than its
    write probe is refused here (within a block, the first forward checks the order)."""
    if isinstance(probe, str):
        pair = (probe, probe)
    elif isinstance(probe, tuple | list) and len(probe) == 2 and all(isinstance(p, str) for p in probe):
        pair = tuple(probe)
    else:
        raise TypeError(f"probe must be a probe name or a (read_probe, write_probe) pair of names, got {probe!r}")
    read, write = (canonical_probe_name(name) for name in pair)
    for name in (read, write):
        point = model.hook_point(name)  # raises KeyError with the closest names
        if name.endswith(FEATURES):
            raise ValueError(f"splice: {name} is a spliced dictionary's features probe; splice into a model probe")
        if point.index_bound is not None:
            raise ValueError(f"splice: {name} holds expert indices, not activations; a dictionary encodes a probe of "
                             f"floating-point activations")
    read_only = model.hook_point(write).read_only  # the leaf name of the probe to hook instead, if any
    if read_only is not None:
        instead = f"{write.rpartition('.')[0]}.{read_only}"
        raise ValueError(f"splice: {write} is read-only (the forward computes it only to be read), so a reconstruction "
                         f"there would change nothing; splice {instead} instead")
    if _block_of(read, len(model.layers)) > _block_of(write, len(model.layers)):
        raise ValueError(f"splice: the read probe {read} fires after the write probe {write}; a transcoder reads a "
                         f"probe that fires earlier (e.g. layers.3.post_attention_layernorm.hook_out -> "
                         f"layers.3.hook_mlp_out)")
    return read, write


def _block_of(name: str, num_layers: int) -> int:
    """Where a probe fires, by block: -1 for the embedding, i for ``layers.i.``, num_layers for the head's probes."""
    if name.startswith("embed_tokens."):
        return -1
    match = re.match(r"layers\.(\d+)\.", name)
    return int(match.group(1)) if match else num_layers


def _widths(dictionary: nn.Module) -> tuple[int | None, int | None]:
    """The dictionary's declared input and output widths (``d_in``/``d_out`` attributes, or SAELens's ``cfg``), None
    where it declares none; an SAE's output is as wide as its input."""
    declared = getattr(dictionary, "cfg", dictionary)
    d_in = getattr(declared, "d_in", None)
    return d_in, getattr(declared, "d_out", d_in)


def _check_dictionary(dictionary: nn.Module, where: str) -> None:
    """Refuse what cannot be a dictionary (no encode and decode), and one whose parameters hold a NaN or an infinity,
    naming the tensor."""
    if not (callable(getattr(dictionary, "encode", None)) and callable(getattr(dictionary, "decode", None))):
        raise TypeError(f"dictionary must have encode(x) and decode(features) methods (a TopKSAE, a Transcoder or a "
                        f"SAELens SAE); got {type(dictionary).__name__}")
    if isinstance(dictionary, nn.Module):
        _check_finite({f"the dictionary's {name}": p.detach() for name, p in dictionary.named_parameters()}, where)


def _reads_heads(dictionary: nn.Module) -> tuple[bool, bool]:
    """Whether the dictionary reads a probe's last two axes flattened (its config's reshape_activations is "hook_z",
    SAELens's name: attention's heads [..., H, V] as one vector [..., H * V]), and whether it flattens them itself
    (SAELens's SAE does, in encode, and unflattens in decode; k2lab's leaves it to its callers)."""
    declared = getattr(dictionary, "cfg", dictionary)
    heads = getattr(declared, "reshape_activations", "none") == "hook_z"
    return heads, heads and bool(getattr(dictionary, "hook_z_reshaping_mode", False))


def _check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Raise, naming the tensor, if any of ``tensors`` ({name: tensor}) holds a NaN or an infinity: a dictionary with
    one makes every activation it touches NaN, and every logit after it."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not tensor.is_meta and not bool(tensor.isfinite().all()):
            bad = int((~tensor.isfinite()).sum())
            raise ValueError(f"{where}: {name} holds non-finite values ({bad} of {tensor.numel()} are NaN or "
                             f"infinite); a dictionary with them makes every activation it reconstructs NaN")
