"""Reading K2 checkpoints: a folder with config.json and safetensors (one file, or shards named by
``model.safetensors.index.json``), tensor names as released (one tensor per routed expert).

The model is built on the meta device and every parameter is assigned from the files, so nothing is
initialised twice and a failed load leaves no half-built model behind: it raises before returning one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from .accounting import TensorSpec, checkpoint_tensors
from .config import K2Config
from .model import K2Model

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Stale tensors some checkpoints carry that hold nothing k2lab computes from.
_IGNORED_TENSORS = re.compile(r".*rotary_emb\.(inv_freq|original_inv_freq)$")
_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def tensor_files(folder: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it, read from the index (never guessed)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise ValueError(f"{index} is not a safetensors index with a 'weight_map': {err}") from err
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"{folder} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


def model_param_name(checkpoint_name: str) -> str:
    """``model.layers.3.self_attn.o_proj.weight`` -> ``layers.3.self_attn.o_proj.weight`` (the module path)."""
    return checkpoint_name.removeprefix("model.")


def load(path: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> K2Model:
    """Load a local K2 / DeepseekV3 checkpoint folder into a K2Model.

    ``dtype``: the floating dtype of the weights (default: as stored). The router's correction bias always
    stays float32. Raises ValueError naming a missing tensor, an unexpected one, or a shape that disagrees
    with config.json.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    cfg = K2Config.from_hf(folder / "config.json")
    if cfg.fp8_block_size is not None:
        raise ValueError(f"{folder}: FP8-quantized checkpoints are not supported by this loader yet")
    files = tensor_files(folder)
    specs = checkpoint_tensors(cfg)
    expected = {s.name for s in specs}
    unexpected = sorted(n for n in files if n not in expected and not _IGNORED_TENSORS.match(n))
    if unexpected:
        raise ValueError(f"{folder}: tensors not in the model described by config.json: {unexpected[:5]}"
                         + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""))
    missing = [s.name for s in specs if s.name not in files]
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks tensor {missing[0]!r}"
                         + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))

    state = _read_state(specs, files, cfg.n_routed_experts, dtype, device)
    model = K2Model(cfg, device="meta")
    model.load_state_dict(state, strict=True, assign=True)
    return model


def _read_state(specs: list[TensorSpec], files: dict[str, Path], num_experts: int, dtype: torch.dtype | None,
                device: torch.device | str) -> dict[str, torch.Tensor]:
    """Read every tensor, check its shape, and stack per-expert tensors into [E, ...] parameters."""
    state: dict[str, torch.Tensor] = {}
    handles: dict[Path, object] = {}
    try:
        for spec in specs:
            file = files[spec.name]
            if file not in handles:
                if not file.is_file():
                    raise FileNotFoundError(f"shard {file.name} named by the index is missing from {file.parent}")
                handles[file] = safe_open(file, "pt", device="cpu")
            tensor = handles[file].get_tensor(spec.name)
            if tuple(tensor.shape) != spec.shape:
                raise ValueError(f"{file.name}: tensor {spec.name} has shape {tuple(tensor.shape)}, "
                                 f"but config.json implies {spec.shape}")
            if spec.name.endswith("e_score_correction_bias"):
                tensor = tensor.to(torch.float32)
            elif dtype is not None:
                tensor = tensor.to(dtype)
            expert = _EXPERT_NAME.fullmatch(spec.name)
            if expert is None:
                state[model_param_name(spec.name)] = tensor.to(device)
                continue
            layer, index, proj = int(expert[1]), int(expert[2]), expert[3]
            key = f"layers.{layer}.mlp.experts.{proj}"
            if key not in state:  # first expert of this layer: allocate the stack
                state[key] = torch.empty((num_experts, *tensor.shape), dtype=tensor.dtype, device=device)
            state[key][index] = tensor
    finally:
        handles.clear()
    return state
