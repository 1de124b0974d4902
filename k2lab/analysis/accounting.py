"""Parameters, weight bytes and KV-cache bytes of a K2 configuration, computed from the config alone.

Everything derives from one list, ``checkpoint_tensors(cfg)`` (k2lab.weights.schema): every tensor of the released
checkpoint with its name, shape and component, the list the loader checks a checkpoint's headers against. Bytes
come from the stored format (k2lab.weights.quant), which says what each matrix takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import K2Config
from ..weights.quant import QuantFormat, resolve_format
from ..weights.schema import COMPONENTS, checkpoint_tensors, layer_tensors, mtp_tensors


@dataclass(frozen=True)
class MTPCount:
    """Parameters of the multi-token-prediction blocks, apart from the main model's.

    ``total``: every MTP tensor as stored (its copies of the embedding and head included: DeepSeek-V3's 685B on
    the hub = 671B main + this). ``unique``: less those copies, which share the main model's values.
    ``active``: what one drafted token uses (k of E routed experts, embedding and head included)."""

    total: int = 0
    unique: int = 0
    active: int = 0


def count_mtp_parameters(cfg: K2Config) -> MTPCount:
    """Parameters of ``cfg``'s multi-token-prediction blocks (all zero without any)."""
    specs = mtp_tensors(cfg)
    total = sum(s.numel for s in specs)
    shared = sum(s.numel for s in specs if s.name.endswith(("embed_tokens.weight", "shared_head.head.weight")))
    routed = sum(s.numel for s in specs if ".mlp.experts." in s.name)
    return MTPCount(total, total - shared, total - routed + routed * cfg.num_experts_per_tok // cfg.n_routed_experts)


@dataclass(frozen=True)
class ParameterCount:
    """Parameter totals. ``active``: what one token uses (k of E routed experts per MoE block)."""

    total: int
    active: int
    components: dict[str, int] = field(default_factory=dict)
    active_components: dict[str, int] = field(default_factory=dict)
    mtp: MTPCount = field(default_factory=MTPCount)  # multi-token prediction, not in total or active

    @property
    def active_without_embeddings(self) -> int:
        """Active parameters less the embedding table and the head (30.5 B for K2)."""
        return self.active - self.components["embedding"] - self.components["head"]

    def table(self) -> list[tuple[str, int, int]]:
        """(component, total, active) rows, for printing or a notebook table."""
        return [(c, self.components[c], self.active_components[c]) for c in COMPONENTS]


def count_parameters(cfg: K2Config) -> ParameterCount:
    """Total and per-token active parameters of the main model, by component (router includes the correction
    biases); multi-token-prediction blocks, where the config has them, apart in ``.mtp``."""
    _check_cfg(cfg)
    components = dict.fromkeys(COMPONENTS, 0)
    for spec in checkpoint_tensors(cfg):
        components[spec.component] += spec.numel
    active = dict(components)
    active["routed_experts"] = components["routed_experts"] * cfg.num_experts_per_tok // cfg.n_routed_experts
    return ParameterCount(sum(components.values()), sum(active.values()), components, active,
                          count_mtp_parameters(cfg))


def block_parameters(cfg: K2Config, layer: int) -> int:
    """Parameters of one block (497,500,160 for K2's dense block 0)."""
    _check_cfg(cfg)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < cfg.num_hidden_layers:
        raise ValueError(f"layer must be an integer in 0..{cfg.num_hidden_layers - 1}, got {layer!r}")
    return sum(spec.numel for spec in layer_tensors(cfg, layer))


def attention_parameters(cfg: K2Config) -> int:
    """Parameters of one MLA (101,124,096 for K2), latent norms included."""
    return sum(spec.numel for spec in layer_tensors(cfg, 0) if spec.component == "attention")


def weight_bytes(cfg: K2Config, format: QuantFormat | str = "fp8", dtype: torch.dtype = torch.bfloat16,
                 scales: bool = False) -> int:
    """Bytes of all weights as stored in ``format`` (a QuantFormat or a name). ``"fp8"``: the release's FP8
    matrices, embedding, head, norms and router in ``dtype`` (958.3 GiB for K2; block scales excluded unless
    ``scales=True``); ``"int4"``: K2-Thinking's packed experts, the rest in ``dtype``; ``"unquantized"``: everything
    in ``dtype``."""
    _check_cfg(cfg)
    _check_dtype(dtype)
    fmt = resolve_format(format)
    return sum(fmt.tensor_bytes(spec, dtype, scales) for spec in checkpoint_tensors(cfg))


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
