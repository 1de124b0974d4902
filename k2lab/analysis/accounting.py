"""Parameters, weight bytes and KV-cache bytes of a K2 configuration, computed from the config alone.

Everything derives from one list, ``checkpoint_tensors(cfg)``: every tensor of the released checkpoint with
its name, shape, component and storage format, so the counts can be checked against a checkpoint's headers
and the loader can check shapes against the same source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..config import K2Config

COMPONENTS = ("embedding", "attention", "dense_mlp", "routed_experts", "shared_experts", "router", "norms", "head")


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor. ``fp8``: stored as e4m3 with 128x128 float32 scales in the FP8 release."""

    name: str
    shape: tuple[int, ...]
    component: str
    layer: int | None
    fp8: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _matrix(name, out_features, in_features, component, layer) -> TensorSpec:
    return TensorSpec(name, (out_features, in_features), component, layer, fp8=True)


def layer_tensors(cfg: K2Config, layer: int) -> list[TensorSpec]:
    """The checkpoint tensors of one block, named as in the release (``model.layers.{i}. ...``)."""
    D, H, p = cfg.hidden_size, cfg.num_attention_heads, f"model.layers.{layer}."
    specs = [
        TensorSpec(p + "input_layernorm.weight", (D,), "norms", layer, False),
        TensorSpec(p + "post_attention_layernorm.weight", (D,), "norms", layer, False),
    ]
    a = p + "self_attn."
    if cfg.q_lora_rank is None:
        specs.append(_matrix(a + "q_proj.weight", H * cfg.qk_head_dim, D, "attention", layer))
    else:
        specs += [
            _matrix(a + "q_a_proj.weight", cfg.q_lora_rank, D, "attention", layer),
            TensorSpec(a + "q_a_layernorm.weight", (cfg.q_lora_rank,), "attention", layer, False),
            _matrix(a + "q_b_proj.weight", H * cfg.qk_head_dim, cfg.q_lora_rank, "attention", layer),
        ]
    specs += [
        _matrix(a + "kv_a_proj_with_mqa.weight", cfg.kv_lora_rank + cfg.qk_rope_head_dim, D, "attention", layer),
        TensorSpec(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,), "attention", layer, False),
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
    I = cfg.moe_intermediate_size
    specs += [
        TensorSpec(m + "gate.weight", (cfg.n_routed_experts, D), "router", layer, False),
        TensorSpec(m + "gate.e_score_correction_bias", (cfg.n_routed_experts,), "router", layer, False),
    ]
    for e in range(cfg.n_routed_experts):
        x = f"{m}experts.{e}."
        specs += [
            _matrix(x + "gate_proj.weight", I, D, "routed_experts", layer),
            _matrix(x + "up_proj.weight", I, D, "routed_experts", layer),
            _matrix(x + "down_proj.weight", D, I, "routed_experts", layer),
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
    """Every tensor of a K2 checkpoint for ``cfg``, in model order (FP8 scales not included)."""
    V, D = cfg.vocab_size, cfg.hidden_size
    specs = [TensorSpec("model.embed_tokens.weight", (V, D), "embedding", None, False)]
    for layer in range(cfg.num_hidden_layers):
        specs += layer_tensors(cfg, layer)
    specs.append(TensorSpec("model.norm.weight", (D,), "norms", None, False))
    specs.append(TensorSpec("lm_head.weight", (V, D), "head", None, False))
    return specs


@dataclass(frozen=True)
class ParameterCount:
    """Parameter totals. ``active``: what one token uses (k of E routed experts per MoE block)."""

    total: int
    active: int
    components: dict[str, int] = field(default_factory=dict)
    active_components: dict[str, int] = field(default_factory=dict)

    @property
    def active_without_embeddings(self) -> int:
        """Active parameters less the embedding table and the head (30.5 B for K2)."""
        return self.active - self.components["embedding"] - self.components["head"]

    def table(self) -> list[tuple[str, int, int]]:
        """(component, total, active) rows, for printing or a notebook table."""
        return [(c, self.components[c], self.active_components[c]) for c in COMPONENTS]


def count_parameters(cfg: K2Config) -> ParameterCount:
    """Total and per-token active parameters, by component (router includes the correction biases)."""
    _check_cfg(cfg)
    components = dict.fromkeys(COMPONENTS, 0)
    for spec in checkpoint_tensors(cfg):
        components[spec.component] += spec.numel
    active = dict(components)
    active["routed_experts"] = components["routed_experts"] * cfg.num_experts_per_tok // cfg.n_routed_experts
    return ParameterCount(sum(components.values()), sum(active.values()), components, active)


def block_parameters(cfg: K2Config, layer: int) -> int:
    """Parameters of one block (497,500,160 for K2's dense block 0)."""
    _check_cfg(cfg)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < cfg.num_hidden_layers:
        raise ValueError(f"layer must be an integer in 0..{cfg.num_hidden_layers - 1}, got {layer!r}")
    return sum(spec.numel for spec in layer_tensors(cfg, layer))


def attention_parameters(cfg: K2Config) -> int:
    """Parameters of one MLA (101,124,096 for K2), latent norms included."""
    return sum(spec.numel for spec in layer_tensors(cfg, 0) if spec.component == "attention")


def _fp8_scale_numel(spec: TensorSpec, block: tuple[int, int]) -> int:
    return math.ceil(spec.shape[0] / block[0]) * math.ceil(spec.shape[1] / block[1])


def tensor_bytes(spec: TensorSpec, fp8: bool = True, dtype: torch.dtype = torch.bfloat16,
                 scales: bool = False, block: tuple[int, int] = (128, 128)) -> int:
    """Bytes one tensor takes: 1 per FP8 value (+ float32 block scales if ``scales``), the correction bias in
    float32, everything else in ``dtype``."""
    if not isinstance(spec, TensorSpec):
        raise TypeError(f"spec must be a TensorSpec (from checkpoint_tensors(cfg)), got {type(spec).__name__}")
    _check_dtype(dtype)
    if spec.name.endswith("e_score_correction_bias"):
        return spec.numel * 4
    if fp8 and spec.fp8:
        return spec.numel + (4 * _fp8_scale_numel(spec, block) if scales else 0)
    return spec.numel * torch.empty((), dtype=dtype).element_size()


def weight_bytes(cfg: K2Config, fp8: bool = True, dtype: torch.dtype = torch.bfloat16, scales: bool = False) -> int:
    """Bytes of all weights. ``fp8=True``: the release's FP8 matrices; embedding, head, norms and router in
    ``dtype`` (958.3 GiB for K2; block scales excluded unless ``scales=True``)."""
    _check_cfg(cfg)
    _check_dtype(dtype)
    block = cfg.fp8_block_size or (128, 128)
    return sum(tensor_bytes(s, fp8, dtype, scales, block) for s in checkpoint_tensors(cfg))


def kv_cache_bytes(cfg: K2Config, n_tokens: int, layout: str = "latent", dtype: torch.dtype = torch.bfloat16,
                   batch_size: int = 1) -> int:
    """KV-cache bytes for ``n_tokens`` positions over all layers.

    latent:   c_KV + shared rotary key, (512 + 64) per token per layer: 70,272 B per token for K2 in bf16.
    expanded: every head's key (192) and value (128), as a non-absorbing implementation caches them:
              64 * 320 per token per layer, about 2.4 MiB per token for K2.
    """
    _check_cfg(cfg)
    for name, value in (("n_tokens", n_tokens), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    _check_dtype(dtype)
    if layout == "latent":
        per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    elif layout == "expanded":
        per_layer = cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    else:
        raise ValueError(f"layout must be 'latent' or 'expanded', got {layout!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return batch_size * n_tokens * cfg.num_hidden_layers * per_layer * itemsize


def _check_cfg(cfg: K2Config) -> None:
    if not isinstance(cfg, K2Config):
        raise TypeError(f"cfg must be a K2Config (K2Config.kimi_k2(), K2Config.from_hf(...)), got {type(cfg).__name__}")


def _check_dtype(dtype: torch.dtype) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
