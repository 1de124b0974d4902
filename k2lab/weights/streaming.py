"""Routed experts streamed from the checkpoint files through one LRU cache with a byte budget.

A K2 MoE layer holds 384 experts and a token uses 8: ~96% of its weights (17 GB per layer in FP8) sit idle for
any one token. With ``load(..., expert_budget_bytes=B)`` every other weight is resident, while each routed
expert stays in its safetensors file and is read when a token first routes to it. The most recently used
experts, at most B bytes of them across all layers, stay in memory; the least recently used leave first.

An expert's tensors are read and converted by the same code either way; only the moment of reading differs, so
outputs equal the fully loaded model's (to float32 rounding where that model runs its experts in pairs, ``MoE``'s
grouped dispatch over views of its stacks).
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model.moe import Experts
from .quant import QuantFormat
from .schema import EXPERT_PROJS

# (layer, expert) -> (the tensors to cache, bytes read from the files for them)
Fetch = Callable[[int, int], tuple[tuple[torch.Tensor, ...], int]]
# glibc keeps freed blocks below its mmap threshold (raised up to 32 MiB as big blocks are freed) in the heap for
# reuse. Each miss frees its read buffers and dequantization temporaries there, and each eviction an expert, so the
# process grows beyond budget + resident weights (benchmarks.real_shape_layer shows it). malloc_trim(0) after a miss
# hands every whole free page back, cheaply next to the miss itself.
try:
    _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
except (AttributeError, OSError, TypeError):  # not glibc (macOS, Windows): nothing to trim this way
    _MALLOC_TRIM = None


@dataclass
class ExpertStats:
    """What the cache did since it was made (or ``reset_stats``)."""

    budget_bytes: int
    hits: int = 0
    misses: int = 0  # each one a read from the files
    bytes_read: int = 0  # stored bytes read (e4m3 values and their scales for an FP8 checkpoint; INT4's packed ones)
    evictions: int = 0
    cached_bytes: int = 0  # held now
    peak_bytes: int = 0  # most ever held (<= budget_bytes)

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses): the share of expert uses served from the cache (0 before any use)."""
        return self.hits / max(1, self.hits + self.misses)

    def __str__(self) -> str:
        return (f"{self.hits:,} hits, {self.misses:,} misses ({self.hit_rate:.0%} hit rate), "
                f"{self.bytes_read / 2**30:.2f} GiB read, {self.evictions:,} evictions, "
                f"peak {self.peak_bytes / 2**30:.2f} of {self.budget_bytes / 2**30:.2f} GiB")


class ExpertCache:
    """Experts of every streamed layer, keyed (layer, expert), least recently used first. An expert larger
    than the whole budget is read for each use and never kept (so a budget of 0 streams everything)."""

    def __init__(self, budget_bytes: int, fetch: Fetch):
        if budget_bytes < 0:
            raise ValueError(f"expert_budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._fetch = fetch
        self._entries: OrderedDict[tuple[int, int], tuple[torch.Tensor, ...]] = OrderedDict()
        self.stats = ExpertStats(budget_bytes)

    def get(self, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
        """Expert ``expert`` of block ``layer``'s stored tensors: from the cache (a hit), else read from the files and
        kept, least recently used experts evicted to stay in the budget (a miss)."""
        key = (layer, expert)
        if key in self._entries:
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return self._entries[key]
        with torch.inference_mode(False):  # kept tensors stay ordinary when read in inference mode (generate), so
            tensors, nbytes_read = self._fetch(layer, expert)  # that a later forward under autograd can use them
        self.stats.misses += 1
        self.stats.bytes_read += nbytes_read
        size = sum(t.nbytes for t in tensors)
        if size <= self.budget_bytes:  # a larger expert is used once and never kept
            while self.stats.cached_bytes + size > self.budget_bytes:
                self.stats.cached_bytes -= sum(t.nbytes for t in self._entries.popitem(last=False)[1])
                self.stats.evictions += 1
            self._entries[key] = tensors
            self.stats.cached_bytes += size
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.cached_bytes)
        if _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)
        return tensors

    def clear(self) -> None:
        """Drop every cached expert (the counts stay)."""
        self._entries.clear()
        self.stats.cached_bytes = 0

    def reset_stats(self) -> None:
        """Start counting afresh; what is cached stays cached."""
        self.stats = ExpertStats(self.budget_bytes, cached_bytes=self.stats.cached_bytes,
                                 peak_bytes=self.stats.cached_bytes)

    def __repr__(self) -> str:
        return f"ExpertCache({len(self._entries)} experts held; {self.stats})"


class StreamedExperts(Experts):
    """One layer's routed experts, each fetched through the shared cache when it runs.

    ``format`` quantized: the cache holds each expert as stored (FP8: gate's e4m3 values and scales, up's, down's;
    INT4: packed values and group scales) and every use dequantizes them (the GPU path). ``UNQUANTIZED``: it holds
    (gate, up, down) ready to use.
    """

    indexable = False  # each expert's matrices are read from the files as it runs: none can be gathered by index

    def __init__(self, num_experts: int, layer: int, cache: ExpertCache, format: QuantFormat,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"):
        super().__init__()  # the weights live in the files, not here
        self.num_experts, self.layer, self.cache, self.format = num_experts, layer, cache, format
        self.dtype, self.device = dtype, torch.device(device)  # of the weights expert_weights returns

    def _apply(self, fn, recurse=True):
        # Follow the model's moves (model.float(), .cuda()): the cache keeps experts as read at load, and from
        # then on each use converts them.
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        self.dtype, self.device = probe.dtype, probe.device
        return super()._apply(fn, recurse)

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I, D], up [I, D], down [D, I]) of expert ``expert``, through the cache, dequantized to ``dtype`` on
        ``device``."""
        tensors = self.cache.get(self.layer, expert)
        n = len(tensors) // len(EXPERT_PROJS)  # tensors per matrix
        return tuple(  # type: ignore[return-value]
            self.format.dequantize(tensors[i * n : (i + 1) * n], self.dtype).to(self.device)
            for i in range(len(EXPERT_PROJS))
        )

    def extra_repr(self) -> str:
        """What ``print(module)`` shows after the class name: the block, the number of experts and the format."""
        return f"layer={self.layer}, {self.num_experts} experts streamed" + (
            f" as {self.format}" if self.format.quantized else "")
