"""The notebooks' parameter cell: which model the lab runs, read from the environment, and how to load it.

Every notebook starts with

    from k2lab import lab
    lab.setup_notebook()
    settings = lab.LabSettings.from_env()
    model, tok, about = lab.load_model(settings)

so the same notebook runs the bundled K2-nano on a laptop (the default) or the real Kimi K2 on a GPU node:

    K2LAB_MODEL=moonshotai/Kimi-K2-Instruct K2LAB_DEVICE_MAP=auto jupyter lab notebooks/

Variables (all optional):

    K2LAB_MODEL              "nano" (default), a Hub repo id, or a checkpoint folder in the release layout; or an
                             architecture preset (kimi_k2, kimi_k2_0905, kimi_k2_thinking, moonlight): config only,
                             for the notebooks that compute from the architecture alone (08 scale)
    K2LAB_DEVICE_MAP         unset or "cpu": the CPU; "auto": blocks balanced over the visible GPUs; a device such as
                             "cuda:0" for everything; or JSON {"module prefix": device}, e.g. {"": "cuda:0"}
    K2LAB_NUM_LAYERS         keep the first N blocks (plus the final norm and head): a prefix of the model
    K2LAB_EXPERT_BUDGET_GIB  stream routed experts from the files through an LRU cache of this many GiB
    K2LAB_DTYPE              float32, bfloat16 or float16 (default: float32 for nano, bfloat16 for FP8 checkpoints)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..analysis.accounting import count_parameters
from ..config import K2Config
from ..model.transformer import K2Model
from ..tokenizer.release import load_tokenizer
from ..tokenizer.tokenizer import K2Tokenizer
from ..weights.load import load, read_source_config
from ..weights.placement import DeviceMap
from .nano import NANO_DIR
from .solutions import install as install_solution_cells

NANO = "nano"
"""The name the parameter cell (and ``K2LAB_MODEL``) gives the bundled K2-nano."""
# Architectures K2LAB_MODEL may name without weights: settings.config() gives them; loading one falls back to nano.
PRESETS = {name: getattr(K2Config, name) for name in ("kimi_k2", "kimi_k2_0905", "kimi_k2_thinking", "moonlight")}

PROMPT = ("def area(radius):\n    return 3.14159 * radius * radius\n\n\n"
          "def perimeter(radius):\n    return 2 * 3.14159 *")
"""The lab's running prompt, followed through notebooks 00 to 07: one token's attention (03), routing (04), block (04b)
and logits (06) can be compared across lessons. It ends where the next token must copy a name from earlier in the prompt
(``radius``), which K2-nano, trained on Python, predicts."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LabSettings:
    """What the notebooks load. ``LabSettings()`` is the bundled K2-nano on the CPU."""

    model: str = NANO  # "nano", a Hub repo id or a checkpoint folder
    device_map: DeviceMap = None  # None (CPU), "auto", one device ("cuda:0") or {module prefix: device}
    num_layers: int | None = None
    expert_budget_bytes: int | None = None
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model):
            raise ValueError(f"LabSettings.model must be 'nano', a Hub repo id or a folder, got {self.model!r}")
        _check_device_map(self.device_map, "LabSettings.device_map")
        for name, low in (("num_layers", 1), ("expert_budget_bytes", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"LabSettings.{name} must be None or an integer >= {low}, got {value!r}")
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ValueError(f"LabSettings.dtype must be None or a floating torch dtype, got {self.dtype!r}")

    @property
    def is_nano(self) -> bool:
        """Whether ``model`` names the bundled K2-nano."""
        return self.model == NANO

    @property
    def is_preset(self) -> bool:
        """Whether ``model`` names an architecture preset (config only, no weights)."""
        return self.model in PRESETS

    def config(self) -> K2Config:
        """The chosen model's architecture without reading weights: a preset, K2-nano's, or the checkpoint's
        config.json (a local folder, or that one file from the Hub)."""
        if self.is_preset:
            return PRESETS[self.model]()
        if self.is_nano:
            return K2Config.from_hf(NANO_DIR)
        return read_source_config(self.model)[1]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LabSettings:
        """Read the ``K2LAB_*`` variables (see the module docstring); a bad value raises naming its variable."""
        env = os.environ if environ is None else environ
        get = lambda name: env.get(name, "").strip()
        budget = _parse(get, "K2LAB_EXPERT_BUDGET_GIB", float)
        if budget is not None and not (math.isfinite(budget) and budget >= 0):
            raise ValueError(f"K2LAB_EXPERT_BUDGET_GIB must be >= 0 and finite (GiB), got {budget}")
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
        _check_device_map(mapping, "K2LAB_DEVICE_MAP")
        return mapping
    _check_device_map({"": text}, "K2LAB_DEVICE_MAP")
    return {"": text}


def _check_device_map(device_map: object, name: str) -> None:
    """None, "auto", one device for every block, or {module prefix: device}, with devices torch knows (``"cuda:0"``,
    ``"cpu"``, a GPU index, a ``torch.device``)."""
    if device_map is None or device_map == "auto":
        return
    if isinstance(device_map, str | int | torch.device) and not isinstance(device_map, bool):
        _check_device(device_map, name)  # one device for every block
        return
    if not isinstance(device_map, Mapping):
        raise ValueError(f"{name} must be None, 'auto', a device or a mapping {{module prefix: device}}, "
                         f"got {device_map!r}")
    for prefix, device in device_map.items():
        if not isinstance(prefix, str):
            raise ValueError(f"{name}: module prefixes must be strings such as 'layers.3', got {prefix!r}")
        _check_device(device, f"{name}[{prefix!r}]")


def _check_device(device: object, name: str) -> None:
    """A device torch knows: a name (``"cuda:0"``, ``"cpu"``), a GPU index or a ``torch.device``."""
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return  # a GPU index
    try:
        if not isinstance(device, (str, torch.device)):
            raise TypeError
        torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} = {device!r} is not a torch device; use 'cpu', 'cuda:0', 'mps', ... or a GPU "
                         "index") from None


def load_model(settings: LabSettings | None = None, *, fallback_to_nano: bool = False
               ) -> tuple[K2Model, K2Tokenizer, str]:
    """(model in eval mode, its tokenizer, a one-line description) for ``settings`` (default: from the environment).

    K2-nano loads in float32 from ``lab/assets/nano`` (what ``k2lab.load_nano()`` does). Anything else goes through
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
    if settings.is_preset:
        raise ValueError(f"K2LAB_MODEL={settings.model} names an architecture preset, not weights: settings.config() "
                         "reads it; to run a model, give a Hub repo id or a checkpoint folder")
    source = NANO_DIR if settings.is_nano else settings.model
    dtype = settings.dtype or (torch.float32 if settings.is_nano else None)
    model = load(source, dtype=dtype, num_layers=settings.num_layers, expert_budget_bytes=settings.expert_budget_bytes,
                 device_map=settings.device_map).eval()
    if model.tokenizer is None:  # a Hub repo: load fetched the weights' files only
        model.tokenizer = load_tokenizer(source)
    return model, model.tokenizer, describe(model, "K2-nano (bundled)" if settings.is_nano else str(settings.model))


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
    only reads and edits activations), and no tokenizers fork warning. In IPython, solution cells keep their output
    folded and leave the learner's own answers in place (``k2lab.lab.solutions``)."""
    import plotly.io as pio

    install_solution_cells()
    pio.renderers.default = renderer
    torch.set_grad_enabled(False)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
