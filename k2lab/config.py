"""K2Config: every number that shapes a Kimi K2 (DeepseekV3-family) model, in one frozen dataclass.

Field names follow the released ``config.json`` so a learner can read one against the other. ``from_hf``
accepts Kimi's config as released, HF transformers 5 configs (``rope_parameters``) and any DeepseekV3 config
whose switches k2lab implements; anything else is refused by name rather than approximated.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .hf_config import config_to_hf, fields_from_hf, read_hf_json


@dataclass(frozen=True)
class K2Config:
    """Architecture of a Kimi K2 style model. Defaults are the released Kimi-K2-Instruct values."""

    vocab_size: int = 163_840
    hidden_size: int = 7168  # D, the residual width
    intermediate_size: int = 18_432  # hidden width of the dense SwiGLU in the first blocks
    moe_intermediate_size: int = 2048  # hidden width of each routed and shared expert
    num_hidden_layers: int = 61
    first_k_dense_replace: int = 1  # blocks 0..k-1 are dense, the rest MoE
    num_attention_heads: int = 64  # H
    q_lora_rank: int | None = 1536  # query latent c_Q; None means a plain q_proj
    kv_lora_rank: int = 512  # key-value latent c_KV, the part of the cache shared by all heads
    qk_nope_head_dim: int = 128  # per-head query/key features without position
    qk_rope_head_dim: int = 64  # rotary features; ONE rotary key shared by all heads
    v_head_dim: int = 128
    n_routed_experts: int = 384  # E
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8  # k
    n_group: int = 1  # expert groups for group-limited routing
    topk_group: int = 1  # groups kept per token
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.827
    # How the router scores and picks experts. K2 and DeepSeek-V3: "sigmoid" affinities with a correction bias
    # deciding the top-k ("noaux_tc"). DeepSeek-V2: a "softmax" over the experts, top-k of it ("greedy", or
    # "group_limited_greedy": top-k within the topk_group groups holding the highest single scores), no bias.
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 50_000.0
    rope_interleave: bool = True  # the released layout: rotary dims stored as interleaved pairs
    rope_type: str | None = "yarn"  # None (plain RoPE) or "yarn"
    rope_factor: float = 32.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 1.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    max_position_embeddings: int = 131_072
    bos_token_id: int | None = 163_584
    eos_token_id: int | None = 163_585
    # Multi-token-prediction blocks stored after the main blocks (DeepSeek-V3: 1, ``model.layers.61.*``). They
    # draft the token after next for speculative decoding; k2lab counts them apart and does not load them.
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        positive = [
            "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
            "num_experts_per_tok", "n_group", "topk_group", "max_position_embeddings",
        ]
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"K2Config.{name} must be a positive integer, got {value!r}")
        counts = ("first_k_dense_replace", "intermediate_size", "n_shared_experts", "original_max_position_embeddings",
                  "num_nextn_predict_layers")
        for name in counts:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"K2Config.{name} must be a non-negative integer, got {value!r}")
        for name in ("q_lora_rank", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"K2Config.{name} must be a non-negative integer or None, got {value!r}")
        if self.q_lora_rank == 0:
            raise ValueError("K2Config.q_lora_rank must be a positive integer or None (a plain q_proj), got 0")
        for name in ("rms_norm_eps", "rope_theta", "routed_scaling_factor", "rope_factor", "beta_fast", "beta_slow",
                     "mscale", "mscale_all_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"K2Config.{name} must be a finite number > 0, got {value!r}")
        for name in ("norm_topk_prob", "rope_interleave"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"K2Config.{name} must be True or False, got {getattr(self, name)!r}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(
                f"K2Config.first_k_dense_replace={self.first_k_dense_replace} must lie in "
                f"0..num_hidden_layers={self.num_hidden_layers}"
            )
        if self.first_k_dense_replace > 0 and self.intermediate_size <= 0:
            raise ValueError(f"K2Config.intermediate_size must be positive, got {self.intermediate_size}")
        if self.n_shared_experts < 0:
            raise ValueError(f"K2Config.n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"K2Config.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"K2Config.n_group={self.n_group} must divide n_routed_experts={self.n_routed_experts}"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"K2Config.topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ValueError("group-limited routing scores a group by its top-2 experts: groups need >= 2 experts")
        kept = self.topk_group * (self.n_routed_experts // self.n_group)
        if self.num_experts_per_tok > kept:
            raise ValueError(
                f"K2Config.num_experts_per_tok={self.num_experts_per_tok} exceeds the {kept} experts "
                f"in the topk_group={self.topk_group} groups a token may use"
            )
        routers = {"sigmoid": ("noaux_tc",), "softmax": ("greedy", "group_limited_greedy")}
        if self.scoring_func not in routers:
            raise ValueError(f"K2Config.scoring_func must be one of {list(routers)}, got {self.scoring_func!r}")
        if self.topk_method not in routers[self.scoring_func]:
            raise ValueError(f"K2Config.topk_method={self.topk_method!r} does not go with scoring_func="
                             f"{self.scoring_func!r} (allowed: {list(routers[self.scoring_func])})")
        if self.topk_method == "greedy" and self.n_group != 1:
            raise ValueError(f"K2Config.topk_method='greedy' ignores expert groups: n_group must be 1, got "
                             f"{self.n_group}")
        if self.rope_type not in (None, "yarn"):
            raise ValueError(f"K2Config.rope_type must be None or 'yarn', got {self.rope_type!r}")
        if self.rope_type == "yarn" and self.rope_factor < 1:
            raise ValueError(f"K2Config.rope_factor must be >= 1 for YaRN, got {self.rope_factor}")
        for name in ("bos_token_id", "eos_token_id"):
            token = getattr(self, name)
            if token is not None and not 0 <= token < self.vocab_size:
                raise ValueError(f"K2Config.{name}={token} lies outside the vocabulary of {self.vocab_size}")

    # ---- derived quantities ------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: content (nope) plus rotary part, 128 + 64 = 192 for K2."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` has the MoE feed-forward (``layer >= first_k_dense_replace``), else the dense
        SwiGLU."""
        return layer >= self.first_k_dense_replace

    @property
    def has_correction_bias(self) -> bool:
        """Whether the router carries ``e_score_correction_bias`` (sigmoid routers with noaux_tc top-k)."""
        return self.topk_method == "noaux_tc"

    @property
    def yarn_mscale(self) -> float:
        """YaRN's attention temperature m = 0.1 ln(factor) + 1, taken with mscale_all_dim (1.3466 for K2)."""
        return yarn_get_mscale(self.rope_factor, self.mscale_all_dim) if self.rope_type == "yarn" else 1.0

    @property
    def softmax_scale(self) -> float:
        """192^-0.5 * m^2 = 0.13086 for K2: YaRN's temperature applied to q and k alike, folded into one scale."""
        return self.qk_head_dim**-0.5 * self.yarn_mscale**2

    # ---- presets -----------------------------------------------------------------------------------------
    @classmethod
    def kimi_k2(cls) -> K2Config:
        """Kimi-K2-Instruct as released: 61 blocks, 384 experts top-8, MLA 1536/512, YaRN x32."""
        return cls()

    @classmethod
    def kimi_k2_0905(cls) -> K2Config:
        """Kimi-K2-Instruct-0905: K2's architecture with a 256K context (YaRN x64 over the 4,096 original positions,
        262,144 positions); the longer stretch raises the softmax scale to 192^-0.5 * (0.1 ln 64 + 1)^2 = 0.14468."""
        return cls(rope_factor=64.0, max_position_embeddings=262_144)

    @classmethod
    def kimi_k2_thinking(cls) -> K2Config:
        """Kimi-K2-Thinking: the architecture of K2-Instruct-0905 (256K context, YaRN x64). Its release stores the
        routed experts in INT4; how weights are stored is the checkpoint's business, not the architecture's."""
        return cls.kimi_k2_0905()

    @classmethod
    def moonlight(cls) -> K2Config:
        """Moonlight-16B-A3B: 27 blocks 2,048 wide (the first dense), 16 heads without a query latent, 64 experts of
        1,408 top-6 plus 2 shared, routed scale 2.446, plain RoPE (theta 50,000) over 8,192 positions, K2's
        vocabulary. 15.29B parameters, 2.24B active without embedding and head."""
        return cls(
            hidden_size=2048, intermediate_size=11_264, moe_intermediate_size=1408, num_hidden_layers=27,
            num_attention_heads=16, q_lora_rank=None, n_routed_experts=64, n_shared_experts=2,
            num_experts_per_tok=6, routed_scaling_factor=2.446, rms_norm_eps=1e-5, rope_type=None, rope_factor=1.0,
            max_position_embeddings=8192,
        )

    @classmethod
    def mini(cls) -> K2Config:
        """A CPU-sized K2 that keeps every switch: q and kv latents, YaRN x32, dense first block, sigmoid
        router with correction bias, many small experts top-4, one shared expert, untied head."""
        return cls(
            vocab_size=8192, hidden_size=256, intermediate_size=768, moe_intermediate_size=96,
            num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=96,
            kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16,
            num_experts_per_tok=4, routed_scaling_factor=2.827, bos_token_id=None, eos_token_id=None,
        )

    @classmethod
    def nano(cls, width: int = 128) -> K2Config:
        """K2-nano, the lab's bundled trained model: mini's switches at 6 blocks, 32 experts top-4 and the nano
        tokenizer's 8,192 ids ([BOS] 7936, [EOS] 7937), with every matrix sized from ``width``: dense MLP
        3 * width, experts width / 2, q latent 3 * width / 8, kv latent width / 4 (256 gives 768, 128, 96, 64).

        The bundled model is 128 wide: at equal training time, 128 beat 192 and 256 on held-out code
        (docs/experiments.md)."""
        if width % 8:
            raise ValueError(f"nano width must be a multiple of 8, got {width}")
        return cls.mini().replace(
            hidden_size=width, intermediate_size=3 * width, moe_intermediate_size=width // 2,
            q_lora_rank=3 * width // 8, kv_lora_rank=width // 4, num_hidden_layers=6, n_routed_experts=32,
            bos_token_id=7936, eos_token_id=7937,
        )

    def replace(self, **changes: Any) -> K2Config:
        """A copy with some fields changed, validated again: ``K2Config.kimi_k2().replace(num_hidden_layers=4)``."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"K2Config has no field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    # ---- HF interop (the translation lives in k2lab.hf_config) -----------------------------------------------
    @classmethod
    def from_hf(cls, source: str | Path | dict) -> K2Config:
        """Read a HF ``config.json`` (a path to the file or its folder, or the parsed dict): Kimi's release layout
        (``model_type: kimi_k2``, ``rope_scaling``), HF 5 (``rope_parameters``), DeepseekV3 and V2 configs; anything
        k2lab does not implement, and any required key missing, is refused by name (``k2lab.hf_config``). The
        architecture only: how the weights are stored (``quantization_config``) is ``k2lab.weights.read_config``'s."""
        return cls.from_hf_dict(*read_hf_json(source))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], where: str = "config") -> K2Config:
        """The architecture of a parsed config.json, ``where`` naming it in errors; see ``from_hf``."""
        return cls(**fields_from_hf(raw, where, {f.name for f in dataclasses.fields(cls)}))

    def to_hf(self, quantization_config: dict[str, Any] | None = None) -> dict[str, Any]:
        """This config as a HF DeepseekV3 ``config.json`` dict (HF 5 style, ``rope_parameters``), with a stored
        format's ``quantization_config`` when given."""
        return config_to_hf(self, quantization_config)


def yarn_get_mscale(scale: float, mscale: float) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(scale) + 1 (1 when there is no stretch)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
