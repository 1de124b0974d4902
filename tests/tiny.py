"""The tiny configurations, models and token ids the tests share: every K2 switch at a size that runs in
milliseconds. Tests take them as fixtures (conftest.py) or import them where a parametrization needs the value."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hf_oracle import randomize

from k2lab import K2Config, K2Model
from k2lab.model.moe import MoE, RoutedExperts

# Three blocks (one dense, two MoE), 4 heads, 16 routed experts of which 4 are chosen, one group.
TINY = K2Config.mini().replace(vocab_size=512, num_hidden_layers=3)
# The same with group-limited routing: 4 groups of 4 experts, 2 groups kept.
GROUPED = TINY.replace(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
# The smallest K2 with every switch, for checks that only need a model to exist (the hostile-input tests).
MICRO = K2Config.mini().replace(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                num_hidden_layers=2, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                                num_experts_per_tok=2)
# Small enough for a few real optimizer steps: two blocks, 8 experts, top-2, vocabulary 256.
TRAINABLE = K2Config.mini().replace(vocab_size=256, num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2)


def random_model(cfg: K2Config = TINY, seed: int = 0) -> K2Model:
    """An eval-mode K2Model with the oracle's seeded weights (non-unit norms, a random non-zero correction bias)."""
    model = K2Model(cfg).eval()
    randomize(model, seed)
    return model


class UnstackedExperts(RoutedExperts):
    """Stacked experts that offer the speed rooms no stacks (``stacks`` None), so that they run one at a time, each
    expert's products from ``expert_linears``, as streamed and quantized experts run."""

    stacks = None

    @classmethod
    def of(cls, experts: RoutedExperts, cfg: K2Config) -> UnstackedExperts:
        unstacked = cls(cfg)
        unstacked.load_state_dict(experts.state_dict(), assign=True)  # the same tensors: their dtype and device
        return unstacked


def experts_one_at_a_time(model: K2Model) -> K2Model:
    """The model with its routed experts run one at a time, as streamed and quantized experts always run: the same
    products on the same weights, so their outputs are compared bit for bit (in pairs, the batched products round
    differently)."""
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp.experts = UnstackedExperts.of(layer.mlp.experts, model.config)
    return model


def token_ids(cfg: K2Config = TINY, batch: int = 2, length: int = 17, seed: int = 0) -> torch.Tensor:
    """Seeded random token ids [batch, length] within cfg's vocabulary."""
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def micro_model(seed: int = 0) -> K2Model:
    """An eval-mode MICRO model with init_weights(std=0.1, seed): the hostile-input tests' model, which only has to
    exist and give finite, seed-dependent logits."""
    model = K2Model(MICRO)
    model.init_weights(std=0.1, seed=seed)
    return model.eval()


def blocks_modes(call: Callable[[], object]) -> tuple[object, list[bool]]:
    """call()'s result, and for each forward it made whether the model's blocks ran in inference mode (read where every
    forward runs its blocks, once)."""
    seen = []
    run_blocks = K2Model.run_blocks

    def spy(*args, **kwargs):
        seen.append(torch.is_inference_mode_enabled())
        return run_blocks(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(K2Model, "run_blocks", spy)
        return call(), seen


def backward_node_names(output: torch.Tensor) -> list[str]:
    """The class name of every node of ``output``'s backward graph (each node once)."""
    nodes, frontier = set(), [output.grad_fn]
    while frontier:
        node = frontier.pop()
        if node is not None and node not in nodes:
            nodes.add(node)
            frontier.extend(next_node for next_node, _ in node.next_functions)
    return [type(node).__name__ for node in nodes]


def attached(model: K2Model) -> int:
    """How many forward and backward hook functions are attached across all of model's hook points."""
    return sum(len(model.hook_point(n).fns) + len(model.hook_point(n).bwd_fns) for n in model.hook_names())


def assert_refused_unchanged(model: K2Model, ids: torch.Tensor, call: Callable[[K2Model], object],
                             error: type[Exception], named: str) -> None:
    """call(model) raises error matching named, and the refusal left model's weights, hooks and logits on ids as
    they were: a refused argument must not leave a half-applied edit behind."""
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        logits = model(ids)
    with pytest.raises(error, match=named):
        call(model)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert attached(model) == 0
    with torch.no_grad():
        assert torch.equal(model(ids), logits)
