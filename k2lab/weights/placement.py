"""Where each part of a K2 model lives: device maps over whole blocks, and ``plan``, which balances the blocks
over devices by bytes and says whether the model fits.

Units of placement, in forward order: ``embed_tokens``, ``layers.0`` ... ``layers.{L-1}``, ``norm``, ``lm_head``.
A block is never split, so the model only moves the residual stream [B, T, D] (14 KB per token for K2 in
bfloat16) where consecutive blocks sit on different devices. Placement is contiguous, a pipeline: the embedding
on the first device, the head on the last. docs/multinode.md maps the same stages onto several nodes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..config import K2Config
from ..model.devices import available_device
from .quant import QuantFormat, resolve_format
from .schema import checkpoint_tensors

# Kept free on every device for activations and the KV cache: a 128K-token latent cache for the 8 blocks a
# device holds when K2 spans 8 GPUs is 1.2 GB; the rest covers prefill activations in chunks of ~2K tokens
# (the absorbed attention's [H, T, S] scores are the largest) and the dequantized copy of one FP8 matrix.
DEFAULT_HEADROOM_BYTES = 4 * 2**30
Device = int | str | torch.device
DeviceMap = Device | Mapping[str, Device] | None  # None, "auto", one device for all, or {module prefix: device}


def placement_units(cfg: K2Config) -> list[str]:
    """The units a device map places, in forward order."""
    return ["embed_tokens", *(f"layers.{i}" for i in range(cfg.num_hidden_layers)), "norm", "lm_head"]


def unit_of(name: str) -> str:
    """The unit holding a module, parameter or checkpoint tensor: ``model.layers.3.mlp.gate.weight`` -> ``layers.3``."""
    parts = name.removeprefix("model.").split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def unit_bytes(cfg: K2Config, *, format: QuantFormat | str = "fp8", dtype: torch.dtype = torch.bfloat16,
               expert_budget_bytes: int | None = None) -> dict[str, int]:
    """Bytes of each unit's resident weights: quantized matrices as stored in ``format`` (a QuantFormat or a name:
    ``"fp8"``, ``"int4"``, ``"unquantized"``), with their scales, the rest in ``dtype``. With an expert budget the
    routed experts stay in the files and count nothing here."""
    fmt = resolve_format(format)
    out = dict.fromkeys(placement_units(cfg), 0)
    for spec in checkpoint_tensors(cfg):
        if expert_budget_bytes is None or spec.component != "routed_experts":
            out[unit_of(spec.name)] += fmt.tensor_bytes(spec, dtype, scales=True)
    return out


def device_capacity(device: Device) -> int:
    """Total bytes of a GPU, or the machine's physical memory for the CPU."""
    device = _as_device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    raise ValueError(f"cannot tell the capacity of {device}; give it in bytes")


@dataclass(frozen=True)
class Plan:
    """A contiguous placement of the units over devices, with the bytes each device holds."""

    devices: tuple[str, ...]
    capacity_bytes: tuple[int, ...]
    weight_bytes: tuple[int, ...]  # resident weights per device
    units: dict[str, int]  # unit -> device index
    headroom_bytes: int  # kept free on every device for activations and the KV cache
    expert_cache_bytes: int  # the expert budget, reserved on every device (the LRU may fill it from any block)
    kv_bytes_per_token_layer: int  # latent cache per token per block, bfloat16

    @property
    def free_bytes(self) -> tuple[int, ...]:
        """Per device, what the weights and the expert cache leave (the headroom comes out of this)."""
        return tuple(c - w - self.expert_cache_bytes for c, w in zip(self.capacity_bytes, self.weight_bytes,
                                                                     strict=True))

    @property
    def fits(self) -> bool:
        """Whether every device keeps its headroom free once the weights and the expert cache are in."""
        return all(free >= self.headroom_bytes for free in self.free_bytes)

    @property
    def device_map(self) -> dict[str, str]:
        """{unit: device}, for ``k2lab.load(..., device_map=plan.device_map)``."""
        return {unit: self.devices[d] for unit, d in self.units.items()}

    def __str__(self) -> str:
        gb = 1e9
        lines = [
            f"{sum(self.weight_bytes) / gb:,.1f} GB of weights on {len(self.devices)} device(s): "
            f"{'fits' if self.fits else 'does NOT fit'}, keeping {self.headroom_bytes / gb:.1f} GB per device for "
            "activations and the KV cache"
            + (f" and reserving {self.expert_cache_bytes / gb:.1f} GB for streamed experts"
               if self.expert_cache_bytes else ""),
            f"{'device':<10}{'capacity':>12}{'weights':>12}{'free':>12}  {'KV tokens in free':>18}  units",
        ]
        for d, name in enumerate(self.devices):
            blocks = sum(1 for u, i in self.units.items() if i == d and u.startswith("layers."))
            free = self.free_bytes[d]
            tokens = f"{max(free, 0) // (blocks * self.kv_bytes_per_token_layer):,}" if blocks else "-"
            units = describe_units([u for u, i in self.units.items() if i == d])
            lines.append(f"{name:<10}{self.capacity_bytes[d] / gb:>9.1f} GB{self.weight_bytes[d] / gb:>9.1f} GB"
                         f"{free / gb:>9.1f} GB  {tokens:>18}  {units}")
        return "\n".join(lines)


def plan(cfg: K2Config, devices: Sequence[Device], *, format: QuantFormat | str = "fp8",
         dtype: torch.dtype = torch.bfloat16, expert_budget_bytes: int | None = None,
         headroom_bytes: int = DEFAULT_HEADROOM_BYTES) -> Plan:
    """Balance the blocks of ``cfg`` over ``devices`` by bytes and say whether they fit.

    ``devices``: byte capacities (named ``cuda:0``, ``cuda:1``, ... in the device map) or devices (``"cuda:1"``,
    ``torch.device("cpu")``; their total memory). Contiguous stages, the embedding on the first device and the
    head on the last, chosen to minimise the fullest device's share of its capacity less the headroom.
    ``format`` (a QuantFormat or a name): how quantized matrices are held. ``"fp8"``: e4m3 with their scales (the
    GPU path); ``"int4"``: K2-Thinking's packed experts; ``"unquantized"``: everything in ``dtype``.
    ``expert_budget_bytes``: routed experts are streamed; that budget is reserved on every device.

    >>> print(k2lab.plan(K2Config.kimi_k2(), devices=[141 * 10**9] * 8))
    """
    if not devices:
        raise ValueError("plan needs at least one device")
    names = tuple(f"cuda:{i}" if isinstance(d, int) else str(_as_device(d)) for i, d in enumerate(devices))
    capacity = tuple(d if isinstance(d, int) else device_capacity(d) for d in devices)
    sizes = unit_bytes(cfg, format=format, dtype=dtype, expert_budget_bytes=expert_budget_bytes)
    reserve = headroom_bytes + (expert_budget_bytes or 0)
    usable = [max(c - reserve, 1) for c in capacity]
    *first, norm, head = sizes.values()
    assignment = _partition(first + [norm + head], usable)  # the final norm goes with the head
    assignment.append(assignment[-1])
    load = [0] * len(devices)
    for size, d in zip(sizes.values(), assignment, strict=True):
        load[d] += size
    itemsize = torch.empty((), dtype=dtype).element_size()
    return Plan(names, capacity, tuple(load), dict(zip(sizes, assignment, strict=True)), headroom_bytes,
                expert_budget_bytes or 0, (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * itemsize)


def _partition(sizes: list[int], usable: list[int]) -> list[int]:
    """Device of each unit: contiguous runs, the first unit on the first device, the last on the last, so that the
    largest load / usable ratio is as small as greedy packing allows. Bisects on that ratio."""
    n = len(usable)
    if n == 1:
        return [0] * len(sizes)

    def pack(ratio: float) -> list[int] | None:
        limit = [ratio * u for u in usable]
        load = [0] * n
        load[0], load[-1] = sizes[0], sizes[-1]
        out, d = [0], 0
        for size in sizes[1:-1]:
            while load[d] + size > limit[d] and d < n - 1:
                d += 1
            load[d] += size
            out.append(d)
        return out + [n - 1] if all(l <= lim for l, lim in zip(load, limit, strict=True)) else None

    lo, hi = 0.0, sum(sizes) / min(usable) + 1.0  # everything on one device: always packs at hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if pack(mid) is not None else (mid, hi)
    return pack(hi)  # type: ignore[return-value]


def resolve_device_map(cfg: K2Config, device_map: DeviceMap, *, expert_budget_bytes: int | None = None,
                       format: QuantFormat | str = "fp8") -> dict[str, torch.device]:
    """{unit: device} for every unit of ``cfg``, from ``device_map`` as HF transformers' ``from_pretrained`` takes it.

    ``None``: all on the CPU. One device (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"meta"``, a GPU index or a
    ``torch.device``): all on it. ``"auto"``: ``plan`` over the visible GPUs' free memory (raising, with the plan, if
    the model does not fit), or the CPU when there is no GPU. A mapping {module prefix: device}: each unit goes where
    its longest matching prefix says (``""`` matches everything; ``model.`` prefixes are accepted). ``format`` is how
    quantized matrices are held, for ``"auto"``'s byte counts.
    """
    units = placement_units(cfg)
    if device_map is None:
        return dict.fromkeys(units, torch.device("cpu"))
    if device_map == "auto":
        if not torch.cuda.is_available():
            return dict.fromkeys(units, torch.device("cpu"))
        free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
        placed = plan(cfg, free, expert_budget_bytes=expert_budget_bytes, format=format)
        if not placed.fits:
            raise ValueError(f"device_map='auto': the model does not fit the visible GPUs' free memory; try "
                             f"num_layers= or expert_budget_bytes=\n{placed}")
        return {unit: torch.device(device) for unit, device in placed.device_map.items()}
    if isinstance(device_map, (str, int, torch.device)) and not isinstance(device_map, bool):
        return dict.fromkeys(units, _as_device(device_map, "device_map"))
    if not isinstance(device_map, Mapping):
        raise ValueError(f"device_map must be {_DEVICE_MAP_FORMS}, got {device_map!r}")
    prefixes = {key.removeprefix("model.") if key != "model" else "": value for key, value in device_map.items()}
    keys = unit_keys(cfg, prefixes, "device_map", "device")
    out = {unit: _as_device(prefixes[key], f"device_map[{key!r}]") for unit, key in keys.items()}
    return out


def unit_keys(cfg: K2Config, prefixes: Mapping[str, object], what: str, value: str) -> dict[str, str]:
    """{unit: the key of ``prefixes`` that places it}: each placement unit takes its longest matching module prefix
    (``""`` matches all). ``what`` and ``value`` name the mapping and what it gives in errors (device_map, device)."""
    units = placement_units(cfg)
    for key in prefixes:
        if key and not any(u == key or u.startswith(key + ".") for u in units):
            raise ValueError(f"{what} key {key!r} names no unit of this model; units are whole blocks: "
                             f"embed_tokens, layers.0 .. layers.{cfg.num_hidden_layers - 1}, norm, lm_head")
    out = {}
    for unit in units:
        matches = [k for k in prefixes if k == "" or unit == k or unit.startswith(k + ".")]
        if not matches:
            raise ValueError(f"{what} places no {value} for {unit} (add it, or a '' entry for everything else)")
        out[unit] = max(matches, key=len)
    return out


_DEVICE_MAP_FORMS = ("None, 'auto', one device ('cpu', 'cuda', 'cuda:N', 'meta', a GPU index, a torch.device) or "
                     "a mapping {module prefix: device}")


def _as_device(value: Device, where: str | None = None) -> torch.device:
    """``value`` as a torch.device that this machine has. ``where`` names the argument it came from in errors
    (``device_map``, ``device_map['layers.3']``)."""
    named = f"{where}={value!r}" if where is not None else repr(value)
    device = None
    if not isinstance(value, bool):  # a bool is an int to Python, but no GPU index
        try:
            device = torch.device("cuda", value) if isinstance(value, int) else torch.device(value)
        except (RuntimeError, TypeError, ValueError):
            pass
    if device is None:
        forms = _DEVICE_MAP_FORMS if where == "device_map" else "'cpu', 'cuda', 'cuda:N', a GPU index or a torch.device"
        raise ValueError(f"{named} is not a device: use {forms}")
    return available_device(value, where or "device")  # one this machine has: CUDA, MPS, XPU... named if not


def describe_units(units: list[str]) -> str:
    """``embed_tokens, layers.0-7`` for a device's units."""
    layers = [int(u.split(".")[1]) for u in units if u.startswith("layers.")]
    parts = [u for u in units if u == "embed_tokens"]
    if layers:
        parts.append(f"layers.{layers[0]}" + (f"-{layers[-1]}" if len(layers) > 1 else ""))
    return ", ".join(parts + [u for u in units if u in ("norm", "lm_head")]) or "-"
