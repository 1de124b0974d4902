"""Every tensor of a K2 checkpoint, computed from the config alone: its release name, shape, component, layer, and
whether it is a matrix that a stored format may quantize.

How a tensor is stored (one bfloat16 tensor, or FP8 values with block scales, or packed INT4 with group scales) is
the stored format's business (``weights/quant``); this module only says what the model needs. Accounting counts
these tensors, the reader checks a checkpoint's headers against them, the writer writes them, in this order.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import torch

from ..config import K2Config
from ..model.moe import CORRECTION_BIAS_DTYPE

COMPONENTS = ("embedding", "attention", "dense_mlp", "routed_experts", "shared_experts", "router", "norms", "head")
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
# One routed expert's matrix as released, one tensor per expert: groups (layer, expert, projection).
EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor, named as released.

    ``quantizable``: a matrix of a Linear (attention, MLPs, experts) that a stored format may quantize; the
    embedding, head, norms and router never are. ``dtype``: a storage dtype the tensor keeps whatever the checkpoint's
    float dtype (the router's correction bias: ``CORRECTION_BIAS_DTYPE``, the Router's rule); None follows
    the checkpoint.
    """

    name: str
    shape: tuple[int, ...]
    component: str
    layer: int | None
    quantizable: bool
    dtype: torch.dtype | None = None

    @property
    def numel(self) -> int:
        """The tensor's number of elements."""
        return math.prod(self.shape)


def expert_tensor(layer: int, expert: int, proj: str) -> str:
    """``model.layers.{layer}.mlp.experts.{expert}.{proj}.weight``: the release's name of one expert matrix."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def _matrix(name: str, out_features: int, in_features: int, component: str, layer: int) -> TensorSpec:
    return TensorSpec(name, (out_features, in_features), component, layer, quantizable=True)


def _vector(name: str, size: int, component: str, layer: int | None) -> TensorSpec:
    return TensorSpec(name, (size,), component, layer, quantizable=False)


def layer_tensors(cfg: K2Config, layer: int) -> list[TensorSpec]:
    """The checkpoint tensors of one block, named as in the release (``model.layers.{i}. ...``)."""
    D, H, p = cfg.hidden_size, cfg.num_attention_heads, f"model.layers.{layer}."
    specs = [
        _vector(p + "input_layernorm.weight", D, "norms", layer),
        _vector(p + "post_attention_layernorm.weight", D, "norms", layer),
    ]
    a = p + "self_attn."
    if cfg.q_lora_rank is None:
        specs.append(_matrix(a + "q_proj.weight", H * cfg.qk_head_dim, D, "attention", layer))
    else:
        specs += [
            _matrix(a + "q_a_proj.weight", cfg.q_lora_rank, D, "attention", layer),
            _vector(a + "q_a_layernorm.weight", cfg.q_lora_rank, "attention", layer),
            _matrix(a + "q_b_proj.weight", H * cfg.qk_head_dim, cfg.q_lora_rank, "attention", layer),
        ]
    specs += [
        _matrix(a + "kv_a_proj_with_mqa.weight", cfg.kv_lora_rank + cfg.qk_rope_head_dim, D, "attention", layer),
        _vector(a + "kv_a_layernorm.weight", cfg.kv_lora_rank, "attention", layer),
        _matrix(a + "kv_b_proj.weight", H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank,
                "attention", layer),
        _matrix(a + "o_proj.weight", D, H * cfg.v_head_dim, "attention", layer),
    ]
    m = p + "mlp."
    if not cfg.is_moe_layer(layer):
        I = cfg.intermediate_size
        return specs + [
            _matrix(m + "gate_proj.weight", I, D, "dense_mlp", layer),
            _matrix(m + "up_proj.weight", I, D, "dense_mlp", layer),
            _matrix(m + "down_proj.weight", D, I, "dense_mlp", layer),
        ]
    I, E = cfg.moe_intermediate_size, cfg.n_routed_experts
    specs.append(TensorSpec(m + "gate.weight", (E, D), "router", layer, quantizable=False))
    if cfg.has_correction_bias:  # the sigmoid router's; DeepSeek-V2's softmax router has none
        specs.append(TensorSpec(m + "gate.e_score_correction_bias", (E,), "router", layer, quantizable=False,
                                dtype=CORRECTION_BIAS_DTYPE))
    for e in range(E):
        specs += [
            _matrix(expert_tensor(layer, e, "gate_proj"), I, D, "routed_experts", layer),
            _matrix(expert_tensor(layer, e, "up_proj"), I, D, "routed_experts", layer),
            _matrix(expert_tensor(layer, e, "down_proj"), D, I, "routed_experts", layer),
        ]
    if cfg.n_shared_experts:
        S = I * cfg.n_shared_experts
        specs += [
            _matrix(m + "shared_experts.gate_proj.weight", S, D, "shared_experts", layer),
            _matrix(m + "shared_experts.up_proj.weight", S, D, "shared_experts", layer),
            _matrix(m + "shared_experts.down_proj.weight", D, S, "shared_experts", layer),
        ]
    return specs


def checkpoint_tensors(cfg: K2Config) -> list[TensorSpec]:
    """Every tensor of a K2 checkpoint for ``cfg``, in model order (as the model needs them: a stored format's
    scales or packing are not listed)."""
    V, D = cfg.vocab_size, cfg.hidden_size
    specs = [TensorSpec("model.embed_tokens.weight", (V, D), "embedding", None, quantizable=False)]
    for layer in range(cfg.num_hidden_layers):
        specs += layer_tensors(cfg, layer)
    specs.append(_vector("model.norm.weight", D, "norms", None))
    specs.append(TensorSpec("lm_head.weight", (V, D), "head", None, quantizable=False))
    return specs


def mtp_tensors(cfg: K2Config) -> list[TensorSpec]:
    """The multi-token-prediction blocks stored after the main ones (DeepSeek-V3: ``model.layers.61.*``), as
    released: each holds eh_proj [D, 2D] (joins the normed hidden state and the normed next-token embedding), enorm,
    hnorm, a whole block, and copies of the embedding and of the head with its norm (``shared_head``). Component
    "mtp"; k2lab counts them but does not load them."""
    V, D = cfg.vocab_size, cfg.hidden_size
    specs = []
    for layer in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        p = f"model.layers.{layer}."
        block = layer_tensors(cfg, layer)
        specs += [dataclasses.replace(s, component="mtp") for s in block] + [
            TensorSpec(p + "embed_tokens.weight", (V, D), "mtp", layer, quantizable=False),
            _vector(p + "enorm.weight", D, "mtp", layer),
            _vector(p + "hnorm.weight", D, "mtp", layer),
            _matrix(p + "eh_proj.weight", D, 2 * D, "mtp", layer),
            _vector(p + "shared_head.norm.weight", D, "mtp", layer),
            TensorSpec(p + "shared_head.head.weight", (V, D), "mtp", layer, quantizable=False),
        ]
    return specs
