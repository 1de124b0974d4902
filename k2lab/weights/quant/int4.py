"""INT4 weights as Kimi K2-Thinking releases them: compressed-tensors' ``pack-quantized`` format, symmetric 4-bit
integers in groups of 32 along each row, only the routed experts quantized.

Per quantized [O, I] matrix ``X.weight`` the files hold:
- ``X.weight_packed`` int32 [O, I/8]: nibble k of word j (low bits first) is column 8j + k, stored as q + 8;
- ``X.weight_scale``  bfloat16 [O, I/32]: one scale per row and group of 32 columns;
- ``X.weight_shape``  int32 [2]: [O, I].
W[o, i] = q[o, i] * scale[o, i // 32], q = nibble - 8 in -8..7 (no zero point: symmetric).

config.json's ``quantization_config`` (quant_method ``compressed-tensors``) names the matrices left unquantized in
``ignore``: K2-Thinking's list keeps attention, the shared experts, the dense MLP and the head in bfloat16 (the
embedding, norms and router are not Linears and never quantized), so every routed expert is INT4. As with FP8, a
model holds such matrices either dequantized at load or INT4-resident (``Int4Format.linear`` / ``routed_experts``:
packed values and scales as buffers, dequantized at each use, in one compiled pass off the CPU: fused_dequant.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..schema import TensorSpec
from .base import QuantFormat, Stored, register
from .fused_dequant import in_one_pass

NIBBLES_PER_WORD = 8  # 4-bit values in an int32
_SHIFTS = torch.arange(NIBBLES_PER_WORD, dtype=torch.int32) * 4  # nibble k sits at bits 4k .. 4k+3
# K2-Thinking's ignore list: everything but the routed experts stays bfloat16. ``re:`` entries are regular
# expressions matched at the start of a module name; others are whole names.
K2_THINKING_IGNORE = (
    "lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
)
# The weights scheme k2lab reads, as compressed-tensors writes it (group_size apart, which may vary).
_WEIGHTS_SCHEME = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "dynamic": False}


def pack(values: torch.Tensor) -> torch.Tensor:
    """[..., O, I] integers in -8..7 -> int32 [..., O, I/8]: column 8j + k in nibble k of word j, as q + 8."""
    nibbles = (values.to(torch.int64) + 8).unflatten(-1, (-1, NIBBLES_PER_WORD))  # [..., O, I/8, 8] in 0..15
    words = (nibbles << _SHIFTS.to(nibbles.device, torch.int64)).sum(-1)  # disjoint bits: the sum is the OR
    return (words - (words >= 2**31) * 2**32).to(torch.int32)  # the same 32 bits, read as a signed word


def dequantize(packed: torch.Tensor, scale: torch.Tensor, group_size: int,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(packed [..., O, I/8], scale [..., O, I/g]) -> [..., O, I]: each product is exact in float32 (a 4-bit integer
    times a bfloat16), then rounded once to ``dtype``."""
    # The shifts are made where the values are: copying them from the host would wait for the device at every use.
    shifts = torch.arange(NIBBLES_PER_WORD, dtype=torch.int32, device=packed.device) * 4
    nibbles = (packed[..., None] >> shifts) & 0xF  # [..., O, I/8, 8]: column 8j + k
    weight = nibbles.view(*packed.shape[:-1], -1, group_size).float().sub_(8)  # [..., O, I/g, g] q
    weight.mul_(scale.to(weight.device, torch.float32)[..., None])  # (in place: one float32 buffer)
    return weight.flatten(-2).to(dtype)  # [..., O, I]


@register
@dataclass(frozen=True)
class Int4Format(QuantFormat):
    """compressed-tensors pack-quantized INT4, symmetric, ``group_size`` columns per bfloat16 scale; the Linears
    ``ignore`` names stay unquantized. The default is K2-Thinking's."""

    name: ClassVar[str] = "int4"
    quant_method: ClassVar[str | None] = "compressed-tensors"
    group_size: int = 32
    ignore: tuple[str, ...] = K2_THINKING_IGNORE

    def __post_init__(self) -> None:
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size <= 0 \
                or self.group_size % NIBBLES_PER_WORD:
            raise ValueError(f"INT4 group_size must be a positive multiple of {NIBBLES_PER_WORD}, got "
                             f"{self.group_size!r}")
        object.__setattr__(self, "ignore", tuple(self.ignore))
        if not self.ignores("lm_head"):
            raise ValueError(f"INT4 ignore={list(self.ignore)} quantizes lm_head, which k2lab keeps unquantized")

    def ignores(self, module: str) -> bool:
        """Whether the Linear named ``module`` (``model.layers.1.self_attn.q_a_proj``) stays unquantized."""
        return any(re.match(entry[3:], module) if entry.startswith("re:") else entry == module
                   for entry in self.ignore)

    def quantizes(self, spec: TensorSpec) -> bool:
        """A quantizable matrix is stored as INT4 unless ``ignore`` names its Linear."""
        return spec.quantizable and not self.ignores(spec.name.removesuffix(".weight"))

    def matrix_layout(self, name: str, shape: tuple[int, int]) -> tuple[Stored, ...]:
        """An [O, I] matrix as stored: ``weight_packed`` int32 [O, I/8] (eight 4-bit values a word), ``weight_scale``
        bfloat16 [O, I/group_size], and ``weight_shape`` int32 [2] (not held: checked at load)."""
        O, I = shape
        if I % self.group_size:
            raise ValueError(f"INT4 in groups of {self.group_size}: {name} has {I} input columns, not a multiple")
        return (Stored(name + "_packed", torch.int32, (O, I // NIBBLES_PER_WORD), "_packed"),
                Stored(name + "_scale", torch.bfloat16, (O, I // self.group_size), "_scale"),
                Stored(name + "_shape", torch.int32, (2,), None))

    def quantize(self, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[O, I] float -> (packed, scale, shape): each group's largest magnitude / 7.5 is its scale (rounded to
        bfloat16), as compressed-tensors' min-max observer gives for symmetric 4-bit; values round to nearest, even
        on ties, and clamp to -8..7. For synthetic checkpoints and tests; the release comes quantized."""
        O, I = weight.shape
        self.matrix_layout(name, (O, I))  # checks the group fits
        groups = weight.float().unflatten(-1, (-1, self.group_size))  # [O, I/g, g]
        scale = (groups.abs().amax(-1) / 7.5).clamp(min=torch.finfo(torch.bfloat16).tiny).bfloat16()  # [O, I/g]
        values = (groups / scale.float()[..., None]).round().clamp(-8, 7).flatten(-2)  # [O, I]
        return pack(values), scale, torch.tensor([O, I], dtype=torch.int32)

    def dequantize(self, held: tuple[torch.Tensor, ...], dtype: torch.dtype | None) -> torch.Tensor:
        """(packed [..., O, I/8], scale [..., O, I/group_size]) -> each 4-bit value times its group's scale [..., O, I],
        in ``dtype`` (default bfloat16)."""
        packed, scale = held
        return in_one_pass(dequantize, packed, scale, self.group_size, dtype or torch.bfloat16)  # fused_dequant.py

    def check_unheld(self, spec: TensorSpec, stored: Stored, tensor: torch.Tensor) -> None:
        """``weight_shape`` must be the [O, I] that config.json implies; ValueError naming both otherwise."""
        if tensor.tolist() != list(spec.shape):
            raise ValueError(f"{stored.name} is {tensor.tolist()}, but config.json implies {list(spec.shape)}")

    def quantization_config(self) -> dict[str, Any]:
        """config.json's entry for this format: compressed-tensors, pack-quantized, one group of Linear weights in
        symmetric 4-bit groups, the ``ignore`` list."""
        weights = {**_WEIGHTS_SCHEME, "group_size": self.group_size, "actorder": None, "block_structure": None,
                   "observer": "minmax", "observer_kwargs": {}}
        return {
            "config_groups": {"group_0": {"input_activations": None, "output_activations": None,
                                          "targets": ["Linear"], "weights": weights}},
            "format": "pack-quantized", "ignore": list(self.ignore), "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed",
        }

    @classmethod
    def from_quantization_config(cls, config: dict[str, Any], where: str) -> Int4Format:
        """The format that a compressed-tensors quantization_config describes (group size and ``ignore``); ValueError
        naming any setting k2lab does not implement (another format or status, several groups, weights other than
        symmetric 4-bit integers in groups, activation or KV-cache quantization)."""
        def refuse(what: str) -> ValueError:
            return ValueError(f"{where}: quantization_config {what} is not implemented by k2lab (supported for "
                              "compressed-tensors: format 'pack-quantized', one config group of Linear weights "
                              "int 4-bit symmetric in groups, no activation quantization)")

        groups = config.get("config_groups") or {}
        if config.get("format") != "pack-quantized":
            raise refuse(f"format={config.get('format')!r}")
        if config.get("quantization_status", "compressed") != "compressed":
            raise refuse(f"quantization_status={config.get('quantization_status')!r}")
        if config.get("kv_cache_scheme") is not None:
            raise refuse(f"kv_cache_scheme={config['kv_cache_scheme']!r}")
        if len(groups) != 1:
            raise refuse(f"config_groups with {len(groups)} groups")
        (group,) = groups.values()
        weights = group.get("weights") or {}
        for key, want in _WEIGHTS_SCHEME.items():
            if weights.get(key, want if key == "dynamic" else None) != want:
                raise refuse(f"weights.{key}={weights.get(key)!r}")
        if group.get("format", "pack-quantized") != "pack-quantized" or group.get("targets") != ["Linear"]:
            raise refuse(f"group format={group.get('format')!r} targets={group.get('targets')!r}")
        if group.get("input_activations") is not None or group.get("output_activations") is not None:
            raise refuse("activation quantization")
        if weights.get("actorder") is not None:
            raise refuse(f"weights.actorder={weights['actorder']!r}")
        try:
            return cls(weights.get("group_size"), tuple(config.get("ignore") or ()))
        except ValueError as err:
            raise ValueError(f"{where}: quantization_config: {err}") from err
