"""Speed room: a decode step whose shapes and arguments never change, for CUDA graphs (``generate(compile=True)`` on a
GPU).

A CUDA graph replays the kernels it captured with the arguments they were captured with, so one graph serves every
step only if every step has the same shapes and the same scalars. The plain step does not: attention reads the
positions cached so far ([B, S, C + R], S growing by one a step), and the forward reads the cache length as a Python
number (the new token's position and where it is written). Here, for one new token per row:

- ``StaticCache`` takes over a prefilled ``LatentCache``'s reserved storage, and attention reads all of it at every
  step, [B, capacity, C + R]: the positions not yet written are zeros and masked out. Where the next token is
  written, each row's next position and which slots hold real tokens are device tensors, which the step updates in
  place;
- ``static_decode_step`` runs the model's own modules over it, as ``K2Model.forward`` does: embed, every block
  (``DecoderLayer``) on the given attention path, final norm and head; only the key mask is made here, from those
  device tensors, and each row's cos and sin are read from the model's rotary table (rope.py) at its position.

The cost: each step attends over the whole reserved capacity, the unwritten positions included. The logits equal the
plain step's to float32 rounding (tests/model/test_compiled_quantized_decode.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..attention import LatentCache

if TYPE_CHECKING:
    from ..transformer import K2Model


class StaticCache:
    """A prefilled ``LatentCache``'s storage [B, capacity, C + R] per layer, read whole at every step. ``slot`` (where
    the next token is written, one for all rows), ``positions`` [B] (each row's next position: its real tokens so far)
    and ``real`` [B, capacity] (which slots hold real tokens, not pads or unwritten slots) live on the device."""

    def __init__(self, model: K2Model, cache: LatentCache):
        buffers = cache.storage  # the storage new_cache(capacity=) reserved; written in place from now on
        device = buffers[0].device
        if any(buf.device != device for buf in buffers) or model.device != device:
            raise ValueError(f"a static decode step runs on one device; this model and cache span "
                             f"{sorted({str(b.device) for b in buffers} | {str(model.device)})}")
        self.buffers, self.capacity, self.kv_lora_rank = buffers, buffers[0].shape[1], cache.kv_lora_rank
        for buf in buffers:
            buf[:, cache.length :].zero_()  # masked slots must hold numbers: 0 * garbage could be NaN
        self.real = torch.zeros(cache.batch_size, self.capacity, dtype=torch.bool, device=device)  # [B, capacity]
        self.real[:, : cache.length] = True if cache.token_mask is None else cache.token_mask[:, : cache.length]
        self.positions = self.real.sum(-1)  # [B] the next token's position: its row's real tokens so far
        self.slot = torch.tensor([cache.length], device=device)  # [1] where the next token is written
        self.cos, self.sin = model.rotary.grow(device, self.capacity)  # [N, R] every position a step can reach
        for tensor in (*self.buffers, self.real, self.positions, self.slot, self.cos, self.sin):
            torch._dynamo.mark_static_address(tensor)  # a CUDA graph reads and writes them where they are

    @property
    def length(self) -> int:
        """The positions attention reads at every step: all of them (the unwritten ones masked)."""
        return self.capacity

    def append(self, layer: int, entries: torch.Tensor) -> torch.Tensor:
        """Write one new token's entries [B, 1, C + R] at ``slot``; return the whole storage [B, capacity, C + R]."""
        if entries.shape[1] != 1:
            raise ValueError(f"a static decode step writes one token per row, got {entries.shape[1]}")
        return self.buffers[layer].index_copy_(1, self.slot, entries)

    def rotary(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, 1, R] at each row's next position: the rotary table's rows, as ``prepare_inputs`` reads
        them."""
        return self.cos[self.positions][:, None], self.sin[self.positions][:, None]


def static_decode_step(model: K2Model, ids: torch.Tensor, cache: StaticCache, attn_impl: str) -> torch.Tensor:
    """One new token per row, ids [B, 1] -> float32 logits [B, 1, V], written at ``cache``'s next slot. ``attn_impl``
    "naive" or "absorbed" (``attention.choose_attn_impl`` resolves "auto" before the step)."""
    cache.real.index_fill_(1, cache.slot, True)  # the new token is real, and sees itself
    cos, sin = cache.rotary()  # [B, 1, R]
    mask = cache.real[:, None, None, :]  # [B, 1, 1, capacity]
    x = model.embed(ids)  # [B, 1, D]
    for layer in model.layers:
        x = layer(x, cos, sin, cache, attn_impl, mask)
    cache.slot += 1
    cache.positions += 1
    return model.head(x)
