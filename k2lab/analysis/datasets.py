"""A list of texts as padded batches of token ids, for running a model (or tracing its routing) over a data set.

    for ids, mask in k2lab.analysis.batches(model, texts, batch_size=8, max_len=512):
        logits = model(ids, attention_mask=mask)          # ids, mask [b, T] on the model's device

    tr = k2lab.routing.trace_dataset(model, texts)    # the routing of every text, as one RoutingTrace
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Literal

import torch
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from ..model.transformer import K2Model


def batches(model: K2Model, texts: Iterable[str], batch_size: int = 8, max_len: int | None = None,
            padding_side: Literal["left", "right"] = "left", progress: bool | None = None
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``texts`` (a list, or any iterable of strings such as a data set's column; read in full first) in order,
    ``batch_size`` at a time (the last batch holds what is left), as ``(ids, attention_mask)``:
    two long tensors [b, T] on the model's device, tokenized by ``model.tokenizer`` and padded on ``padding_side``
    to the batch's longest text (T differs between batches; the mask is 1 at tokens, 0 at pads).

    ``max_len`` keeps the first ``max_len`` tokens of each text (the start, where a text's routing begins; the rest
    is dropped). ``progress``: a tqdm bar counting texts; None shows it when there is more than one batch.

    The arguments are checked before anything runs, so a bad one raises here rather than at the first batch."""
    model.require_tokenizer("batches")
    if isinstance(texts, str | bytes) or not isinstance(texts, Iterable):
        raise TypeError(f"texts must be a list (or other iterable) of strings; one text goes in as [text]; got "
                        f"{type(texts).__name__} {texts!r:.60}")
    texts = list(texts)
    if not texts:
        raise ValueError("texts is empty: at least one text is needed")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts must hold strings only; texts[{i}] is {type(text).__name__} {text!r:.60}")
        if not text:
            raise ValueError(f"texts[{i}] is an empty string: it has no token to run; drop it")
    if not _is_positive_int(batch_size):
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if max_len is not None and not _is_positive_int(max_len):
        raise ValueError(f"max_len must be None (whole texts) or a positive integer, got {max_len!r}")
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if progress not in (None, True, False):
        raise ValueError(f"progress must be None (a bar when there is more than one batch), True or False, got "
                         f"{progress!r}")
    show = len(texts) > batch_size if progress is None else progress
    return _padded_batches(model, texts, batch_size, max_len, padding_side, show)


def _padded_batches(model: K2Model, texts: list[str], batch_size: int, max_len: int | None,
                    padding_side: Literal["left", "right"], show: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The generator behind ``batches``, given checked arguments."""
    with tqdm(total=len(texts), desc="batches", unit="text", disable=not show) as bar:
        for start in range(0, len(texts), batch_size):
            chunk = texts[start:start + batch_size]
            ids, mask = model.to_tokens(chunk, padding_side=padding_side, return_mask=True)  # [b, T] each
            if max_len is not None:
                ids, mask = _keep_start(ids, mask, max_len, padding_side)
            yield ids, mask
            bar.update(len(chunk))


def _keep_start(ids: torch.Tensor, attention_mask: torch.Tensor, max_len: int,
                padding_side: Literal["left", "right"]) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded batch ``ids``, ``attention_mask`` [b, T] cut to each row's first ``max_len`` tokens, still padded on
    ``padding_side``: [b, min(T, max_len)].

    Right padding: the first columns. Left padding: row i's window of width W = min(T, max_len) starts at
    T - max(n_i, W) (n_i its tokens): at its first token when it is longer than W, else on the last W columns,
    which hold all of its tokens after pads. One gather, no loop over rows."""
    T = ids.shape[1]
    width = min(T, max_len)
    if padding_side == "right":
        return ids[:, :width], attention_mask[:, :width]
    lengths = attention_mask.sum(-1)  # [b] n_i
    start = T - lengths.clamp(min=width)  # [b]
    columns = start[:, None] + torch.arange(width, device=ids.device)  # [b, W]
    return ids.gather(1, columns), attention_mask.gather(1, columns)


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
