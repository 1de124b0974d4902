"""The test oracle: HF transformers' DeepseekV3ForCausalLM in float32 with eager attention, given random
weights that expose bugs (norm weights far from one, a non-zero correction bias, router logits spread wide
enough that top-k has no near-ties), saved with ``save_pretrained`` so k2lab reads them as a checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import torch

import k2lab
from k2lab import K2Config


def hf_config(cfg: K2Config):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**cfg.to_hf(), attn_implementation="eager")


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights with unit-scale activations: matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.2)
    (never all ones), router weights wide and the correction bias random and non-zero."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith("mlp.gate.weight"):
            p.copy_(torch.randn(p.shape, generator=gen) * 3 / math.sqrt(p.shape[-1]))
        elif name.endswith("embed_tokens.weight"):
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.2 * torch.randn(b.shape, generator=gen))


def hf_model(cfg: K2Config, seed: int = 0):
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_config(cfg)).float().eval()
    randomize(model, seed)
    return model


def save_and_load(model, folder: Path, **load_kwargs) -> k2lab.K2Model:
    """save_pretrained (per-expert tensor names, as released) then k2lab.load."""
    model.save_pretrained(folder)
    return k2lab.load(folder, **load_kwargs).eval()


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
