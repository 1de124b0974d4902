"""An independent reading of a K2 state dict: HF transformers' ``DeepseekV3ForCausalLM`` holding the same tensors,
for the notebooks that compare the learner's model with it (08). transformers is optional: without it the
function says so and returns None."""

from __future__ import annotations

import torch

from ..config import K2Config


def hf_deepseek_v3(cfg: K2Config, state_dict: dict[str, torch.Tensor]) -> tuple[torch.nn.Module | None, str]:
    """HF's DeepseekV3ForCausalLM (eager attention) holding ``state_dict`` (K2Model's names) and a sentence saying
    what it is; ``(None, why)`` when transformers is not installed. The tensors are shared, not copied, except each
    MoE layer's gate and up projections, which HF keeps fused in one [E, 2I, D] tensor."""
    try:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    except ImportError:
        return None, ("HF transformers is not installed here (pip install transformers), so the comparison with its "
                      "DeepseekV3 is left out")
    config = DeepseekV3Config(**cfg.to_hf(), attn_implementation="eager")
    with torch.device("meta"):  # no weights allocated: the state dict's tensors are assigned below
        model = DeepseekV3ForCausalLM(config)
    hf_state = {}
    for name, tensor in state_dict.items():
        if name.endswith("mlp.experts.up_proj"):
            continue
        if name.endswith("mlp.experts.gate_proj"):
            up = state_dict[name.removesuffix("gate_proj") + "up_proj"]
            hf_state["model." + name.removesuffix("gate_proj") + "gate_up_proj"] = torch.cat([tensor, up], dim=1)
        elif name == "lm_head.weight":
            hf_state[name] = tensor
        else:
            hf_state["model." + name] = tensor
    model.load_state_dict(hf_state, assign=True, strict=True)
    # The rotary frequencies are buffers no state dict holds: compute them on the CPU (the meta ones are empty).
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    dtype = next(iter(state_dict.values())).dtype
    return model.eval(), f"HF transformers' DeepseekV3ForCausalLM, eager attention, {str(dtype).removeprefix('torch.')}"
