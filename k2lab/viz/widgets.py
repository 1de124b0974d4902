"""Explorers: ipywidgets controls wired to the pure figure functions. Each explorer keeps its latest figure and
error as attributes, so a test (or a curious learner) can read the state without a browser:

    ex = router_explorer(tr, tokens)
    ex.controls["position"].value = 5     # the callback re-renders
    ex.figure, ex.error                   # the figure now shown; the message of a failed render, else None
"""

from __future__ import annotations

import hashlib
import html
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
import torch

from ..analysis.routing import RoutingTrace
from ..config import K2Config
from ..model.rope import inverse_frequencies, yarn_ramp
from ..tokenizer import K2Tokenizer
from .attention import pattern_figure
from .rope import yarn_figure
from .router import router_token_figure, routing_heatmap
from .tokens import tokens_html

Rendered = go.Figure | str  # a figure, or HTML

# What a notebook shows where an explorer's live controls cannot be drawn: opened before its cells run (JupyterLab
# draws widgets only for a trusted notebook), or on a page made from the saved notebook.
RUN_TO_EXPLORE = "Explorer: run this cell to explore (its controls need the running kernel)."

_SHOWN: dict[str, Explorer] = {}  # the explorers made so far, by the id of their view


class _Cells:
    """The source of the IPython cell now running and how many explorers it has made so far, kept by a
    ``pre_run_cell`` handler (registered on first use, once per shell)."""

    source: str | None = None
    made = 0
    shells: set[int] = set()

    @classmethod
    def track(cls) -> bool:
        """Start tracking the running shell's cells; False outside IPython."""
        try:
            from IPython import get_ipython
        except ImportError:
            return False
        shell = get_ipython()
        if shell is None:
            return False
        if id(shell) not in cls.shells:
            cls.shells.add(id(shell))
            shell.events.register("pre_run_cell", cls._started)
            cls.source = getattr(shell, "history_manager", None) and shell.history_manager.input_hist_raw[-1]
        return cls.source is not None

    @classmethod
    def _started(cls, info: Any) -> None:
        cls.source, cls.made = info.raw_cell, 0


def _stable_view_id() -> str | None:
    """An id for an explorer's view that is the same each time its cell runs: made from the cell's source and the
    explorer's place among those the cell makes. The notebook saved after a run then points at the widget state its
    build stored, which JupyterLab draws when the notebook is opened again, instead of "model not found". None
    outside IPython."""
    if not _Cells.track():
        return None
    n, _Cells.made = _Cells.made, _Cells.made + 1
    return "k2lab-explorer-" + hashlib.sha1(f"{_Cells.source}\0{n}".encode()).hexdigest()[:24]


class Explorer:
    """Controls (name -> value widget) and an output area showing ``render(**values)``, redrawn on every change.

    ipywidgets swallow exceptions raised in callbacks, so a failed render is caught, shown in the output area and
    kept in ``error``; ``figure`` keeps the last good result. In a notebook the explorer's view keeps one id across
    runs of its cell (an explorer made again by the same cell replaces the one before), and carries the sentence
    ``RUN_TO_EXPLORE`` for wherever the live controls cannot be drawn."""

    def __init__(self, controls: Mapping[str, widgets.ValueWidget], render: Callable[..., Rendered]):
        self.controls = dict(controls)
        self.render = render
        self.output = widgets.Output()
        self.figure: Rendered | None = None
        self.error: str | None = None
        for control in self.controls.values():
            control.observe(lambda change: self.update(), names="value")
        view_id = _stable_view_id()
        if view_id in _SHOWN:
            _SHOWN.pop(view_id).close()
        self.row = widgets.HBox(list(self.controls.values()))
        self.widget = widgets.VBox([self.row, self.output], **({"model_id": view_id} if view_id else {}))
        if view_id:
            _SHOWN[view_id] = self
        self.update()

    def close(self) -> None:
        """Close the explorer's widgets (their models leave the kernel and the page)."""
        for w in (self.widget, self.row, self.output, *self.controls.values()):
            w.close()

    @property
    def state(self) -> dict[str, Any]:
        """The controls' current values, as passed to ``render``."""
        return {name: control.value for name, control in self.controls.items()}

    def update(self) -> None:
        """Render the current state into the output area (called by every control change)."""
        try:
            self.figure, self.error = self.render(**self.state), None
            shown = self.figure
        except Exception as err:  # shown to the learner: ipywidgets would swallow it
            self.error = f"{type(err).__name__}: {err}"
            shown = f'<pre style="color:#b00">{html.escape(self.error)}</pre>'
        bundle = {"text/html": shown} if isinstance(shown, str) else shown._repr_mimebundle_()
        bundle.setdefault("text/plain", "(figure)")
        self.output.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        bundle = self.widget._repr_mimebundle_()
        bundle["text/plain"] = RUN_TO_EXPLORE
        bundle["text/html"] = f"<p><em>{html.escape(RUN_TO_EXPLORE)}</em></p>"
        display(bundle, raw=True)


def token_explorer(tok: K2Tokenizer, text: str = "") -> Explorer:
    """Type text, see its tokens coloured with their ids (special tokens starred) and the count."""
    box = widgets.Textarea(value=text, description="text", layout=widgets.Layout(width="70%", height="90px"))
    special = widgets.Checkbox(value=True, description="special tokens as control tokens", indent=False,
                               layout=widgets.Layout(width="auto"))  # the full label, not cut at 80 px
    ids = set(tok.special_tokens.values())

    def render(text: str, allow_special: bool) -> str:
        pieces = tok.pieces(text, allow_special=allow_special)
        summary = f"<p>{len(text)} characters, {len(text.encode())} bytes → <b>{len(pieces)} tokens</b></p>"
        return summary + tokens_html(pieces, special_ids=ids)

    return Explorer({"text": box, "allow_special": special}, render)


def yarn_explorer(cfg: K2Config) -> Explorer:
    """Sliders for YaRN's factor s, beta_fast and beta_slow, redrawing the wavelengths and the ramp of ``cfg``."""
    slider = dict(continuous_update=False, style={"description_width": "80px"})
    factor = widgets.FloatLogSlider(value=cfg.rope_factor, base=2, min=0, max=7, step=0.25, description="factor s",
                                    **slider)
    fast = widgets.FloatLogSlider(value=cfg.beta_fast, base=2, min=-2, max=6, step=0.25, description="beta_fast",
                                  **slider)
    slow = widgets.FloatLogSlider(value=cfg.beta_slow, base=2, min=-3, max=4, step=0.25, description="beta_slow",
                                  **slider)

    def render(factor: float, beta_fast: float, beta_slow: float) -> go.Figure:
        new = cfg.replace(rope_type="yarn", rope_factor=factor, beta_fast=beta_fast, beta_slow=beta_slow,
                          max_position_embeddings=int(cfg.original_max_position_embeddings * factor))
        return yarn_figure(inverse_frequencies(new.replace(rope_type=None)), inverse_frequencies(new), yarn_ramp(new),
                           new.original_max_position_embeddings, new.max_position_embeddings,
                           title=f"YaRN with s={factor:g}, beta_fast={beta_fast:g}, beta_slow={beta_slow:g}")

    return Explorer({"factor": factor, "beta_fast": fast, "beta_slow": slow}, render)


def router_explorer(tr: RoutingTrace, tokens: Sequence[str], logits: torch.Tensor | None = None,
                    row: int = 0) -> Explorer:
    """Pick a layer and a token: its router stages (``router_token_figure``). ``logits``: [L_moe, B, T, E] from the
    ``gate.hook_logits`` probes (optional)."""
    _check_trace(tr, tokens, row)
    layer = widgets.Dropdown(options=tr.layers, value=tr.layers[0], description="layer")
    position = widgets.IntSlider(value=len(tokens) - 1, min=0, max=len(tokens) - 1, description="token",
                                 continuous_update=False)

    def render(layer: int, position: int) -> go.Figure:
        j = tr.row(layer)
        return router_token_figure(
            tr.scores[j, row, position], tr.choice_scores[j, row, position] - tr.scores[j, row, position],
            tr.indices[j, row, position], tr.weights[j, row, position],
            logits=None if logits is None else logits[j, row, position],
            unbiased=tr.unbiased_indices[j, row, position],
            title=f"layer {layer}, token {position} {tokens[position]!r}")

    return Explorer({"layer": layer, "position": position}, render)


def routing_explorer(tr: RoutingTrace, tokens: Sequence[str], row: int = 0) -> Explorer:
    """Pick a layer: every token's chosen experts and weights (``routing_heatmap``)."""
    _check_trace(tr, tokens, row)
    layer = widgets.Dropdown(options=tr.layers, value=tr.layers[0], description="layer")
    E = tr.scores.shape[-1]

    def render(layer: int) -> go.Figure:
        j = tr.row(layer)
        return routing_heatmap(tr.indices[j, row], tr.weights[j, row], E, tokens, title=f"Routing at layer {layer}")

    return Explorer({"layer": layer}, render)


def attention_explorer(patterns: torch.Tensor, tokens: Sequence[str], layers: Sequence[int] | None = None
                       ) -> Explorer:
    """Pick a layer: all its heads' patterns. ``patterns``: [L, H, T, S] (one batch row of ``hook_pattern``)."""
    patterns = torch.as_tensor(patterns)
    if patterns.dim() != 4 or patterns.numel() == 0:
        raise ValueError(f"patterns must be [L, H, T, S] with something in it, got shape {list(patterns.shape)}")
    names = list(layers) if layers is not None else list(range(patterns.shape[0]))
    if len(names) != patterns.shape[0]:
        raise ValueError(f"layers has {len(names)} entries but patterns has {patterns.shape[0]} layers")
    layer = widgets.Dropdown(options=names, value=names[0], description="layer")

    def render(layer: int) -> go.Figure:
        return pattern_figure(patterns[names.index(layer)], tokens, title=f"Attention patterns, layer {layer}")

    return Explorer({"layer": layer}, render)


def _check_trace(tr: RoutingTrace, tokens: Sequence[str], row: int) -> None:
    """A trace with MoE layers and tokens, one token label per position, and ``row`` one of its batch rows."""
    if not tr.layers or tr.indices.numel() == 0:
        raise ValueError("the routing trace is empty (no MoE layer or no tokens): nothing to explore")
    B, T = tr.indices.shape[1:3]
    if len(tokens) != T:
        raise ValueError(f"tokens has {len(tokens)} entries but the trace has {T} positions")
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < B:
        raise ValueError(f"row must be a batch row of the trace, 0..{B - 1}, got {row!r}")
