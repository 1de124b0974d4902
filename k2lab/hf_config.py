"""config.json <-> K2Config: Kimi's release layout, HF transformers 5 (``rope_parameters``), DeepseekV3 and V2 configs.

The family read here: Kimi K2 (Base, Instruct, 0905, Thinking), Moonlight, DeepSeek-V3 / R1 / V3.1 (their
multi-token-prediction block is counted, not loaded) and DeepSeek-V2(-Lite) (softmax router). Models that need
machinery k2lab does not have (V3.2's sparse-attention indexer, Kimi-Linear's delta attention, ...) and anything
else k2lab does not implement are refused by name rather than approximated.

The architecture only: a config's ``quantization_config`` says how the weights are stored, which
``k2lab.weights.reader.read_config`` reads beside the architecture (the stored formats live in ``k2lab.weights``,
downstream of this module).

It reads and writes plain dicts of ``K2Config``'s fields; ``K2Config.from_hf`` and ``to_hf`` call it, so that it
imports nothing of k2lab.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import K2Config

# Keys of a HF config that describe the file, the training run or HF runtime switches, not the computation
# k2lab performs. They are read and dropped. Everything not listed here or handled below is refused.
_IGNORED_KEYS = frozenset(
    {
        "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "use_cache",
        "initializer_range", "pretraining_tp", "aux_loss_alpha", "seq_aux", "output_router_logits",
        "pad_token_id", "attention_dropout", "ep_size", "head_dim", "qk_head_dim", "moe_layer_freq",
        "_name_or_path", "model_type", "quantization_config", "rope_scaling", "rope_parameters", "rope_theta",
        "num_mtp_layers", "hidden_act",
        "attention_bias", "mlp_bias", "tie_word_embeddings", "num_key_value_heads", "eos_token_id", "bos_token_id",
        "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward",
        "is_encoder_decoder", "tokenizer_class", "name_or_path", "id2label", "label2id", "problem_type",
        "rope_interleave", "max_window_layers", "use_sliding_window", "sliding_window",
    }
)
_MODEL_TYPES = ("kimi_k2", "deepseek_v3", "deepseek_v2")
# Relatives whose configs look alike but whose attention k2lab does not implement: what each lacks.
_REFUSED_MODEL_TYPES = {
    "deepseek_v32": "DeepSeek-V3.2's DeepSeek Sparse Attention: a lightning indexer (index_topk, index_n_heads, "
                    "index_head_dim) that picks the keys each query attends to",
    "kimi_linear": "Kimi-Linear's Kimi Delta Attention (linear_attn_config: kda_layers, short convolutions, gated "
                   "delta-rule state) interleaved with MLA",
}
_REFUSED_KEYS = {"index_topk": "deepseek_v32", "index_n_heads": "deepseek_v32", "index_head_dim": "deepseek_v32",
                 "linear_attn_config": "kimi_linear"}
# The released-config keys that may be absent, with the value their absence means (the DeepseekV3 reference code's
# and HF transformers' meaning). Any other K2Config field missing from a config.json is an error naming it: taking
# K2's value for, say, a missing hidden_size would build the wrong model silently.
OPTIONAL_KEYS: dict[str, Any] = {
    "q_lora_rank": None,  # no query latent: a plain q_proj
    "n_group": 1,  # no expert groups: top-k over all experts
    "topk_group": 1,
    "bos_token_id": None,
    "eos_token_id": None,
    "rope_interleave": True,  # the released layout: rotary dims stored as interleaved pairs
    "rms_norm_eps": 1e-6,
}
# K2Config fields config.json spells otherwise (rope_parameters, rope_scaling, rope_theta): read by _rope_from_hf.
_ROPE_FIELDS = frozenset({"rope_type", "rope_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                          "mscale", "mscale_all_dim", "rope_theta"})


def fields_from_hf(raw: dict[str, Any], where: str, field_names: set[str]) -> dict[str, Any]:
    """A parsed config.json (``where`` naming it in errors) -> K2Config's keyword arguments (``field_names``). Accepts
    Kimi's release (``model_type: kimi_k2``, ``rope_scaling``), HF 5 (``rope_parameters``) and DeepseekV3 configs.
    Raises ValueError naming any key or value k2lab does not implement (another scoring function, MTP layers, another
    attention, ...) and any required key missing. The ``quantization_config`` is left to ``k2lab.weights``: it says
    how weights are stored, not what the model computes."""
    return _fields_from_hf(raw, where, field_names)


def read_hf_json(source: str | Path | dict) -> tuple[dict[str, Any], str]:
    """A config.json as a dict (a path to the file or its folder, or the dict itself, copied), and what to call it
    in errors: its path, or ``"config"``."""
    if isinstance(source, dict):
        return dict(source), "config"
    if not isinstance(source, str | Path):
        raise TypeError(f"source must be a path to config.json (or its folder) or the parsed dict, got "
                        f"{type(source).__name__} {source!r:.60}")
    path = Path(source)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object ({{\"hidden_size\": ..., ...}}), got "
                         f"{type(raw).__name__} {raw!r:.60}")
    return raw, str(path)


def config_to_hf(cfg: K2Config, quantization_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """This config as a HF DeepseekV3 ``config.json`` dict (HF 5 style, ``rope_parameters``), with the stored
    format's ``quantization_config`` when given (``QuantFormat.quantization_config()``)."""
    out: dict[str, Any] = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in _ROPE_FIELDS}
    rope: dict[str, Any] = {"rope_type": cfg.rope_type or "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_type == "yarn":
        rope.update(
            factor=cfg.rope_factor, original_max_position_embeddings=cfg.original_max_position_embeddings,
            beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow, mscale=cfg.mscale,
            mscale_all_dim=cfg.mscale_all_dim,
        )
    # A softmax router is DeepSeek-V2's: written as a V2 config, which HF's DeepseekV2 reads as such.
    v2 = cfg.scoring_func == "softmax"
    out.update(
        architectures=["DeepseekV2ForCausalLM" if v2 else "DeepseekV3ForCausalLM"],
        model_type="deepseek_v2" if v2 else "deepseek_v3", hidden_act="silu",
        num_key_value_heads=cfg.num_attention_heads, attention_bias=False, tie_word_embeddings=False,
        rope_parameters=rope,
    )
    if quantization_config is not None:
        out["quantization_config"] = quantization_config
    return out


def _require(raw: dict, key: str, allowed: tuple, where: str, default: Any = None) -> None:
    value = raw.get(key, default)
    if value not in allowed:
        raise ValueError(f"{where}: {key}={value!r} is not implemented by k2lab (supported: {list(allowed)})")


def _fields_from_hf(raw: dict, where: str, names: set[str]) -> dict[str, Any]:
    """Translate and check a HF config dict into K2Config keyword arguments."""
    model_type = raw.get("model_type", "deepseek_v3")
    refused = _REFUSED_MODEL_TYPES.get(model_type) or next(
        (_REFUSED_MODEL_TYPES[kind] for key, kind in _REFUSED_KEYS.items() if key in raw), None)
    if refused is not None:
        raise ValueError(f"{where}: model_type {model_type!r} needs {refused}, which k2lab does not implement")
    _require(raw, "model_type", _MODEL_TYPES, where, default="deepseek_v3")
    _require(raw, "hidden_act", ("silu",), where, default="silu")
    _require(raw, "attention_bias", (False,), where, default=False)
    _require(raw, "mlp_bias", (False,), where, default=False)
    _require(raw, "tie_word_embeddings", (False,), where, default=False)
    _require(raw, "moe_layer_freq", (1,), where, default=1)
    if raw.get("num_mtp_layers", 0):
        raise ValueError(f"{where}: num_mtp_layers={raw['num_mtp_layers']}: k2lab reads DeepSeek's MTP layout, "
                         "num_nextn_predict_layers (blocks model.layers.{num_hidden_layers + i}.*)")
    if model_type == "deepseek_v2" and raw.get("norm_topk_prob") and raw.get("routed_scaling_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: DeepSeek-V2 renormalises OR scales the top-k weights, k2lab (as V3) does both: "
                         f"norm_topk_prob=true with routed_scaling_factor={raw['routed_scaling_factor']} is ambiguous")
    heads = raw.get("num_attention_heads")
    if raw.get("num_key_value_heads", heads) != heads:
        raise ValueError(
            f"{where}: num_key_value_heads={raw['num_key_value_heads']} differs from num_attention_heads={heads}; "
            "MLA expands every head from the shared latent"
        )

    unknown = sorted(k for k in raw if k not in names and k not in _IGNORED_KEYS)
    if unknown:
        raise ValueError(f"{where}: k2lab does not implement the config key(s) {unknown}")

    defaults = {**OPTIONAL_KEYS, **_family_defaults(model_type)}
    missing = sorted(names - _ROPE_FIELDS - set(defaults) - set(raw))
    if missing:
        raise ValueError(f"{where}: required key(s) {missing} missing (only {sorted(defaults)} have defaults)")
    fields = {k: v for k, v in raw.items() if k in names and k not in _ROPE_FIELDS}
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(fields.get(key), list):  # HF allows several eos ids; K2 has one
            ids = fields[key]
            if len(ids) != 1:
                raise ValueError(f"{where}: {key}={ids}: k2lab supports a single id")
            fields[key] = ids[0]
    fields = {**defaults, **fields}
    fields.update(_rope_from_hf(raw, where))
    if "n_shared_experts" in raw and raw["n_shared_experts"] is None:
        fields["n_shared_experts"] = 0
    for key in ("n_group", "topk_group"):
        if fields[key] is None:
            fields[key] = 1
    return fields


def _family_defaults(model_type: str) -> dict[str, Any]:
    """The keys a config may leave out whose meaning depends on the model type. A V3-style config (K2's) without
    them means the sigmoid router with noaux_tc top-k and no MTP block; DeepSeek-V2's released defaults are softmax
    scores, greedy top-k, no renormalisation and no scaling."""
    if model_type == "deepseek_v2":
        return {"scoring_func": "softmax", "topk_method": "greedy", "norm_topk_prob": False,
                "routed_scaling_factor": 1.0, "num_nextn_predict_layers": 0}
    return {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 0}


def _rope_from_hf(raw: dict, where: str) -> dict[str, Any]:
    """RoPE settings from ``rope_parameters`` (HF 5) or ``rope_scaling`` + ``rope_theta`` (the release)."""
    for key in ("rope_parameters", "rope_scaling"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ValueError(f"{where}: {key} must be an object such as {{\"type\": \"yarn\", \"factor\": 32.0, "
                             f"\"original_max_position_embeddings\": 4096, ...}}, or null for plain RoPE; got "
                             f"{raw[key]!r:.60}")
    merged = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
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
