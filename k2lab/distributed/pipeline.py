"""K2 as a pipeline over processes: one torchrun process (rank) per device, each holding a contiguous stage of
whole blocks, the rest of the model on the meta device (shapes, no data, never read from the files).

    # torchrun --nproc-per-node 8 script.py; every rank runs the same script with the same ids
    pm = PipelinedK2("moonshotai/Kimi-K2-Instruct")       # the same plan on every rank; each loads its stage
    logits = pm(ids)                                       # float32 [B, T, V] on every rank
    logits = pm(ids, attention_mask=mask)                  # a padded batch, as K2Model takes it
    logits, cache = pm.run_with_cache(ids)                 # every probe, gathered to every rank
    with k2lab.interventions.ablate_experts(pm, {3: [17]}):   # a hook goes to the rank that owns its probe
        logits = pm(ids)
    out = pm.generate(ids, max_new_tokens=20)              # [B, T + n] on every rank

One forward, stage after stage: rank 0 embeds the ids and runs its blocks, then sends the residual [B, T, D] to
rank 1 (blocking ``send``/``recv``), which runs its blocks and sends on; the last rank applies the final norm and
the head. ``pm(ids)`` then broadcasts the float32 logits; ``pm.generate`` keeps them on the last rank, samples
there and broadcasts only the next token ids. Every rank holds a ``LatentCache`` for its own blocks.

The stage runs k2lab's own blocks, so probes, hooks and interventions work unchanged on the rank holding them.
The final norm and head are copied to every rank once (broadcast from the last rank, never read from the files)
so that a gathered cache's ``logit_lens`` and ``logit_attribution`` work everywhere.

An exception inside one rank's stage (a hook that raises, say) leaves the other ranks waiting in ``recv`` until
the process group's timeout (``init(timeout=)``); errors while reading the config or loading, and errors in
``generate``'s arguments, reach every rank at once.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from ..config import K2Config
from ..model.activation_cache import ActivationCache
from ..model.attention import ATTN_IMPLS, AttnImpl, LatentCache
from ..model.generate import generate
from ..model.hooks import HookPoint, Hooks, NameFilter, one_selector
from ..model.inputs import Inputs, prepare_inputs
from ..model.transformer import K2Model
from ..weights.load import load, read_source_config
from ..weights.placement import Plan, describe_units, device_capacity, plan, unit_keys, unit_of
from ..weights.quant import UNQUANTIZED

DEFAULT_TIMEOUT = timedelta(minutes=30)  # a rank may wait this long for a slower rank's load (60 GB from disk)
_ATTN_IMPLS: tuple[AttnImpl, ...] = ATTN_IMPLS  # sent between ranks by index
_STEP, _STOP, _ERROR = 0, 1, 2  # what the last rank tells the others between generate's steps
R = TypeVar("R")


def init(backend: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT) -> torch.device:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
    ``LOCAL_RANK``) and return this rank's device: ``cuda:LOCAL_RANK`` with NCCL when GPUs are visible, the CPU
    with gloo otherwise. ``timeout`` bounds every wait on another rank. Does nothing if the group exists."""
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise RuntimeError(f"k2lab.distributed.init reads torchrun's environment, but {missing} are unset; "
                               "launch with: torchrun --nproc-per-node N your_script.py")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        device = None
        if backend == "nccl":  # bound to its GPU from the start: collectives never guess the device
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timeout, device_id=device)
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def stage_map(cfg: K2Config, world_size: int, stages: Mapping[str, int]) -> dict[str, int]:
    """{unit: rank} over ``embed_tokens``, ``layers.{i}``, ``norm``, ``lm_head`` from a map {unit prefix: rank},
    each unit taking its longest matching prefix (``""`` matches all): ``{"": 1, "embed_tokens": 0, "layers.0": 0}``.
    The stages must run in forward order over ranks 0..world_size-1, each holding something, with the final norm
    and head on the last rank."""
    for key, rank in stages.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"stages[{key!r}] = {rank!r}: a rank must be an integer in 0..{world_size - 1}")
    out = {unit: stages[key] for unit, key in unit_keys(cfg, stages, "stages", "rank").items()}
    order = list(out.values())
    if order != sorted(order) or set(order) != set(range(world_size)):
        raise ValueError(f"stages must run in forward order over ranks 0..{world_size - 1}, each holding at least "
                         f"one unit; got {_describe_stages(out, world_size)}")
    if out["norm"] != world_size - 1 or out["lm_head"] != world_size - 1:
        raise ValueError(f"the final norm and the head must sit on the last rank ({world_size - 1}); got "
                         f"{_describe_stages(out, world_size)}")
    return out


def _describe_stages(stages: Mapping[str, int], world_size: int) -> str:
    return "\n".join(f"rank {r}: {describe_units([u for u, s in stages.items() if s == r])}"
                     for r in range(world_size))


def _capacity(device: torch.device) -> int:
    """What plan may fill on this rank's device: free GPU memory, or the machine's memory."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else device_capacity(device)


class PipelinedK2:
    """A K2 model split into stages over the ranks of a torch.distributed group; see the module docstring.

    Duck-types the parts of ``K2Model`` that analysis and interventions use (``config``, ``layers``, ``norm``,
    ``lm_head``, ``hooks``, ``run_with_cache``, ``select_hook_names``), with ``pm.model`` this rank's K2Model
    (its other ranks' units on meta). Every method is collective: every rank calls it, with the same arguments.
    """

    def __init__(self, path_or_repo_id: str | Path, dtype: torch.dtype | None = None,
                 devices: Sequence[int] | None = None, stages: Mapping[str, int] | None = None, **load_kwargs):
        """path_or_repo_id, dtype and ``load_kwargs`` (num_layers, expert_budget_bytes, quantized_resident,
        revision, progress) as for ``k2lab.load``; ``device_map`` is this class's to set.

        devices: each rank's capacity in bytes, one per rank, for ``plan``. Default: each rank's free GPU memory
            (the machine's memory for CPU ranks), gathered so that every rank computes the same plan.
        stages: an explicit {unit prefix: rank} map instead of the plan (see ``stage_map``).

        A rank that fails to read the config or to load (a missing shard on its node, say) makes every rank raise
        RuntimeError naming that rank and its error.
        """
        if "device_map" in load_kwargs:
            raise ValueError("PipelinedK2 places the units itself; give stages= (or devices=) instead of device_map")
        self.device = init()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.last = self.world_size - 1
        self.bytes_sent = 0  # payload this rank has sent to other ranks (a broadcast counts once per receiver)
        _, cfg, fmt = self._on_every_rank("read config.json", lambda: read_source_config(
            path_or_repo_id, load_kwargs.get("revision"), load_kwargs.get("num_layers")))
        self.plan: Plan | None = None
        if stages is None:
            capacities = list(devices) if devices is not None else self._gather(_capacity(self.device))
            if len(capacities) != self.world_size:
                raise ValueError(f"devices must give one capacity in bytes per rank ({self.world_size}), "
                                 f"got {devices!r}")
            # load's default: quantized matrices stay quantized on GPUs only
            resident = load_kwargs.get("quantized_resident")
            keeps = resident if resident is not None else self.device.type != "cpu"
            placed = plan(cfg, capacities, format=fmt if keeps else UNQUANTIZED, dtype=dtype or torch.bfloat16,
                          expert_budget_bytes=load_kwargs.get("expert_budget_bytes"))
            self.plan = dataclasses.replace(placed, devices=tuple(f"rank {r}" for r in range(self.world_size)))
            stages = self.plan.units
        self.stages = stage_map(cfg, self.world_size, stages)
        self.blocks = [int(unit.split(".")[1]) for unit, r in self.stages.items()
                       if r == self.rank and unit.startswith("layers.")]
        mine = {unit: self.device if r == self.rank else "meta" for unit, r in self.stages.items()}
        self.model: K2Model = self._on_every_rank("load its stage", lambda: load(
            path_or_repo_id, dtype=dtype, device_map=mine, **load_kwargs)).eval()
        self._replicate_head()

    # ---- what analysis and interventions read ----------------------------------------------------------------------
    @property
    def config(self) -> K2Config:
        """The whole model's K2Config, the same on every rank."""
        return self.model.config

    @property
    def layers(self) -> torch.nn.ModuleList:
        """Every block; those of other ranks are on meta."""
        return self.model.layers

    @property
    def norm(self) -> torch.nn.Module:
        """The final RMSNorm, on every rank (sent by the last rank at load)."""
        return self.model.norm

    @property
    def lm_head(self) -> torch.nn.Module:
        """The head (the unembedding, weight [V, D]), on every rank (sent by the last rank at load)."""
        return self.model.lm_head

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights (this rank's model's)."""
        return self.model.dtype

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage, the one that computes the logits."""
        return self.rank == self.last

    def describe(self) -> str:
        """The units of every rank (and the plan's bytes when a plan chose them)."""
        return str(self.plan) if self.plan is not None else _describe_stages(self.stages, self.world_size)

    def new_cache(self, batch_size: int = 1, capacity: int = 0) -> LatentCache:
        """This rank's latent cache: buffers for its own blocks (the others' entries on meta, empty), ``capacity``
        positions reserved as ``K2Model.new_cache`` does."""
        return self.model.new_cache(batch_size, capacity)

    # ---- the forward -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, cache: LatentCache | None = None, attn_impl: AttnImpl = "auto",
                 *, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> float32 logits [B, T, V] on every rank, with ``K2Model.forward``'s semantics: a
        ``cache`` from ``pm.new_cache`` continues from its length; ``attention_mask`` [B, T] (1 = token, 0 = pad)
        hides the pads and gives them no position."""
        inputs = prepare_inputs(self.model, input_ids, attention_mask, cache, attn_impl, self.device)  # every rank
        logits = self._stage_forward(inputs, cache)  # the last rank's only
        if not self.is_last:
            logits = torch.empty(*inputs.ids.shape, self.config.vocab_size, dtype=torch.float32, device=self.device)
        self._broadcast(logits, src=self.last)
        return logits

    def _stage_forward(self, inputs: Inputs, cache: LatentCache | None) -> torch.Tensor | None:
        """This rank's part of one forward of ``inputs`` (``prepare_inputs`` on this rank, with its own cache; the ids
        are read on rank 0 only, their shape elsewhere): the logits [B, T, V] on the last rank, None elsewhere."""
        m, (B, T) = self.model, inputs.ids.shape
        if self.rank == 0:
            x = m.embed(inputs.ids)  # [B, T, D]
        else:
            x = torch.empty(B, T, self.config.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(x, src=self.rank - 1)  # the residual after the previous stage's blocks
        if self.blocks:  # the model's own steps, over this stage's blocks; the last stage's advance the cache
            x = m.run_blocks(x, inputs, cache, start=self.blocks[0], stop=self.blocks[-1] + 1)
        if cache is not None and (not self.blocks or self.blocks[-1] + 1 < len(m.layers)):
            cache.advance(T)
        if not self.is_last:
            dist.send(x.contiguous(), dst=self.rank + 1)
            self.bytes_sent += x.nelement() * x.element_size()
            return None
        return m.head(x)  # [B, T, V]

    # ---- probes ------------------------------------------------------------------------------------------------------
    def owns(self, probe: str) -> bool:
        """Whether probe ``probe`` fires on this rank (``hook_logits`` belongs with the head)."""
        return self.stages["lm_head" if probe == "hook_logits" else unit_of(probe)] == self.rank

    def hook_names(self) -> list[str]:
        """Every probe of the whole model, global names in module order (``K2Model.hook_names``), on every rank."""
        return self.model.hook_names()

    def select_hook_names(self, names: NameFilter) -> list[str]:
        """Probe names chosen by ``names``, over the whole model's global names (``K2Model.select_hook_names``)."""
        return self.model.select_hook_names(names)

    def hook_point(self, name: str) -> HookPoint:
        """The probe of this name in this rank's model (``K2Model.hook_point``); a probe of another rank's block is
        there but never fires here (``owns``)."""
        return self.model.hook_point(name)

    @contextmanager
    def hooks(self, fwd_hooks: Hooks = (), bwd_hooks: Hooks = ()) -> Iterator[None]:
        """``K2Model.hooks`` with its selectors over global probe names: each hook is attached on the rank owning
        its probe (a selector that matches no probe raises on every rank). The pipeline runs forward only, so
        ``bwd_hooks`` are refused."""
        _refuse_backward("bwd_hooks", bool(list(bwd_hooks)))
        owned = []
        for pair in fwd_hooks:
            if not (isinstance(pair, tuple | list) and len(pair) == 2):
                raise ValueError(f"fwd_hooks takes (selector, fn) pairs with fn(tensor, hook); got {pair!r}")
            selector, fn = pair
            owned.append(([name for name in self.model.select_hook_names(selector) if self.owns(name)], fn))
        with self.model.hooks(fwd_hooks=owned):
            yield

    def reset_hooks(self) -> None:
        """Detach every function from every probe of this rank's model (``K2Model.reset_hooks``)."""
        self.model.reset_hooks()

    def run_with_cache(self, input_ids: torch.Tensor, names: NameFilter = None,
                       device: torch.device | str | None = None, dtype: torch.dtype | None = None, *,
                       names_filter: NameFilter = None, incl_bwd: bool = False, metric: Callable | None = None,
                       **forward_kwargs) -> tuple[torch.Tensor, ActivationCache]:
        """``K2Model.run_with_cache`` over the pipeline (the same selectors; ``forward_kwargs`` as for ``pm(...)``):
        each rank records its own probes, then every rank receives all of them (on ``device``, default this
        rank's), in firing order. ``incl_bwd`` (and its ``metric``) is refused: the pipeline runs forward only."""
        _refuse_backward("incl_bwd", incl_bwd or metric is not None)
        names = one_selector(names, names_filter)
        store: dict[str, torch.Tensor] = {}

        def record(tensor: torch.Tensor, hook: HookPoint) -> None:
            store[hook.name] = tensor.detach().to("cpu", copy=True)  # compact host copies, gathered by pickling

        selected = [name for name in self.select_hook_names(names) if self.owns(name)]
        with self.model.hooks(fwd_hooks=[(selected, record)]):
            logits = self(input_ids, **forward_kwargs)
        self.bytes_sent += sum(t.nelement() * t.element_size() for t in store.values()) * (self.world_size - 1)
        target = torch.device(device) if device is not None else self.device
        acts = {name: t.to(target, dtype=dtype if dtype is not None and t.is_floating_point() else None)
                for part in self._gather(store) for name, t in part.items()}
        return logits, ActivationCache(acts, self)  # type: ignore[arg-type]  # duck-types the K2Model it reads

    # ---- decoding ----------------------------------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **options) -> torch.Tensor:
        """``k2lab.generate`` through the pipeline, with its options (temperature, top_k, top_p, seed, eos_token_id,
        attn_impl, tokenizer, token_healing, attention_mask) -> [B, T + n] on every rank.

        It runs on the last rank, where the logits are, so sampling happens once; before each step the last rank
        broadcasts that step's ids [B, T] (int64), and at a padded prefill its mask [B, T] (uint8); the other ranks
        run their stages on them with their own latent caches (which remember the pads). Per generated token the
        ranks exchange (S - 1) residuals [B, 1, D] plus those ids."""
        if self.is_last:
            try:
                out = generate(_LastStage(self), input_ids, max_new_tokens, **options)
            except Exception as err:
                self._tell(_ERROR, message=f"{type(err).__name__}: {err}")
                raise
            self._tell(_STOP)
            shape = torch.tensor(out.shape, device=self.device)
        else:
            self._follow()
            shape = torch.empty(2, dtype=torch.int64, device=self.device)
        self._broadcast(shape, src=self.last)
        if not self.is_last:
            out = torch.empty(*shape.tolist(), dtype=torch.int64, device=self.device)
        self._broadcast(out, src=self.last)
        return out

    def _tell(self, kind: int, ids: torch.Tensor | None = None, attn_impl: AttnImpl = "auto",
              attention_mask: torch.Tensor | None = None, message: str = "") -> None:
        """From the last rank: what comes next in generate (a step's ids and mask, the end, or an error)."""
        B, T = ids.shape if ids is not None else (0, 0)
        header = [kind, B, T, _ATTN_IMPLS.index(attn_impl), attention_mask is not None]
        self._broadcast(torch.tensor(header, dtype=torch.int64, device=self.device), src=self.last)
        if kind == _STEP:
            self._broadcast(ids.to(self.device, torch.int64).contiguous(), src=self.last)
            if attention_mask is not None:
                self._broadcast(attention_mask.to(self.device, torch.uint8).contiguous(), src=self.last)
        elif kind == _ERROR:
            dist.broadcast_object_list([message], src=self.last)

    def _follow(self) -> None:
        """On the other ranks: run this stage on each step's ids until the last rank says stop."""
        cache = None
        while True:
            header = torch.empty(5, dtype=torch.int64, device=self.device)
            self._broadcast(header, src=self.last)
            kind, B, T, impl, masked = header.tolist()
            if kind == _STOP:
                return
            if kind == _ERROR:
                message = [None]
                dist.broadcast_object_list(message, src=self.last)
                raise RuntimeError(f"generate failed on rank {self.last}: {message[0]}")
            ids = torch.empty(B, T, dtype=torch.int64, device=self.device)
            self._broadcast(ids, src=self.last)
            mask = None
            if masked:
                mask = torch.empty(B, T, dtype=torch.uint8, device=self.device)
                self._broadcast(mask, src=self.last)
            cache = cache if cache is not None else self.new_cache(B)
            mask = None if mask is None else mask.bool()
            self._stage_forward(prepare_inputs(self.model, ids, mask, cache, _ATTN_IMPLS[impl], self.device), cache)

    # ---- communication -----------------------------------------------------------------------------------------------
    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        dist.broadcast(tensor, src=src)
        if self.rank == src:
            self.bytes_sent += tensor.nelement() * tensor.element_size() * (self.world_size - 1)

    def _gather(self, obj: R) -> list[R]:
        out: list[R] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(out, obj)
        return out

    def _on_every_rank(self, what: str, fn: Callable[[], R]) -> R:
        """Run ``fn`` on every rank; if it fails on any, raise on every rank, naming the first failing rank."""
        result, error = None, None
        try:
            result = fn()
        except Exception as err:  # reported to every rank below, then raised
            error = err
        errors = self._gather(None if error is None else f"{type(error).__name__}: {error}")
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            r, message = failed[0]
            others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
            raise RuntimeError(f"rank {r} failed to {what}{others}: {message}") from error
        return result  # type: ignore[return-value]

    def _replicate_head(self) -> None:
        """The final norm and head on every rank, sent by the last rank (not read from the files)."""
        for module in (self.model.norm, self.model.lm_head):
            if not self.is_last:
                module.to_empty(device=self.device)
            for tensor in module.state_dict().values():  # views of the parameters: filled in place
                self._broadcast(tensor, src=self.last)


def _refuse_backward(argument: str, asked: bool) -> None:
    if asked:
        raise NotImplementedError(f"{argument}: PipelinedK2 runs forward only (no backward pass across ranks); "
                                  "take gradients from the model loaded in one process (k2lab.load)")


class _LastStage:
    """What ``k2lab.generate`` drives on the last rank: a model whose call first sends the step's ids to the other
    ranks, then runs the pipeline and returns the logits, which stay here."""

    def __init__(self, pm: PipelinedK2):
        self.pm, self.config, self.device = pm, pm.config, pm.device

    def new_cache(self, batch_size: int, capacity: int = 0) -> LatentCache:
        return self.pm.new_cache(batch_size, capacity)

    def __call__(self, ids: torch.Tensor, cache: LatentCache, attn_impl: AttnImpl = "auto", *,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # A bad step fails here, before the others hear of it.
        inputs = prepare_inputs(self.pm.model, ids, attention_mask, cache, attn_impl, self.device)
        self.pm._tell(_STEP, inputs.ids, attn_impl, inputs.mask)
        return self.pm._stage_forward(inputs, cache)
