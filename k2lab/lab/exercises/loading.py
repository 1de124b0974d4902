"""08: loading the release yourself. FP8 e4m3 weights with their 128 x 128 block scales (``check_dequantize``), and
the release's tensors, one per expert, as K2Model's state dict with each layer's experts stacked
(``check_release_state_dict``), against ``k2lab.load``."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ...config import K2Config
from ...model import K2Model
from ...weights.quant.fp8 import FP8, dequantize, quantize, to_float32
from ...weights.schema import EXPERT_TENSOR
from .checking import Verdict, call, checker, compare, generator

BLOCK = (128, 128)


def _blockwise(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Each block's scale spread over its block [A, B], cropped at the edges."""
    return scale.repeat_interleave(BLOCK[0], 0)[: shape[0]].repeat_interleave(BLOCK[1], 1)[:, : shape[1]]


@checker
def check_dequantize(fn: Callable) -> Verdict:
    """``fn(weight [A, B] float8_e4m3fn, scale_inv [ceil(A/128), ceil(B/128)] float32) -> [A, B] float32``: the
    release's FP8 weight as numbers, each 128 x 128 block's e4m3 values multiplied by its ``weight_scale_inv``
    (DeepSeek's ``weight_dequant``; the name says the stored scale is the inverse of the one that quantised). The
    matrices' sides are not all multiples of 128: the blocks at the edges are cut (as K2's kv_a_proj_with_mqa,
    576 rows, is)."""
    g = generator(81)
    for shape in ((300, 200), (256, 384)):
        values, scale_inv = quantize(torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g), BLOCK)
        scale_inv = scale_inv * torch.linspace(0.5, 4.0, scale_inv.numel()).view_as(scale_inv)  # every block its own
        expected = dequantize(values, scale_inv, BLOCK, torch.float32)
        out, error = call(fn, values.clone(), scale_inv.clone())
        if error is not None:
            return error
        grid = f"{scale_inv.shape[0]} x {scale_inv.shape[1]} blocks"
        what = f"dequantisation of a {shape[0]} x {shape[1]} weight ({grid})"
        if isinstance(out, torch.Tensor) and out.dtype == FP8:
            return Verdict(False, f"{what}: you returned e4m3 values; return float32 numbers (values.float() times "
                                  f"their block's scale)")
        raw = to_float32(values)
        tiled = scale_inv.repeat(*BLOCK)  # the whole grid, 128 times in each direction
        mistakes = [
            ("weight_scale_inv is MULTIPLIED: the weight is e4m3 value x scale_inv (the name says the stored number "
             "is the inverse of the scale that quantised it)", raw / _blockwise(scale_inv, shape)),
            ("you forgot the scales: each e4m3 value times its block's weight_scale_inv", raw),
            ("you read the e4m3 bytes as integers (a uint8 view): convert the values with .float(), which decodes "
             "e4m3", values.view(torch.uint8).float() * _blockwise(scale_inv, shape)),
            ("your scales repeat the whole grid (repeat / tile) instead of covering one 128 x 128 block each: spread "
             "each scale over its block (repeat_interleave), row blocks and column blocks",
             raw * tiled[: shape[0], : shape[1]]),
            ("you rounded to bfloat16; this check asks for float32 (cast afterwards, once, if you want bfloat16)",
             expected.bfloat16().float()),
            ("you used the first block's scale for every block", raw * scale_inv[0, 0]),
        ]
        verdict = compare(what, out, expected, mistakes, atol=0, rtol=1e-6)
        if not verdict.ok:
            return verdict
    return Verdict(True, "dequantisation: matches k2lab's FP8 reader on a matrix with cut edge blocks and one of "
                         "whole blocks")


def _release(cfg: K2Config, seed: int) -> tuple[dict[str, torch.Tensor], Path, tempfile.TemporaryDirectory]:
    """A random K2 of ``cfg`` in the release's format: its tensors by release name, as a reader gets them from
    the shards (sorted by name), and the same written to a folder that ``k2lab.load`` reads."""
    from ...weights.writer import save_checkpoint

    model = K2Model(cfg)
    model.init_weights(std=0.3, seed=seed)
    g = generator(seed)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            if cfg.is_moe_layer(i):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts, generator=g) * 0.1)
            for name, p in layer.named_parameters():
                if name.endswith("layernorm.weight"):
                    p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    tmp = tempfile.TemporaryDirectory(prefix="k2lab-release-check-")
    folder = save_checkpoint(model, Path(tmp.name))  # FP8 in 128 x 128 blocks, one tensor per expert
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return dict(sorted(tensors.items())), folder, tmp


def _stacked_in_string_order(expected: dict[str, torch.Tensor], cfg: K2Config) -> dict[str, torch.Tensor]:
    """The state dict with each layer's experts stacked in the order their names sort as text (0, 1, 10, 11, 2...)."""
    order = sorted(range(cfg.n_routed_experts), key=str)
    return {n: (t[order] if ".mlp.experts." in n else t) for n, t in expected.items()}


@checker
def check_release_state_dict(fn: Callable, dtype: torch.dtype = torch.float32) -> Verdict:
    """``fn(tensors: dict[str, Tensor], cfg: K2Config, dtype) -> dict[str, Tensor]``: the release's tensors
    (``model.``-prefixed names, FP8 matrices with ``<name>_scale_inv``, one tensor per routed expert,
    ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``) as K2Model's state dict in ``dtype``: names
    without ``model.``, no scales, each MoE layer's experts stacked in expert order (``layers.{i}.mlp.experts.
    gate_proj`` [E, I, D], ``up_proj`` [E, I, D], ``down_proj`` [E, D, I]), and the router's correction bias kept
    in float32 whatever ``dtype`` (its differences decide the choice). Checked against ``k2lab.load`` on a small K2
    of 12 experts written in the release's format, in float32 and in bfloat16."""
    cfg = K2Config.nano().replace(num_hidden_layers=2, vocab_size=64, n_routed_experts=12, num_experts_per_tok=3,
                                  bos_token_id=None, eos_token_id=None)
    tensors, folder, tmp = _release(cfg, seed=82)
    with tmp:
        from ...weights.load import load

        for want in (torch.float32, torch.bfloat16):
            expected = load(folder, dtype=want).state_dict()
            out, error = call(fn, dict(tensors), cfg, want)
            if error is not None:
                return error
            verdict = _judge_state_dict(out, expected, tensors, cfg, want)
            if not verdict.ok:
                return verdict
    return Verdict(True, f"the release as a state dict: every one of K2Model's {len(expected)} tensors matches "
                         f"k2lab.load's, in float32 and in bfloat16, experts stacked in expert order")


def _judge_state_dict(out: object, expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                      cfg: K2Config, dtype: torch.dtype) -> Verdict:
    what = f"the release as a state dict ({str(dtype).removeprefix('torch.')})"
    if not isinstance(out, dict):
        return Verdict(False, f"{what}: return a dict of tensors, got {type(out).__name__}")
    keys = set(out)
    prefixed = [k for k in keys if k.startswith("model.")]
    if prefixed:
        message = f"K2Model's names have no leading `model.` (you kept it, as in {prefixed[0]!r})"
        return Verdict(False, f"{what}: {message}", mistake=message)
    scales = [k for k in keys if k.endswith("_scale_inv")]
    if scales:
        message = (f"the scales are not weights of the model: multiply each FP8 matrix by its scale and drop "
                   f"{scales[0]!r} and the others")
        return Verdict(False, f"{what}: {message}", mistake=message)
    per_expert = [k for k in keys if EXPERT_TENSOR.fullmatch("model." + k)]
    if per_expert:
        message = (f"K2Model holds each layer's experts stacked: layers.i.mlp.experts.gate_proj [E, I, D] (and "
                   f"up_proj, down_proj), not one tensor per expert as {per_expert[0]!r}")
        return Verdict(False, f"{what}: {message}", mistake=message)
    missing, extra = sorted(set(expected) - keys), sorted(keys - set(expected))
    if missing or extra:
        return Verdict(False, f"{what}: the names differ from K2Model's: missing {missing[:3]}, unexpected "
                              f"{extra[:3]}")
    string_order = _stacked_in_string_order(expected, cfg)
    for name in expected:
        got = out[name]
        if not isinstance(got, torch.Tensor):
            return Verdict(False, f"{what}: {name} is a {type(got).__name__}, not a tensor")
        if got.shape != expected[name].shape:
            hint = " (the experts are stacked along a new first axis, [E, ...])" if ".experts." in name else ""
            return Verdict(False, f"{what}: {name} has shape {list(got.shape)}, expected "
                                  f"{list(expected[name].shape)}{hint}")
        want = expected[name].dtype
        if got.dtype != want:
            if name.endswith("e_score_correction_bias"):
                message = ("the router's correction bias stays float32 in every K2 (the release stores it so, and "
                           "k2lab keeps it so): its small differences decide which experts are chosen")
                return Verdict(False, f"{what}: {message}", mistake=message)
            return Verdict(False, f"{what}: {name} is {got.dtype}, asked for {want}")
        mistakes = [("the experts are stacked in the order their names sort as text (0, 1, 10, 11, 2, ...): stack "
                     "them by expert number, range(E)", string_order[name])]
        if name + "_scale_inv" in {k.removeprefix("model.") for k in tensors} or ".experts." in name:
            source = _raw_values(name, tensors, cfg)
            mistakes.append(("you forgot the block scales: multiply each e4m3 value by its 128 x 128 block's "
                             "weight_scale_inv", source.to(want)))
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        verdict = compare(f"{what}, {name}", got.float(), expected[name].float(),
                          [(m, c.float()) for m, c in mistakes], atol=tol, rtol=tol)
        if not verdict.ok:
            return verdict
    return Verdict(True, what)


def _raw_values(name: str, tensors: dict[str, torch.Tensor], cfg: K2Config) -> torch.Tensor:
    """The FP8 values of a state-dict tensor without their scales (stacked for the experts)."""
    if ".mlp.experts." in name:
        layer, proj = name.split(".")[1], name.rsplit(".", 1)[1]
        return torch.stack([to_float32(tensors[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"])
                            for e in range(cfg.n_routed_experts)])
    return to_float32(tensors["model." + name])

