"""Figures and explorers for the lab. Pure functions take tensors (from a model, a cache, a routing trace or a
training log) and return plotly figures; the explorers in ``widgets`` wire ipywidgets controls to them.

    from k2lab import viz
    viz.yarn_figure(...)                 # a go.Figure
    viz.widgets.router_explorer(tr, tokens)

Needs plotly and ipywidgets (``import k2lab`` alone does not import this package). In JupyterLab call
``k2lab.lab.setup_notebook()`` first: it selects the offline ``plotly_mimetype`` renderer.
"""

from . import widgets
from .attention import pattern_figure, score_split_figure
from .circuits import circuit_figure, influence_heatmap, prediction_figure, router_read_figure
from .experts import (
    coactivation_figure,
    entropy_figure,
    layer_bars_figure,
    load_figure,
    specialization_figure,
)
from .features import expert_share_heatmap, information_figure, purity_figure
from .lines import lines_figure
from .logits import attribution_figure, cache_logit_lens_figure, effect_heatmap, logit_lens_figure
from .residual import residual_norm_figure
from .rope import yarn_figure
from .router import bias_flip_figure, router_token_figure, routing_heatmap
from .scale import parameter_figure
from .tokens import spans_html, tokens_html
from .training import expert_time_figure, loss_figure, qk_clip_figure, singular_values_figure

__all__ = [
    "attribution_figure", "bias_flip_figure", "cache_logit_lens_figure", "circuit_figure", "coactivation_figure",
    "effect_heatmap", "influence_heatmap",
    "entropy_figure", "expert_share_heatmap", "expert_time_figure", "information_figure", "layer_bars_figure",
    "lines_figure", "load_figure", "logit_lens_figure", "loss_figure", "parameter_figure", "pattern_figure",
    "prediction_figure",
    "purity_figure", "qk_clip_figure", "router_read_figure", "router_token_figure", "routing_heatmap",
    "score_split_figure",
    "singular_values_figure", "spans_html", "specialization_figure", "tokens_html", "widgets", "yarn_figure",
]
__all__ += ["residual_norm_figure"]
