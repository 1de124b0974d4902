"""The tiny configurations, models and token ids the tests share: every K2 switch at a size that runs in
milliseconds. Tests take them as fixtures (conftest.py) or import them where a parametrization needs the value."""

from __future__ import annotations

import torch
from hf_oracle import randomize

from k2lab import K2Config, K2Model

# Three blocks (one dense, two MoE), 4 heads, 16 routed experts of which 4 are chosen, one group.
TINY = K2Config.mini().replace(vocab_size=512, num_hidden_layers=3)
# The same with group-limited routing: 4 groups of 4 experts, 2 groups kept.
GROUPED = TINY.replace(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
# Small enough for a few real optimizer steps: two blocks, 8 experts, top-2, vocabulary 256.
# The smallest K2 with every switch, for checks that only need a model to exist (the hostile-input tests).
MICRO = K2Config.mini().replace(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                num_hidden_layers=2, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                                num_experts_per_tok=2)
TRAINABLE = K2Config.mini().replace(vocab_size=256, num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2)


def random_model(cfg: K2Config = TINY, seed: int = 0) -> K2Model:
    """An eval-mode K2Model with the oracle's seeded weights (non-unit norms, a random non-zero correction bias)."""
    model = K2Model(cfg).eval()
    randomize(model, seed)
    return model


def token_ids(cfg: K2Config = TINY, batch: int = 2, length: int = 17, seed: int = 0) -> torch.Tensor:
    """Seeded random token ids [batch, length] within cfg's vocabulary."""
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))
