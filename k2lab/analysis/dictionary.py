"""Sparse dictionaries for K2's probes: TopK sparse autoencoders and transcoders, trained on activations streamed over
a corpus, scored as the field scores them, saved in SAELens's layout, and spliced into the model (splicing.py).

    sae = train_sae(model, "layers.3.hook_resid_post", texts, d_sae=1024, k=32)
    transcoder = train_transcoder(model, 3, texts)      # layers.3.post_attention_layernorm.hook_out -> hook_mlp_out
    metrics = evaluate(model, sae.probe, sae, heldout_texts)   # FVU, mean L0, dead features, CE recovered
    sae.save("my_sae"); sae = load("my_sae")                   # cfg.json + sae_weights.safetensors, as SAELens
    with splice(model, sae.probe, sae) as features: ...       # features.name: "layers.3.hook_resid_post.hook_features"

TopK SAE (Gao et al. 2024, "Scaling and evaluating sparse autoencoders"), on x [..., d_in]:

    f = TopK_k(ReLU((x - b_dec) @ W_enc + b_enc))     # [..., d_sae]: the k largest pre-activations, the rest 0
    x_hat = f @ W_dec + b_dec                         # [..., d_in]; each feature's direction (a row of W_dec) unit norm

A transcoder (Dunefsky et al. 2024) replaces a block's feed-forward (here the MoE) by a sparse map from its input to
its output, the same way but without the pre-encoder bias: f = TopK_k(ReLU(x @ W_enc + b_enc)), y_hat = f @ W_dec +
b_dec [..., d_out]. Parameters are named and shaped as SAELens's (W_enc [d_in, d_sae], b_enc [d_sae], W_dec
[d_sae, d_out], b_dec [d_out]), so a TopK SAE saved here loads in SAELens (``TopKSAE.load_from_disk``) and one saved by
SAELens (architecture "topk") loads here. SAELens has no TopK transcoder: a transcoder's config says
"topk_transcoder", which only k2lab reads.

Training follows Gao et al.: activations scaled to a mean squared norm of d_in (folded back into the weights at the
end), decoder initialised with random unit rows and the encoder as its transpose (an SAE), b_dec at the mean of the
first buffer, Adam, the loss the normalised squared error plus 1/32 of the AuxK loss (the top ``aux_k`` latents that
have not fired for ``dead_after_tokens`` tokens reconstruct the residual error, which revives them), decoder rows kept
at unit norm (the gradient's component along each row removed before the step, the rows renormalised after it).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from .splicing import ProbeSpec, _check_dictionary, _check_finite, _probe_pair, _reads_heads, _widths, splice

if TYPE_CHECKING:
    from ..model.hooks import HookPoint
    from ..model.transformer import K2Model

CONFIG_FILE = "cfg.json"  # SAELens's file names
WEIGHTS_FILE = "sae_weights.safetensors"
# The SAELens config layout written (version 6: the model and probe under "metadata"); SAELens reads this field to
# choose how to parse the rest.
SAE_LENS_FORMAT = "6.0.0"
ASSETS_DIR = Path(str(resources.files("k2lab") / "lab" / "assets"))  # the shipped dictionaries: sae_*, transcoder_*


class TopKDictionary(nn.Module):
    """What the TopK SAE and the transcoder share: f = TopK_k(ReLU(pre_activations(x))), decode(f) = f @ W_dec + b_dec.
    ``metadata`` holds where it was trained (hook_name, hook_name_out for a transcoder, model_name) and how."""

    architecture = ""  # the "architecture" of cfg.json
    # "hook_z": x is a probe's [..., H, V] heads flattened to [..., H * V] (SAELens's reshape_activations), which
    # splice and evaluate do before encoding and undo after decoding; "none": x is the probe's last axis.
    reshape_activations = "none"

    def __init__(self, d_in: int, d_out: int, d_sae: int, k: int, metadata: dict | None = None) -> None:
        super().__init__()
        for name, value in (("d_in", d_in), ("d_out", d_out), ("d_sae", d_sae), ("k", k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if k > d_sae:
            raise ValueError(f"k={k} features cannot be active out of d_sae={d_sae}: k must be at most d_sae")
        if metadata is not None and not isinstance(metadata, dict):
            raise TypeError(f"metadata must be a dict (hook_name, model_name, ...), got {type(metadata).__name__}")
        self.d_in, self.d_out, self.d_sae, self.k = d_in, d_out, d_sae, k
        self.W_enc = nn.Parameter(torch.empty(d_in, d_sae))  # [d_in, d_sae]
        self.b_enc = nn.Parameter(torch.zeros(d_sae))  # [d_sae]
        self.W_dec = nn.Parameter(torch.empty(d_sae, d_out))  # [d_sae, d_out] one unit-norm direction per feature
        self.b_dec = nn.Parameter(torch.zeros(d_out))  # [d_out]
        self.metadata: dict = dict(metadata or {})
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Random unit decoder rows, an encoder of random unit columns, zero biases (TopKSAE ties the encoder)."""
        self.W_dec.copy_(unit_rows(torch.randn(self.d_sae, self.d_out, generator=generator)))
        self.W_enc.copy_(unit_rows(torch.randn(self.d_sae, self.d_in, generator=generator)).T)
        self.b_enc.zero_()
        self.b_dec.zero_()

    @property
    def probe(self) -> ProbeSpec:
        """Where it was trained, as ``splice`` takes it: a probe name, or (read, write) for a transcoder."""
        if "hook_name" not in self.metadata:
            raise ValueError(f"this {type(self).__name__} records no probe (metadata['hook_name']); give splice the "
                             "probe name")
        read, write = self.metadata["hook_name"], self.metadata.get("hook_name_out")
        return read if write is None else (read, write)

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d_in] -> [..., d_sae]."""
        return x @ self.W_enc + self.b_enc

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d_in] -> features [..., d_sae]: the k largest pre-activations through a ReLU, every other 0."""
        if x.shape[-1] != self.d_in:
            raise ValueError(f"{type(self).__name__} encodes d_in={self.d_in}, got an input of shape {tuple(x.shape)}")
        pre = self.pre_activations(x)  # [..., d_sae]
        top = pre.topk(self.k, dim=-1)  # values and indices [..., k]
        return torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())

    def decode(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., d_sae] -> reconstruction [..., d_out]."""
        if features.shape[-1] != self.d_sae:
            raise ValueError(f"{type(self).__name__} decodes d_sae={self.d_sae} features, got shape "
                             f"{tuple(features.shape)}")
        return features @ self.W_dec + self.b_dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)): [..., d_in] -> [..., d_out]."""
        return self.decode(self.encode(x))

    def config(self) -> dict:
        """cfg.json: SAELens's fields for this architecture."""
        return {"architecture": self.architecture, "d_in": self.d_in, "d_sae": self.d_sae, "k": self.k,
                "dtype": str(self.W_enc.dtype).removeprefix("torch."), "device": "cpu",
                "apply_b_dec_to_input": False, "normalize_activations": "none",
                "reshape_activations": self.reshape_activations,
                "rescale_acts_by_decoder_norm": False,
                "metadata": {"sae_lens_version": SAE_LENS_FORMAT, **self.metadata}}

    def save(self, path: str | Path) -> Path:
        """Write ``path/cfg.json`` and ``path/sae_weights.safetensors`` (SAELens's layout); returns the folder.

        Both files are written whole into a temporary folder before either replaces what ``path`` holds, so a save that
        fails leaves ``path`` as it was; its other files stay. Weights that are not finite are refused."""
        path = Path(path)
        weights = {name: p.detach().cpu().contiguous() for name, p in self.named_parameters()}
        _check_finite(weights, f"{type(self).__name__}.save")

        def write(folder: Path) -> None:
            save_file(weights, folder / WEIGHTS_FILE)
            (folder / CONFIG_FILE).write_text(json.dumps(self.config(), indent=2) + "\n")

        _write_folder(path, write)
        return path

    def extra_repr(self) -> str:
        """What ``print(module)`` shows after the class name: d_in, d_out, d_sae and k."""
        return f"d_in={self.d_in}, d_out={self.d_out}, d_sae={self.d_sae}, k={self.k}"


class TopKSAE(TopKDictionary):
    """Gao et al.'s TopK sparse autoencoder of one probe: d_in -> d_sae features (k active per token) -> d_in. The
    decoder bias is also subtracted before encoding (SAELens's apply_b_dec_to_input). With
    ``reshape_activations="hook_z"`` it is an SAE of attention's per-head output ``hook_z`` [..., H, V], its heads
    flattened to d_in = H * V (as SAELens trains hook_z SAEs)."""

    architecture = "topk"

    def __init__(self, d_in: int, d_sae: int, k: int, metadata: dict | None = None, *,
                 reshape_activations: str = "none") -> None:
        super().__init__(d_in, d_in, d_sae, k, metadata)
        if reshape_activations not in ("none", "hook_z"):
            raise ValueError(f"reshape_activations must be 'none' or 'hook_z' (heads flattened, as SAELens), got "
                             f"{reshape_activations!r}")
        self.reshape_activations = reshape_activations

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Random unit decoder rows, the encoder tied to them at the start (W_enc = W_dec^T), zero biases."""
        super().reset_parameters(generator)
        self.W_enc.copy_(self.W_dec.T)

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """(x - b_dec) @ W_enc + b_enc: x [..., d_in] -> [..., d_sae], the decoder bias subtracted before encoding
        (SAELens's apply_b_dec_to_input)."""
        return (x - self.b_dec) @ self.W_enc + self.b_enc

    def config(self) -> dict:
        """cfg.json: SAELens's TopK SAE fields, ``apply_b_dec_to_input`` true."""
        return {**super().config(), "apply_b_dec_to_input": True}


class Transcoder(TopKDictionary):
    """A TopK transcoder: the input of a block's feed-forward (d_in) -> d_sae features (k active) -> its output
    (d_out), in place of the feed-forward. Config architecture "topk_transcoder", with SAELens's transcoder fields."""

    architecture = "topk_transcoder"

    def config(self) -> dict:
        """cfg.json: SAELens's transcoder fields, ``d_out`` among them."""
        return {**super().config(), "d_out": self.d_out}


def unit_rows(matrix: torch.Tensor) -> torch.Tensor:
    """Each row of ``matrix`` [R, C] divided by its norm."""
    return matrix / matrix.norm(dim=-1, keepdim=True).clamp(min=1e-12)


def _write_folder(path: Path, write) -> None:
    """``write(folder)`` into a temporary folder inside ``path`` (made if missing), then each file it wrote renamed
    into ``path``, cfg.json last: a failure while writing leaves ``path`` as it was (a folder made for the save is
    removed again), and the other files ``path`` holds are never touched. (``ActivationCache.save`` and
    ``k2lab.weights.save_checkpoint`` stage their files too; their helpers are private to those modules and swap
    whole folders.)"""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a folder: a dictionary is saved as a folder")
    made = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    staging = path / f".saving-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    try:
        write(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if made:
            path.rmdir()
        raise
    for written in sorted(staging.iterdir(), key=lambda file: (file.name == CONFIG_FILE, file.name)):
        os.replace(written, path / written.name)  # the weights, then the config that describes them
    staging.rmdir()


def load(path: str | Path) -> TopKDictionary:
    """A dictionary saved by ``save`` (or a TopK SAE saved by SAELens) from its folder. What the folder's files do not
    agree on (a field missing from cfg.json, a tensor of another shape or dtype than the config says, a tensor that
    is not finite, a file that is not JSON or not safetensors) is refused, naming the file and the field."""
    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise FileNotFoundError(f"{path} holds no dictionary: expected {CONFIG_FILE} and {WEIGHTS_FILE} (the layout "
                                "of dictionary.save and of SAELens)")
    try:
        cfg = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_file} is not valid JSON: {err}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_file} must hold a JSON object (the dictionary's fields), got a "
                         f"{type(cfg).__name__}")
    architecture = cfg.get("architecture")
    expected = {"topk": {"apply_b_dec_to_input": True}, "topk_transcoder": {"apply_b_dec_to_input": False}}
    if architecture not in expected:
        raise ValueError(f"{config_file}: architecture {architecture!r}; k2lab reads 'topk' and "
                         "'topk_transcoder' (load others with sae_lens.SAE.load_from_disk: splice takes any module "
                         "with encode and decode)")
    reshape = cfg.get("reshape_activations", "none")
    if reshape not in (("none", "hook_z") if architecture == "topk" else ("none",)):
        raise ValueError(f"{config_file}: reshape_activations={reshape!r}; k2lab's {architecture} reads 'none'"
                         f"{' and hook_z' if architecture == 'topk' else ''}")
    settings = {"normalize_activations": "none", "rescale_acts_by_decoder_norm": False, **expected[architecture]}
    for field, value in settings.items():
        if cfg.get(field, value) != value:
            raise ValueError(f"{config_file}: {field}={cfg[field]!r}; k2lab's {architecture} needs {value!r}")
    sizes = ("d_in", "d_sae", "k") if architecture == "topk" else ("d_in", "d_out", "d_sae", "k")
    missing = [field for field in sizes if field not in cfg]
    if missing:
        raise ValueError(f"{config_file} has no {', '.join(missing)} (a {architecture} dictionary's sizes)")
    saved_metadata = cfg.get("metadata", {})
    if not isinstance(saved_metadata, dict):
        raise ValueError(f"{config_file}: metadata must be a JSON object, got a {type(saved_metadata).__name__}")
    metadata = {key: value for key, value in saved_metadata.items()
                if key not in ("sae_lens_version", "sae_lens_training_version")}
    try:
        if architecture == "topk":
            dictionary = TopKSAE(cfg["d_in"], cfg["d_sae"], cfg["k"], metadata, reshape_activations=reshape)
        else:
            dictionary = Transcoder(cfg["d_in"], cfg["d_out"], cfg["d_sae"], cfg["k"], metadata)
    except ValueError as err:
        raise ValueError(f"{config_file}: {err}") from None
    try:
        weights = load_file(weights_file)
    except Exception as err:  # safetensors raises its own SafetensorError (and OSError, ValueError) on a bad file
        raise ValueError(f"{weights_file} is not a readable safetensors file (truncated, or another format): "
                         f"{err}") from None
    state = {}
    for name, parameter in dictionary.named_parameters():
        if name not in weights:
            raise ValueError(f"{weights_file} has no tensor {name} (it holds {sorted(weights)})")
        tensor = weights[name]
        if not tensor.is_floating_point():
            raise ValueError(f"{weights_file}: {name} is {str(tensor.dtype).removeprefix('torch.')}; a dictionary's "
                             f"weights are floating point")
        if tensor.shape != parameter.shape:
            raise ValueError(f"{weights_file}: {name} is {list(tensor.shape)} but {CONFIG_FILE} gives "
                             f"{list(parameter.shape)} ({', '.join(f'{f}={cfg[f]}' for f in sizes)})")
        state[name] = tensor.float()
    _check_finite(state, str(weights_file))
    dictionary.load_state_dict(state)
    return dictionary


def to_saelens(dictionary: TopKDictionary) -> nn.Module:
    """The same dictionary as a SAELens module (needs sae-lens, the test extra): a TopK SAE as ``sae_lens.TopKSAE``,
    a transcoder as ``sae_lens.Transcoder`` with its activation set to SAELens's own TopK(k); the metadata (probes,
    model) goes with it. In memory both compute what k2lab's does, and SAELens's tools take them.

    The limit: SAELens has no TopK transcoder architecture. What its ``save_model`` writes of a converted transcoder
    says "transcoder", and SAELens loads that back as a ReLU transcoder, on which every positive pre-activation fires
    (not only the top k). Keep transcoders in k2lab's folder (``save``; ``load`` reads it) and convert after loading.
    A TopK SAE has no such limit: SAELens reads k2lab's folder as it is (``sae_lens.SAE.load_from_disk``)."""
    if not isinstance(dictionary, TopKDictionary):
        raise TypeError(f"to_saelens converts k2lab's TopKSAE and Transcoder, got {type(dictionary).__name__}")
    try:
        import sae_lens
        from sae_lens.saes.sae import SAEMetadata
        from sae_lens.saes.topk_sae import TopK
    except ImportError as err:
        raise ImportError("to_saelens needs sae-lens: pip install 'k2lab[test]' (or pip install sae-lens)") from err
    dtype = str(dictionary.W_enc.dtype).removeprefix("torch.")
    metadata = SAEMetadata(**dictionary.metadata)
    if isinstance(dictionary, TopKSAE):
        converted = sae_lens.TopKSAE(sae_lens.TopKSAEConfig(
            d_in=dictionary.d_in, d_sae=dictionary.d_sae, k=dictionary.k, dtype=dtype, metadata=metadata))
    else:
        converted = sae_lens.Transcoder(sae_lens.TranscoderConfig(
            d_in=dictionary.d_in, d_sae=dictionary.d_sae, d_out=dictionary.d_out, dtype=dtype,
            apply_b_dec_to_input=False, metadata=metadata))
        converted.activation_fn = TopK(dictionary.k)  # SAELens's TopK: ReLU of the k largest, the rest 0
    converted.load_state_dict({name: p.detach().clone() for name, p in dictionary.named_parameters()})
    return converted


def shipped() -> list[str]:
    """The names of the dictionaries k2lab ships (folders ``sae_*`` and ``transcoder_*`` of k2lab/lab/assets)."""
    return sorted(p.name for p in ASSETS_DIR.iterdir()
                  if p.name.startswith(("sae_", "transcoder_")) and (p / CONFIG_FILE).is_file())


def load_shipped(name: str) -> TopKDictionary:
    """A shipped dictionary by its name (see ``shipped()``)."""
    names = shipped()
    if name not in names:
        raise KeyError(f"no shipped dictionary named {name!r}; shipped: {names}")
    return load(ASSETS_DIR / name)


# ---- activations streamed over a corpus ------------------------------------------------------------------------------
class _StopForward(Exception):
    """Raised by a hook once the last probe wanted has fired: the rest of the forward is not needed."""


def token_batches(tokenizer, texts: Iterable[str], batch_size: int = 8, context: int = 256
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each text's tokens, closed by EOS, cut into windows of ``context`` tokens, packed ``batch_size`` windows at a
    time and padded on the right with the tokenizer's ``[PAD]`` (EOS if it has none, as ``encode_padded``) -> (ids
    [B, T], mask [B, T] bool, True at tokens), T <= context. ``texts``: strings (a list, or any iterable); one string
    alone is refused, since each of its characters would be a text."""
    _check_texts(texts)
    _check_positive(batch_size=batch_size, context=context)
    return _token_batches(tokenizer, texts, batch_size, context, tokenizer.special_tokens.get("[PAD]",
                                                                                              tokenizer.eos_id))


def _token_batches(tokenizer, texts: Iterable[str], batch_size: int, context: int, pad: int
                   ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    windows: list[list[int]] = []
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{index}] is a {type(text).__name__}; texts are strings")
        ids = [*tokenizer.encode(text), tokenizer.eos_id]
        windows += [ids[start:start + context] for start in range(0, len(ids), context)]
        while len(windows) >= batch_size:
            yield _padded(windows[:batch_size], pad)
            windows = windows[batch_size:]
    if windows:
        yield _padded(windows, pad)


def _padded(windows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(map(len, windows))
    ids = torch.full((len(windows), T), pad, dtype=torch.long)  # [B, T]
    mask = torch.zeros(len(windows), T, dtype=torch.bool)  # [B, T]
    for row, window in enumerate(windows):
        ids[row, :len(window)] = torch.tensor(window)
        mask[row, :len(window)] = True
    return ids, mask


def _check_texts(texts: Iterable[str]) -> None:
    if isinstance(texts, str):
        raise TypeError(f"texts must be a list of strings, got one string ({len(texts):,} characters), each of whose "
                        f"characters would be read as a text: pass [text]")
    if not isinstance(texts, Iterable):
        raise TypeError(f"texts must be a list (or iterable) of strings, got {type(texts).__name__}")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an integer, got {seed!r}")


def _rows(name: str, activation: torch.Tensor) -> torch.Tensor:
    """A probe's activation as the rows a dictionary reads: [B, T, D] as it is, attention's ``hook_z`` [B, T, H, V]
    with its heads flattened to [B, T, H * V] (as SAELens trains hook_z SAEs); any other layout is refused."""
    if activation.dim() == 3:
        return activation
    if activation.dim() == 4 and name.endswith("self_attn.hook_z"):
        return activation.flatten(-2)
    raise ValueError(f"{name} is {list(activation.shape)}: dictionaries train on [B, T, D] probes and on hook_z [B, T, "
                     f"H, V] (its heads flattened, as SAELens), not on this layout")


@torch.no_grad()
def stream_activations(model: K2Model, probes: Sequence[str], texts: Iterable[str], batch_size: int = 8,
                       context: int = 256) -> Iterator[list[torch.Tensor]]:
    """Per batch of windows (``token_batches``), each probe's activations at the real tokens (pads left out):
    a list of float32 [N, D_probe] tensors, one per probe. The forward stops once the last probe in firing order
    has fired (later blocks and the head are not run). Probes must be [B, T, D] ones, or hook_z [B, T, H, V], whose
    rows are its heads flattened, [N, H * V]."""
    probes = list(probes)
    recorded: dict[str, torch.Tensor] = {}

    def record(activation: torch.Tensor, hook: HookPoint) -> None:
        recorded[hook.name] = activation
        if len(recorded) == len(probes):
            raise _StopForward

    tokenizer = model.require_tokenizer("stream_activations")
    for ids, mask in token_batches(tokenizer, texts, batch_size, context):
        recorded.clear()
        with model.hooks(fwd_hooks=[(probes, record)]):
            try:
                model(ids.to(model.device), attention_mask=None if mask.all() else mask)
            except _StopForward:
                pass
        missing = [name for name in probes if name not in recorded]
        if missing:
            raise RuntimeError(f"stream_activations: the probes {missing} did not fire in the forward")
        keep = mask.to(model.device)
        yield [_rows(name, recorded[name])[keep].float() for name in probes]


def _shuffled(chunks: Iterator[list[torch.Tensor]], buffer_tokens: int, batch_tokens: int,
              generator: torch.Generator) -> Iterator[list[torch.Tensor]]:
    """Minibatches of ``batch_tokens`` rows drawn from a buffer of about ``buffer_tokens`` rows filled from ``chunks``.
    Tokens of one window are neighbours and documents differ: each time the buffer is full, half of it, shuffled, goes
    out and the other half stays to mix with the next fill (as SAELens's activation store does), so a minibatch holds
    many documents and the mix drifts slowly instead of jumping at every fill. Every minibatch is full: the rows left
    at the end that do not fill one are dropped (a batch of one row has no variance to normalise the error by)."""
    buffer: list[list[torch.Tensor]] = []
    held = 0
    for chunk in chunks:
        buffer.append(chunk)
        held += len(chunk[0])
        if held < buffer_tokens:
            continue
        rows = [torch.cat(parts) for parts in zip(*buffer, strict=True)]  # per probe [held, D]
        order = torch.randperm(held, generator=generator)
        out = max(batch_tokens, held // 2 // batch_tokens * batch_tokens)
        for start in range(0, out, batch_tokens):
            yield [r[order[start:start + batch_tokens]] for r in rows]
        buffer, held = [[r[order[out:]] for r in rows]], held - out
    rows = [torch.cat(parts) for parts in zip(*buffer, strict=True)] if buffer else []
    if rows and len(rows[0]):
        order = torch.randperm(len(rows[0]), generator=generator)
        for start in range(0, len(order) - batch_tokens + 1, batch_tokens):
            yield [r[order[start:start + batch_tokens]] for r in rows]


# ---- training --------------------------------------------------------------------------------------------------------
def train_sae(model: K2Model, probe: str, texts: Iterable[str], d_sae: int = 1024, k: int = 32,
              **options) -> TopKSAE:
    """A TopK SAE of ``probe`` ([B, T, D] probes: the residual stream, attention or MoE outputs, norm outputs; or
    attention's hook_z [B, T, H, V], heads flattened as SAELens trains them: reshape_activations "hook_z"), trained on
    the activations of ``texts``; ``options`` as ``train_dictionary``."""
    name = _probe_pair(model, probe)[0]
    width, reshape = _probe_width(model, name)
    sae = TopKSAE(width, d_sae, k, {"hook_name": name}, reshape_activations=reshape)
    return train_dictionary(model, sae, name, texts, **options)


def train_transcoder(model: K2Model, layer: int, texts: Iterable[str], d_sae: int = 1024, k: int = 32,
                     **options) -> Transcoder:
    """A TopK transcoder of block ``layer``'s feed-forward (its MoE, or the dense MLP of block 0): from
    ``layers.{layer}.post_attention_layernorm.hook_out`` to ``layers.{layer}.hook_mlp_out``; ``options`` as
    ``train_dictionary``."""
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(model.layers):
        raise ValueError(f"layer must be a block index in 0..{len(model.layers) - 1}, got {layer!r}")
    read, write = f"layers.{layer}.post_attention_layernorm.hook_out", f"layers.{layer}.hook_mlp_out"
    width = model.config.hidden_size
    transcoder = Transcoder(width, width, d_sae, k, {"hook_name": read, "hook_name_out": write})
    return train_dictionary(model, transcoder, (read, write), texts, **options)


def _probe_width(model: K2Model, name: str) -> tuple[int, str]:
    """The width of a probe's rows as a dictionary reads them (``_rows``) and the reshape that gives them ("hook_z":
    heads flattened, else "none"), from a forward of two tokens stopped once it fires."""
    widths: list[tuple[int, str]] = []

    def measure(activation: torch.Tensor, hook: HookPoint) -> None:
        rows = _rows(name, activation)
        widths.append((rows.shape[-1], "none" if rows.dim() == activation.dim() else "hook_z"))
        raise _StopForward

    with torch.no_grad(), model.hooks(fwd_hooks=[(name, measure)]):
        try:
            model(torch.zeros(1, 2, dtype=torch.long, device=model.device))
        except _StopForward:
            pass
    return widths[0]


def train_dictionary(model: K2Model, dictionary: TopKDictionary, probe: ProbeSpec, texts: Iterable[str], *,
                     tokens: int = 2_000_000, batch_tokens: int = 4096, context: int = 256, batch_size: int = 8,
                     buffer_tokens: int = 262_144, seed: int = 0, **options) -> TopKDictionary:
    """Train ``dictionary`` in place on ``probe``'s activations over ``texts`` (a probe name, or (read, write) for a
    transcoder) and return it, on the CPU, until ``tokens`` tokens or the texts run out.

    The model runs ``batch_size`` windows of ``context`` tokens at a time (pads excluded, the forward stopped after the
    probe); activations go through a shuffled buffer of ``buffer_tokens`` rows into steps of ``batch_tokens`` rows
    (``fit``, which takes ``options``: lr, aux_k, aux_coefficient, dead_after_tokens, decay_fraction, progress).
    ``dictionary.metadata`` records the probe's context and, under "k2lab_training", the run. Texts that run out before
    ``tokens`` are refused, with the tokens they gave."""
    if not isinstance(dictionary, TopKDictionary):
        raise TypeError(f"train_dictionary trains a TopKSAE or a Transcoder, got {type(dictionary).__name__}")
    read, write = _probe_pair(model, probe)
    probes = [read] if read == write else [read, write]
    _check_texts(texts)
    _check_seed(seed)
    _check_positive(tokens=tokens, batch_tokens=batch_tokens, buffer_tokens=buffer_tokens, context=context,
                    batch_size=batch_size)
    if buffer_tokens < batch_tokens:
        raise ValueError(f"buffer_tokens={buffer_tokens:,} cannot fill one step of batch_tokens={batch_tokens:,}: "
                         f"give buffer_tokens >= batch_tokens")
    for name, width in [(read, dictionary.d_in)] + ([] if read == write else [(write, dictionary.d_out)]):
        rows, rows_reshape = _probe_width(model, name)
        if rows != width or rows_reshape != dictionary.reshape_activations:
            heads = " (heads flattened: reshape_activations='hook_z')" if rows_reshape == "hook_z" else ""
            raise ValueError(f"train_dictionary: {name}'s rows are {rows} wide{heads}, but the "
                             f"{type(dictionary).__name__} reads {width} (reshape_activations="
                             f"{dictionary.reshape_activations!r}); train_sae and train_transcoder size it for you")
    generator = torch.Generator().manual_seed(seed)
    batches = _shuffled(stream_activations(model, probes, texts, batch_size, context), buffer_tokens, batch_tokens,
                        generator)
    steps = max(1, tokens // batch_tokens)
    record = fit(dictionary, batches, steps=steps, seed=seed, **options)
    if record["steps"] < steps:
        raise ValueError(f"train_dictionary: the texts ran out after {record['tokens']:,} tokens ({record['steps']} "
                         f"steps of {batch_tokens:,}) of the {tokens:,} asked ({steps} steps); give more texts, or "
                         f"ask for {record['tokens']:,} tokens or fewer")
    dictionary.metadata.update(context_size=context, prepend_bos=False,
                               k2lab_training={**record, "batch_tokens": batch_tokens})
    return dictionary


@torch.enable_grad()  # trains also where autograd is off (the lab's notebooks turn it off)
def fit(dictionary: TopKDictionary, batches: Iterable[Sequence[torch.Tensor]], steps: int, *, lr: float = 1e-3,
        aux_k: int | None = None, aux_coefficient: float = 1 / 32, dead_after_tokens: int = 200_000,
        decay_fraction: float = 0.2, seed: int = 0, progress: bool = True) -> dict:
    """Train ``dictionary`` from fresh weights (seeded) on ``batches`` of activations, ``[x]`` for an SAE or ``[x, y]``
    for a transcoder ([N, d_in], [N, d_out], on the dictionary's device), for ``steps`` steps or until the batches
    run out; returns the run's record (tokens, steps, the smoothed training FVU and the dead fraction at the end...).

    Adam at ``lr``, decayed linearly to 0 over the last ``decay_fraction`` of the steps. AuxK: the top ``aux_k``
    (default d_out / 2) of the latents silent for ``dead_after_tokens`` tokens reconstruct the error, weighted
    ``aux_coefficient``. A tqdm bar shows the smoothed training FVU and the dead fraction. A batch of the wrong width,
    with a NaN or infinite row, or whose targets do not vary is refused, naming it."""
    if not isinstance(dictionary, TopKDictionary):
        raise TypeError(f"fit trains a TopKSAE or a Transcoder, got {type(dictionary).__name__}")
    if not isinstance(batches, Iterable):
        raise TypeError(f"batches must be an iterable of [x] or [x, y] tensors, got {type(batches).__name__}")
    _check_positive(steps=steps, dead_after_tokens=dead_after_tokens)
    _check_seed(seed)
    if aux_k is not None:
        _check_positive(aux_k=aux_k)
    for name, value, low in (("lr", lr, 0.0), ("aux_coefficient", aux_coefficient, 0.0),
                             ("decay_fraction", decay_fraction, 0.0)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < low \
                or (name == "lr" and value == 0) or (name == "decay_fraction" and value > 1):
            bounds = {"lr": "> 0", "aux_coefficient": ">= 0", "decay_fraction": "in [0, 1]"}[name]
            raise ValueError(f"{name} must be a number {bounds}, got {value!r}")
    aux_k = aux_k if aux_k is not None else max(1, dictionary.d_out // 2)
    dictionary.reset_parameters(torch.Generator().manual_seed(seed))
    optimizer = torch.optim.Adam(dictionary.parameters(), lr=lr, betas=(0.9, 0.999), eps=6.25e-10)
    decay_steps = max(1.0, steps * decay_fraction)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (steps - step) / decay_steps))
    since_fired = torch.zeros(dictionary.d_sae, dtype=torch.long, device=dictionary.W_enc.device)  # [d_sae] tokens
    # since each latent last fired
    dead = since_fired > dead_after_tokens  # [d_sae]
    scale_in = scale_out = None
    seen, step, start = 0, 0, time.perf_counter()
    smoothed_fvu = float("nan")
    bar = tqdm(total=steps, unit="step", desc=type(dictionary).__name__, disable=not progress)
    for index, batch in enumerate(batches):
        x, y = _checked_batch(dictionary, batch, index)  # [N, d_in], [N, d_out]
        if scale_in is None:  # Gao et al.: scale so that E|x|^2 = d; start the decoder bias at the mean output
            scale_in = x.pow(2).sum(-1).mean().div(dictionary.d_in).sqrt().item()
            scale_out = y.pow(2).sum(-1).mean().div(dictionary.d_out).sqrt().item()
            if scale_in == 0 or scale_out == 0:
                raise ValueError(f"fit: batch {index}'s {'x' if scale_in == 0 else 'y'} is all zeros; there is "
                                 f"nothing to reconstruct")
            with torch.no_grad():
                dictionary.b_dec.copy_(y.mean(0) / scale_out)
        x, y = x / scale_in, y / scale_out
        dead = since_fired > dead_after_tokens
        loss, error, fired = _loss(dictionary, x, y, dead, aux_k, aux_coefficient)
        since_fired = torch.where(fired, 0, since_fired + len(x))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():  # keep decoder rows on the unit sphere: no gradient along them, renormalise after
            W = dictionary.W_dec
            W.grad -= (W.grad * W).sum(-1, keepdim=True) * W
            optimizer.step()
            W.copy_(unit_rows(W))
        schedule.step()
        fvu = error.pow(2).sum().item() / (y - y.mean(0)).pow(2).sum().item()
        smoothed_fvu = fvu if math.isnan(smoothed_fvu) else 0.95 * smoothed_fvu + 0.05 * fvu
        seen, step = seen + len(x), step + 1
        bar.update()
        bar.set_postfix(fvu=f"{smoothed_fvu:.3f}", dead=f"{dead.float().mean().item():.1%}", refresh=False)
        if step >= steps:
            break
    bar.close()
    if scale_in is None:
        raise ValueError("fit: the batches held no activations to train on (train_dictionary's texts give none when "
                         "they hold fewer tokens than one step, batch_tokens)")
    _fold_scales(dictionary, scale_in, scale_out)
    return {"tokens": seen, "steps": step, "lr": lr, "aux_k": aux_k, "dead_after_tokens": dead_after_tokens,
            "seed": seed, "train_fvu_smoothed": round(smoothed_fvu, 4),
            "dead_fraction_at_end": round(dead.float().mean().item(), 4),
            "seconds": round(time.perf_counter() - start, 1)}


def _checked_batch(dictionary: TopKDictionary, batch: Sequence[torch.Tensor], index: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [N, d_in], y [N, d_out]) of batch number ``index`` (``[x]`` for an SAE, ``[x, y]``), or an error naming what
    no step can train on: the wrong width or rows, a NaN or infinite row (it would make every parameter NaN), targets
    that do not vary (the normalised error divides by their variance)."""
    if not isinstance(batch, Sequence) or len(batch) not in (1, 2) or \
            not all(isinstance(t, torch.Tensor) for t in batch):
        raise TypeError(f"fit: batch {index} must be [x] (an SAE) or [x, y] (a transcoder) of tensors, got "
                        f"{type(batch).__name__}")
    x, y = batch[0], batch[-1]
    for name, tensor, width, axis in (("x", x, dictionary.d_in, "d_in"), ("y", y, dictionary.d_out, "d_out")):
        if tensor.dim() != 2 or tensor.shape[1] != width or len(tensor) != len(x) or not tensor.is_floating_point():
            raise ValueError(f"fit: batch {index}'s {name} is {tensor.dtype} {list(tensor.shape)}; the "
                             f"{type(dictionary).__name__} trains on float rows [N, {axis}={width}]"
                             + (f" with x's N = {len(x)}" if name == "y" else ""))
        finite = tensor.isfinite().all(-1)  # [N]
        if not finite.all():
            row = int((~finite).nonzero()[0])
            raise ValueError(f"fit: batch {index}'s {name} has NaN or infinite values (row {row} of {len(tensor)}, "
                             f"{int((~finite).sum())} rows in all); one such row makes every parameter NaN")
    if not (y - y.mean(0)).abs().amax() > 0:
        raise ValueError(f"fit: batch {index}'s {'y' if len(batch) == 2 else 'x'} has no variance (all {len(y)} rows "
                         f"are the same): the normalised error |y - y_hat|^2 / |y - mean y|^2 is undefined")
    return x, y


def _loss(dictionary: TopKDictionary, x: torch.Tensor, y: torch.Tensor, dead: torch.Tensor, aux_k: int,
          aux_coefficient: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch's training loss for x [N, d_in] -> y [N, d_out]: |y - y_hat|^2 / |y - mean y|^2, plus, when latents
    are ``dead`` [d_sae], ``aux_coefficient`` times AuxK's: the top ``aux_k`` dead latents (by pre-activation)
    reconstruct the error e = y - y_hat (detached), |e - e_hat|^2 / |y - mean y|^2 (Gao et al. 2024, appendix A.2).
    Returns (loss, error [N, d_out] detached, which latents fired [d_sae])."""
    pre = dictionary.pre_activations(x)  # [N, d_sae]
    top = pre.topk(dictionary.k, dim=-1)  # [N, k]
    features = torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())  # [N, d_sae]
    error = y - dictionary.decode(features)  # [N, d_out]
    variance = (y - y.mean(0)).pow(2).sum()
    loss = error.pow(2).sum() / variance
    if dead.any():
        aux = pre.masked_fill(~dead, float("-inf")).topk(min(aux_k, int(dead.sum())), dim=-1)  # [N, k_aux]
        aux_features = torch.zeros_like(pre).scatter(-1, aux.indices, aux.values.relu())  # [N, d_sae]
        aux_error = error.detach() - aux_features @ dictionary.W_dec  # [N, d_out]
        loss = loss + aux_coefficient * aux_error.pow(2).sum() / variance
    fired = torch.zeros(dictionary.d_sae, dtype=torch.bool, device=pre.device)  # [d_sae]
    fired.index_fill_(0, top.indices[top.values > 0], True)
    return loss, error.detach(), fired


@torch.no_grad()
def _fold_scales(dictionary: TopKDictionary, scale_in: float, scale_out: float) -> None:
    """Trained on x / scale_in -> y / scale_out; fold the scales in so it maps raw x to raw y with features scaled by
    scale_out (TopK and ReLU commute with a positive scale; decoder rows stay unit norm):
    W_enc *= scale_out / scale_in, b_enc *= scale_out, b_dec *= scale_out."""
    dictionary.W_enc.mul_(scale_out / scale_in)
    dictionary.b_enc.mul_(scale_out)
    dictionary.b_dec.mul_(scale_out)


# ---- metrics ---------------------------------------------------------------------------------------------------------
def fraction_of_variance_unexplained(x: torch.Tensor, reconstruction: torch.Tensor) -> float:
    """sum |x - x_hat|^2 / sum |x - mean(x)|^2 over the rows of x [N, D] (the mean over rows): 0 is perfect, 1 is no
    better than predicting the mean."""
    x, reconstruction = x.double(), reconstruction.double()
    return ((x - reconstruction).pow(2).sum() / (x - x.mean(0)).pow(2).sum()).item()


def ce_recovered(ce_clean: float, ce_spliced: float, ce_zero: float) -> float:
    """(CE_ablated - CE_spliced) / (CE_ablated - CE_clean): 1 when splicing costs no loss, 0 when it is as bad as
    ablating the probe (``ce_zero``: the loss with the probe zero- or mean-ablated); NaN when the ablation costs
    nothing, so that there is nothing to recover."""
    gap = ce_zero - ce_clean
    return (ce_zero - ce_spliced) / gap if gap != 0 else math.nan


@dataclass
class DictionaryMetrics:
    """What the field reports for a dictionary, over the real tokens of an evaluation set. The cross-entropies are
    next-token losses in nats, averaged over the positions where a real token predicts a real token.

    Read CE recovered with its baseline: zero-ablating a residual-stream probe leaves the model next to the uniform
    distribution, so any reconstruction recovers most of that gap; the mean-ablated baseline is the stricter one, and
    ``ce_cost`` (nats per token) the plainest figure."""

    fvu: float  # fraction of variance unexplained of the (write) probe's activation
    mean_l0: float  # active features per token
    dead_fraction: float  # features never active on the evaluation set
    ce_clean: float  # next-token cross-entropy (nats): the model as it is,
    ce_spliced: float  # with the dictionary's reconstruction in place of the probe (keep_error=False),
    ce_zero: float  # with the probe zero-ablated,
    ce_mean: float  # with the probe mean-ablated (its mean over the evaluation's real tokens, at every position)
    tokens: int

    @property
    def ce_cost(self) -> float:
        """What splicing the dictionary in costs, in nats per token: ce_spliced - ce_clean."""
        return self.ce_spliced - self.ce_clean

    @property
    def ce_recovered(self) -> float:
        """(CE_zero - CE_spliced) / (CE_zero - CE_clean), the share of the zero-ablation's loss that the
        reconstruction recovers (the field's usual figure): 1 when splicing costs no loss, 0 when it is as bad as
        zero-ablating the probe."""
        return ce_recovered(self.ce_clean, self.ce_spliced, self.ce_zero)

    @property
    def ce_recovered_mean(self) -> float:
        """The share of the mean-ablation's loss that the reconstruction recovers."""
        return ce_recovered(self.ce_clean, self.ce_spliced, self.ce_mean)

    def as_dict(self) -> dict:
        """The fields and the three derived figures (ce_cost, ce_recovered, ce_recovered_mean) as one plain dict (a
        table's row, a JSON record)."""
        return {**asdict(self), "ce_cost": self.ce_cost, "ce_recovered": self.ce_recovered,
                "ce_recovered_mean": self.ce_recovered_mean}

    def __str__(self) -> str:
        return (f"FVU {self.fvu:.3f}, mean L0 {self.mean_l0:.1f}, dead {self.dead_fraction:.1%}, splicing costs "
                f"{self.ce_cost:.3f} nats (clean {self.ce_clean:.3f}, spliced {self.ce_spliced:.3f}); CE recovered "
                f"{self.ce_recovered:.1%} against zero-ablation ({self.ce_zero:.3f} nats), "
                f"{self.ce_recovered_mean:.1%} against mean-ablation ({self.ce_mean:.3f} nats); over {self.tokens:,} "
                f"tokens")


@torch.no_grad()
def evaluate(model: K2Model, probe: ProbeSpec, dictionary: nn.Module, texts: Iterable[str], batch_size: int = 8,
             context: int = 256, max_tokens: int | None = None) -> DictionaryMetrics:
    """FVU, mean L0 and dead features of ``dictionary`` on ``probe`` (a name, or (read, write)) over ``texts``, and the
    cross-entropy when it is spliced in (keep_error=False), against the clean model and against the (write) probe
    zero-ablated and mean-ablated (its mean over the evaluation's real tokens). Pads enter none of them. Stops after
    the batch that passes ``max_tokens`` real tokens."""
    read, write = _probe_pair(model, probe)
    tokenizer = model.require_tokenizer("evaluate")
    if max_tokens is not None:
        _check_positive(max_tokens=max_tokens)
    _check_dictionary(dictionary, "evaluate")  # before the clean pass, not after it
    d_in = _widths(dictionary)[0]
    heads, flattens_itself = _reads_heads(dictionary)
    squared_error = total = sum_squares = 0.0
    sum_y: torch.Tensor | None = None  # [D] float64
    l0 = 0
    fired: torch.Tensor | None = None  # [d_sae] bool
    ce = {"clean": 0.0, "spliced": 0.0, "zero": 0.0, "mean": 0.0}
    scored_count = 0
    batches = []  # the (ids, mask) of each batch: the ablations run once the probe's mean is known
    for ids, mask in token_batches(tokenizer, texts, batch_size, context):
        ids, mask = ids.to(model.device), mask.to(model.device)
        forward = {"attention_mask": None if mask.all() else mask, "return_type": "loss", "loss_per_token": True}
        loss, cache = model.run_with_cache(ids, names=[read, write], **forward)  # loss [B, T-1], 0 where not scored
        ce["clean"] += loss.sum().item()
        batches.append((ids, forward))
        scored_count += int((mask[:, 1:] & mask[:, :-1]).sum())
        x, y = cache[read][mask], cache[write][mask]  # [N, d_in], [N, d_out] (heads: [N, H, V])
        if x.dim() > 2 and not heads:
            raise ValueError(f"evaluate: {read} is {list(cache[read].shape)}; a dictionary of it reads the heads "
                             f"flattened (reshape_activations='hook_z', as train_sae makes one)")
        if d_in is not None and x[0].numel() != d_in:
            raise ValueError(f"evaluate: {read}'s rows are {x[0].numel()} wide ({list(cache[read].shape)}) but the "
                             f"dictionary encodes d_in={d_in}")
        features = dictionary.encode(x.flatten(-2) if heads and not flattens_itself else x)  # [N, d_sae]
        reconstruction = dictionary.decode(features).reshape(len(y), -1).double()  # [N, d_out]
        row_shape = y.shape[1:]  # [d_out] (heads: [H, V])
        y = y.reshape(len(y), -1).double()
        squared_error += (y - reconstruction).pow(2).sum().item()
        sum_squares += y.pow(2).sum().item()
        sum_y = y.sum(0) if sum_y is None else sum_y + y.sum(0)
        total += len(y)
        active = features > 0
        l0 += int(active.sum())
        fired = active.any(0) if fired is None else fired | active.any(0)
        if max_tokens is not None and total >= max_tokens:
            break
    if fired is None:
        raise ValueError("evaluate: the texts gave no tokens")
    mean = (sum_y / total).reshape(row_shape)  # the write probe's mean over real tokens: [d_out] (heads: [H, V])
    ablations = {"zero": lambda t, hook: torch.zeros_like(t), "mean": lambda t, hook: mean.to(t.dtype).expand_as(t)}
    for ids, forward in batches:
        with splice(model, (read, write), dictionary):
            ce["spliced"] += model(ids, **forward).sum().item()
        for name, ablate in ablations.items():
            with model.hooks(fwd_hooks=[(write, ablate)]):
                ce[name] += model(ids, **forward).sum().item()
    variance = sum_squares - sum_y.pow(2).sum().item() / total  # sum |y - mean|^2
    return DictionaryMetrics(fvu=squared_error / variance, mean_l0=l0 / total,
                             dead_fraction=1 - fired.float().mean().item(), ce_clean=ce["clean"] / scored_count,
                             ce_spliced=ce["spliced"] / scored_count, ce_zero=ce["zero"] / scored_count,
                             ce_mean=ce["mean"] / scored_count, tokens=int(total))
