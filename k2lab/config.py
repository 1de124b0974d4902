"""K2Config: every number that shapes a Kimi K2 (DeepseekV3-family) model, in one frozen dataclass.

Field names follow the released ``config.json`` so a learner can read one against the other. ``from_hf``
accepts Kimi's config as released, HF transformers 5 configs (``rope_parameters``) and any DeepseekV3 config
whose switches k2lab implements; anything else is refused by name rather than approximated.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Keys of a HF config that describe the file, the training run or HF runtime switches, not the computation
# k2lab performs. They are read and dropped. Everything not listed here or handled below is refused.
_IGNORED_KEYS = frozenset(
    {
        "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "use_cache",
        "initializer_range", "pretraining_tp", "aux_loss_alpha", "seq_aux", "output_router_logits",
        "pad_token_id", "attention_dropout", "ep_size", "head_dim", "qk_head_dim", "moe_layer_freq",
        "_name_or_path", "model_type", "quantization_config", "rope_scaling", "rope_parameters", "rope_theta",
        "num_nextn_predict_layers", "num_mtp_layers", "scoring_func", "topk_method", "hidden_act",
        "attention_bias", "tie_word_embeddings", "num_key_value_heads", "eos_token_id", "bos_token_id",
        "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward",
        "is_encoder_decoder", "tokenizer_class", "name_or_path", "id2label", "label2id", "problem_type",
        "rope_interleave", "max_window_layers", "use_sliding_window", "sliding_window",
    }
)
_MODEL_TYPES = ("kimi_k2", "deepseek_v3")


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
    fp8_block_size: tuple[int, int] | None = (128, 128)  # checkpoint quantization blocks; None = unquantized

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
        counts = ("first_k_dense_replace", "intermediate_size", "n_shared_experts", "original_max_position_embeddings")
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
        block = self.fp8_block_size
        if block is not None and not (isinstance(block, (tuple, list)) and len(block) == 2 and all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"K2Config.fp8_block_size must be None or two positive integers, got {block!r}")
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
        if self.rope_type not in (None, "yarn"):
            raise ValueError(f"K2Config.rope_type must be None or 'yarn', got {self.rope_type!r}")
        if self.rope_type == "yarn" and self.rope_factor < 1:
            raise ValueError(f"K2Config.rope_factor must be >= 1 for YaRN, got {self.rope_factor}")
        if self.fp8_block_size is not None:
            object.__setattr__(self, "fp8_block_size", tuple(self.fp8_block_size))
        for name in ("bos_token_id", "eos_token_id"):
            token = getattr(self, name)
            if token is not None and not 0 <= token < self.vocab_size:
                raise ValueError(f"K2Config.{name}={token} lies outside the vocabulary of {self.vocab_size}")

    # ---- derived quantities ------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: content (nope) plus rotary part, 128 + 64 = 192 for K2."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

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
    def mini(cls) -> K2Config:
        """A CPU-sized K2 that keeps every switch: q and kv latents, YaRN x32, dense first block, sigmoid
        router with correction bias, many small experts top-4, one shared expert, untied head."""
        return cls(
            vocab_size=8192, hidden_size=256, intermediate_size=768, moe_intermediate_size=96,
            num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=96,
            kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16,
            num_experts_per_tok=4, routed_scaling_factor=2.827, bos_token_id=None, eos_token_id=None,
            fp8_block_size=None,
        )

    @classmethod
    def nano(cls, width: int = 128) -> K2Config:
        """K2-nano, the lab's bundled trained model: mini's switches at 6 blocks, 32 experts top-4 and the nano
        tokenizer's 8,192 ids ([BOS] 7936, [EOS] 7937), with every matrix sized from ``width``: dense MLP
        3 * width, experts width / 2, q latent 3 * width / 8, kv latent width / 4 (256 gives 768, 128, 96, 64).

        The bundled model is 128 wide, the width that an hour on two CPU cores trains best: at equal time, 128
        beat 192 and 256 on held-out code (README)."""
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

    # ---- HF interop --------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: str | Path | dict) -> K2Config:
        """Read a HF ``config.json`` (a path to the file or its folder, or the parsed dict).

        Accepts Kimi's release (``model_type: kimi_k2``, ``rope_scaling``, FP8 ``quantization_config``), HF 5
        (``rope_parameters``) and DeepseekV3 configs. Raises ValueError naming any key or value k2lab does not
        implement (another scoring function, MTP layers, an unknown quantization, ...).
        """
        if isinstance(source, dict):
            raw, where = dict(source), "config"
        else:
            path = Path(source)
            path = path / "config.json" if path.is_dir() else path
            if not path.is_file():
                raise FileNotFoundError(f"no config.json at {path}")
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not valid JSON: {err}") from err
            where = str(path)
        return cls(**_fields_from_hf(raw, where))

    def to_hf(self) -> dict[str, Any]:
        """This config as a HF DeepseekV3 ``config.json`` dict (HF 5 style, ``rope_parameters``)."""
        out: dict[str, Any] = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in {"rope_type", "rope_factor", "original_max_position_embeddings", "beta_fast",
                              "beta_slow", "mscale", "mscale_all_dim", "rope_theta", "fp8_block_size"}
        }
        rope: dict[str, Any] = {"rope_type": self.rope_type or "default", "rope_theta": self.rope_theta}
        if self.rope_type == "yarn":
            rope.update(
                factor=self.rope_factor, original_max_position_embeddings=self.original_max_position_embeddings,
                beta_fast=self.beta_fast, beta_slow=self.beta_slow, mscale=self.mscale,
                mscale_all_dim=self.mscale_all_dim,
            )
        out.update(
            architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_act="silu",
            num_key_value_heads=self.num_attention_heads, attention_bias=False, tie_word_embeddings=False,
            scoring_func="sigmoid", topk_method="noaux_tc", num_nextn_predict_layers=0, rope_parameters=rope,
        )
        if self.fp8_block_size is not None:
            out["quantization_config"] = {
                "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.fp8_block_size),
            }
        return out


def yarn_get_mscale(scale: float, mscale: float) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(scale) + 1 (1 when there is no stretch)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _require(raw: dict, key: str, allowed: tuple, where: str, default: Any = None) -> None:
    value = raw.get(key, default)
    if value not in allowed:
        raise ValueError(f"{where}: {key}={value!r} is not implemented by k2lab (supported: {list(allowed)})")


def _fields_from_hf(raw: dict, where: str) -> dict[str, Any]:
    """Translate and check a HF config dict into K2Config keyword arguments."""
    _require(raw, "model_type", _MODEL_TYPES, where, default="deepseek_v3")
    _require(raw, "hidden_act", ("silu",), where, default="silu")
    _require(raw, "scoring_func", ("sigmoid",), where, default="sigmoid")
    _require(raw, "topk_method", ("noaux_tc",), where, default="noaux_tc")
    _require(raw, "attention_bias", (False,), where, default=False)
    _require(raw, "tie_word_embeddings", (False,), where, default=False)
    _require(raw, "moe_layer_freq", (1,), where, default=1)
    for mtp_key in ("num_nextn_predict_layers", "num_mtp_layers"):
        if raw.get(mtp_key, 0):
            raise ValueError(
                f"{where}: {mtp_key}={raw[mtp_key]} asks for multi-token-prediction layers, which k2lab does not "
                "implement; set it to 0 to use the main model alone"
            )
    heads = raw.get("num_attention_heads")
    if raw.get("num_key_value_heads", heads) != heads:
        raise ValueError(
            f"{where}: num_key_value_heads={raw['num_key_value_heads']} differs from num_attention_heads={heads}; "
            "MLA expands every head from the shared latent"
        )

    names = {f.name for f in dataclasses.fields(K2Config)}
    unknown = sorted(k for k in raw if k not in names and k not in _IGNORED_KEYS)
    if unknown:
        raise ValueError(f"{where}: k2lab does not implement the config key(s) {unknown}")

    fields = {k: v for k, v in raw.items() if k in names and k not in {"rope_type", "fp8_block_size"}}
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(fields.get(key), list):  # HF allows several eos ids; K2 has one
            ids = fields[key]
            if len(ids) != 1:
                raise ValueError(f"{where}: {key}={ids}: k2lab supports a single id")
            fields[key] = ids[0]
    fields.setdefault("bos_token_id", None)
    fields.setdefault("eos_token_id", None)
    fields.setdefault("q_lora_rank", None)
    fields.setdefault("rope_interleave", True)
    fields.setdefault("n_group", 1)
    fields.setdefault("topk_group", 1)
    fields.update(_rope_from_hf(raw, where))
    fields["fp8_block_size"] = _quantization_from_hf(raw.get("quantization_config"), where)
    if "n_shared_experts" in raw and raw["n_shared_experts"] is None:
        fields["n_shared_experts"] = 0
    for key in ("n_group", "topk_group"):
        if fields[key] is None:
            fields[key] = 1
    return fields


def _rope_from_hf(raw: dict, where: str) -> dict[str, Any]:
    """RoPE settings from ``rope_parameters`` (HF 5) or ``rope_scaling`` + ``rope_theta`` (the release)."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10_000.0))
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind in ("default", None):
        extra = set(merged) - {"rope_theta", "rope_type", "type"}
        if extra:
            raise ValueError(f"{where}: plain RoPE with scaling keys {sorted(extra)} is ambiguous")
        return {"rope_type": None, "rope_theta": float(theta), "rope_factor": 1.0}
    if kind != "yarn":
        raise ValueError(f"{where}: rope type {kind!r} is not implemented by k2lab (supported: default, yarn)")
    known = {"rope_theta", "rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim"}
    extra = sorted(set(merged) - known)
    if extra:
        raise ValueError(f"{where}: YaRN key(s) {extra} are not implemented by k2lab")
    if "factor" not in merged or "original_max_position_embeddings" not in merged:
        raise ValueError(f"{where}: YaRN needs 'factor' and 'original_max_position_embeddings'")
    return {
        "rope_type": "yarn",
        "rope_theta": float(theta),
        "rope_factor": float(merged["factor"]),
        "original_max_position_embeddings": int(merged["original_max_position_embeddings"]),
        # The released YaRN class defaults: beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 0.
        "beta_fast": float(merged.get("beta_fast", 32.0)),
        "beta_slow": float(merged.get("beta_slow", 1.0)),
        "mscale": float(merged.get("mscale", 1.0)),
        "mscale_all_dim": float(merged.get("mscale_all_dim", 0.0)),
    }


def _quantization_from_hf(quant: dict | None, where: str) -> tuple[int, int] | None:
    """The FP8 block size of a checkpoint, or None for unquantized weights; anything else is refused."""
    if not quant:
        return None
    method, fmt = quant.get("quant_method"), quant.get("fmt", "e4m3")
    block = quant.get("weight_block_size")
    if method != "fp8" or fmt != "e4m3" or not block or len(block) != 2:
        raise ValueError(
            f"{where}: quantization_config {quant} is not implemented by k2lab "
            "(supported: quant_method 'fp8', fmt 'e4m3', a 2-d weight_block_size)"
        )
    return int(block[0]), int(block[1])
