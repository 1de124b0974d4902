"""The notebooks' parameter cell: which model the lab runs, read from the environment, and how to load it.

Every notebook starts with

    from k2lab import lab
    lab.setup_notebook()
    settings = lab.LabSettings.from_env()
    model, tok, about = lab.load_model(settings)

so the same notebook runs the bundled K2-nano on a laptop (the default) or the real Kimi K2 on a GPU node:

    K2LAB_MODEL=moonshotai/Kimi-K2-Instruct K2LAB_DEVICE_MAP=auto jupyter lab notebooks/

Variables (all optional):

    K2LAB_MODEL              "nano" (default), a Hub repo id, or a checkpoint folder in the release layout
    K2LAB_DEVICE_MAP         unset or "cpu": the CPU; "auto": blocks balanced over the visible GPUs; a device such as
                             "cuda:0" for everything; or JSON {"module prefix": device}, e.g. {"": "cuda:0"}
    K2LAB_NUM_LAYERS         keep the first N blocks (plus the final norm and head): a prefix of the model
    K2LAB_EXPERT_BUDGET_GIB  stream routed experts from the files through an LRU cache of this many GiB
    K2LAB_DTYPE              float32, bfloat16 or float16 (default: float32 for nano, bfloat16 for FP8 checkpoints)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..analysis.accounting import count_parameters
from ..model.transformer import K2Model
from ..tokenizer.tokenizer import K2Tokenizer, load_tokenizer
from ..weights.load import load
from ..weights.placement import DeviceMap
from .nano import NANO_DIR

NANO = "nano"

# The lab's running prompt, followed through notebooks 00 to 07: one token's attention (03), routing (04), block (04b)
# and logits (06) can be compared across lessons. It ends where the next token must copy a name from earlier in the
# prompt (`radius`), which K2-nano, trained on Python, predicts.
PROMPT = ("def area(radius):\n    return 3.14159 * radius * radius\n\n\n"
          "def perimeter(radius):\n    return 2 * 3.14159 *")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LabSettings:
    """What the notebooks load. ``LabSettings()`` is the bundled K2-nano on the CPU."""

    model: str = NANO  # "nano", a Hub repo id or a checkpoint folder
    device_map: DeviceMap = None  # None (CPU), "auto" or {module prefix: device}
    num_layers: int | None = None
    expert_budget_bytes: int | None = None
    dtype: torch.dtype | None = None

    @property
    def is_nano(self) -> bool:
        return self.model == NANO

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LabSettings:
        """Read the ``K2LAB_*`` variables (see the module docstring); a bad value raises naming its variable."""
        env = os.environ if environ is None else environ
        get = lambda name: env.get(name, "").strip()
        budget = _parse(get, "K2LAB_EXPERT_BUDGET_GIB", float)
        if budget is not None and budget < 0:
            raise ValueError(f"K2LAB_EXPERT_BUDGET_GIB must be >= 0, got {budget}")
        layers = _parse(get, "K2LAB_NUM_LAYERS", int)
        if layers is not None and layers < 1:
            raise ValueError(f"K2LAB_NUM_LAYERS must be a positive integer, got {layers}")
        dtype = get("K2LAB_DTYPE") or None
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"K2LAB_DTYPE must be one of {sorted(_DTYPES)}, got {dtype!r}")
        return cls(
            model=get("K2LAB_MODEL") or NANO,
            device_map=_device_map(get("K2LAB_DEVICE_MAP")),
            num_layers=layers,
            expert_budget_bytes=None if budget is None else int(budget * 2**30),
            dtype=_DTYPES[dtype] if dtype else None,
        )


def _parse(get: Callable[[str], str], name: str, kind: type) -> int | float | None:
    text = get(name)
    if not text:
        return None
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {text!r}") from None


def _device_map(text: str) -> DeviceMap:
    """"" or "cpu" -> None; "auto"; JSON {prefix: device}; any other string is one device for everything."""
    if text in ("", "cpu", "none", "None"):
        return None
    if text == "auto":
        return "auto"
    if text.startswith("{"):
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"K2LAB_DEVICE_MAP is not valid JSON: {err}") from None
        if not isinstance(mapping, dict):
            raise ValueError(f"K2LAB_DEVICE_MAP must be a JSON object, got {text!r}")
        return mapping
    return {"": text}


def load_model(settings: LabSettings | None = None, *, fallback_to_nano: bool = False
               ) -> tuple[K2Model, K2Tokenizer, str]:
    """(model in eval mode, its tokenizer, a one-line description) for ``settings`` (default: from the environment).

    K2-nano loads in float32 from ``assets/nano`` (what ``k2lab.nano.load_nano()`` does). Anything else goes through
    ``k2lab.load`` with the settings' slice, expert budget and device map, and its tokenizer from the same place.
    With ``fallback_to_nano`` a model that cannot be loaded (no weights here, no GPU, not enough memory) is replaced
    by K2-nano, and the description says why: for notebooks that must run everywhere.
    """
    settings = LabSettings.from_env() if settings is None else settings
    try:
        return _load(settings)
    except (OSError, ValueError, RuntimeError) as err:
        if not fallback_to_nano or settings.is_nano:
            raise
        model, tok, about = _load(LabSettings())
        return model, tok, f"{about} -- in place of {settings.model}, which could not be loaded here: {err}"


def _load(settings: LabSettings) -> tuple[K2Model, K2Tokenizer, str]:
    source = NANO_DIR if settings.is_nano else settings.model
    dtype = settings.dtype or (torch.float32 if settings.is_nano else None)
    model = load(source, dtype=dtype, num_layers=settings.num_layers, expert_budget_bytes=settings.expert_budget_bytes,
                 device_map=settings.device_map).eval()
    tok = load_tokenizer(source)
    return model, tok, describe(model, "K2-nano (bundled)" if settings.is_nano else str(settings.model))


def tokenizer(settings: LabSettings | None = None) -> K2Tokenizer:
    """Only the tokenizer of ``settings``' model (two small files; no weights are read)."""
    settings = LabSettings.from_env() if settings is None else settings
    return load_tokenizer(NANO_DIR if settings.is_nano else settings.model)


def describe(model: K2Model, name: str) -> str:
    """``name: 6 blocks, 32 routed experts (top-4) + 1 shared, 22.4 M parameters (4.3 M active); float32 on cpu``."""
    cfg = model.config
    params = count_parameters(cfg)
    devices = sorted({str(p.device) for p in model.parameters()})
    streamed = " (routed experts streamed)" if hasattr(model, "expert_cache") else ""
    return (f"{name}: {cfg.num_hidden_layers} blocks, {cfg.n_routed_experts} routed experts "
            f"(top-{cfg.num_experts_per_tok}) + {cfg.n_shared_experts} shared, {_millions(params.total)} parameters "
            f"({_millions(params.active)} active){streamed}; {str(model.dtype).removeprefix('torch.')} on "
            f"{', '.join(devices)}")


def _millions(n: int) -> str:
    return f"{n / 1e9:,.1f} B" if n >= 1e9 else f"{n / 1e6:,.1f} M"


def setup_notebook(renderer: str = "plotly_mimetype") -> None:
    """Notebook defaults: plotly figures render offline in JupyterLab (the ``plotly_mimetype`` renderer draws with the
    plotly.js inside plotly's lab extension; ``notebook_connected`` would need the internet), no autograd (the lab
    only reads and edits activations), and no tokenizers fork warning."""
    import plotly.io as pio

    pio.renderers.default = renderer
    torch.set_grad_enabled(False)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
