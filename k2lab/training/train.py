"""Train K2-nano with K2's own recipe on the offline standard-library corpus.

    python -m k2lab.training --preset nano --out runs/nano   # the bundled run, seeded (its time: docs/experiments.md)
    python -m k2lab.training --width 192 --set steps=290 warmup=15 --out runs/w192   # a trial beside it
    python -m k2lab.training --out k2lab/lab/assets/nano --overwrite                   # replace the bundled model

The checkpoint and the log are saved after each evaluation, so an interrupted run keeps what it did; the output
folder is checked (writable, empty unless ``--overwrite``) before the corpus is encoded.

The recipe (k2lab.training.optim): MuonClip for hidden matrices (AdamW for embedding, head and norms), QK-Clip after
every step from the logits the probes saw, aux-loss-free balancing of the router's correction bias, and a
warmup-stable-decay schedule. Every step logs its loss, each head's max logit (QK-Clip activity) and each MoE
layer's expert load, written as JSON beside the checkpoint for the training notebook.

The seed fixes the initialisation and every batch. Multi-threaded float reductions are not bitwise repeatable,
eager or compiled, so two runs agree to rounding (after 25 steps their losses differ in the fourth decimal).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..bundled import NANO_DIR
from ..config import K2Config
from ..model.inputs import prepare_inputs
from ..model.moe import MoE
from ..model.speed.loss import head_loss
from ..model.transformer import K2Model
from ..tokenizer.release import load_tokenizer
from ..tokenizer.tokenizer import CONFIG_FILE, RANKS_FILE, K2Tokenizer
from ..weights.writer import save_checkpoint
from . import corpus
from .optim import MuonClip, balance_router_bias, qk_clip, wsd_lr


@dataclass
class TrainConfig:
    """Everything a run depends on; written into the log so a run can be repeated from it."""

    # The bundled run's length: one whole WSD schedule (its time and held-out curve: docs/experiments.md).
    steps: int = 2600
    batch_size: int = 16  # at equal tokens, 16 rows beat 8 rows for twice the steps, in less time
    seq_len: int = 256
    # 5e-3 leads in short trials and for most of a whole run, but the two end level: the decay takes up the
    # difference (2.5e-3 and 2e-2 do worse; the trials are in docs/experiments.md).
    lr: float = 1e-2
    # The embedding's and the head's AdamW steps, relative to lr. An embedding row learns only from the tokens
    # that use it, in a short run from a few hundred occurrences, so its steps are larger (10x beat 1x and 30x); a
    # smaller head step changed nothing (trials: docs/experiments.md).
    embed_lr_scale: float = 10.0
    head_lr_scale: float = 1.0
    weight_decay: float = 0.1  # 0.3 did worse in a short trial
    warmup: int = 130
    decay_fraction: float = 0.5  # half the schedule decays: better than 0.3 in a short trial
    qk_clip_tau: float = 30.0  # K2 uses 100 at its scale; a small, short run peaks lower
    # The bias step u follows the schedule's decay down to 0, as DeepSeek-V3 stops its bias updates at the end:
    # routing settles while the learning rate anneals. 5e-3 made the bias override the router's own choice
    # for most tokens; 1e-3 left one expert per layer with most tokens for much of a short run.
    bias_step: float = 2e-3
    # The library alone (2.1 M tokens) is memorised within two epochs; its test suite adds 4.5 M tokens of
    # another style of code. This share of each batch's rows comes from the tests, the rest from the library
    # (0.25 beat 0.5 in a short trial).
    test_suite_share: float = 0.25
    seed: int = 0
    eval_every: int = 600
    threads: int | None = 2  # the bundled run's threads; more threads than free cores slow every step
    # torch.compile the loss (forward, head and cross-entropy) and so its backward: inductor fuses the element-wise
    # ops between the matmuls. Needs a C++ compiler, and compiling counts in the run's time. Off: since the head's
    # loss runs in chunks and attention stays fused, little is left to fuse (benchmarks.train_step measures it).
    # true/false (or 1/0) on the command line.
    compile: bool = False

    def __post_init__(self) -> None:
        check_train_config(self)


# Each field's allowed values: (what it must be, the test). Ints refuse bools and floats.
def _int(low: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _real(low: float, high: float = math.inf, closed_high: bool = True, open_low: bool = False):
    def test(v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        return (v > low if open_low else v >= low) and (v <= high if closed_high else v < high)
    return test


_RULES = {
    "steps": ("an integer >= 1", _int(1)),
    "batch_size": ("an integer >= 1", _int(1)),
    "seq_len": ("an integer >= 1", _int(1)),
    "lr": ("a finite number > 0", _real(0, open_low=True)),
    "embed_lr_scale": ("a finite number >= 0", _real(0)),
    "head_lr_scale": ("a finite number >= 0", _real(0)),
    "weight_decay": ("a finite number >= 0", _real(0)),
    "warmup": ("an integer >= 0", _int(0)),
    "decay_fraction": ("a number in [0, 1]", _real(0, 1)),
    "qk_clip_tau": ("a finite number > 0", _real(0, open_low=True)),
    "bias_step": ("a finite number >= 0", _real(0)),
    "test_suite_share": ("a number in [0, 1]", _real(0, 1)),
    "seed": ("an integer >= 0", _int(0)),
    "eval_every": ("an integer >= 1", _int(1)),
    "threads": ("None or an integer >= 1", lambda v: v is None or _int(1)(v)),
    "compile": ("True or False", lambda v: isinstance(v, bool)),
}


def check_train_config(tc: TrainConfig) -> None:
    """Raise ValueError naming the first field of ``tc`` outside its allowed values."""
    for name, (allowed, test) in _RULES.items():
        value = getattr(tc, name)
        if not test(value):
            raise ValueError(f"TrainConfig.{name} must be {allowed}, got {value!r}")


PRESETS = {"nano": (K2Config.nano, TrainConfig)}


def token_stream(tokenizer: K2Tokenizer, split: corpus.Split, kind: corpus.Kind | None = None,
                 test_suite: bool = False) -> torch.Tensor:
    """All documents of a split as one int32 token stream [N], each document closed by [EOS]."""
    return encode_documents(tokenizer, corpus.documents(split, kind, test_suite))


def encode_documents(tokenizer: K2Tokenizer, documents: Iterable[corpus.Document]) -> torch.Tensor:
    """Documents as one int32 token stream [N], each closed by [EOS]."""
    ids: list[int] = []
    for encoded in tokenizer.encode_batch([doc.text for doc in documents], allow_special=False):
        ids.extend(encoded)
        ids.append(tokenizer.eos_id)
    return torch.tensor(ids, dtype=torch.int32)


def sample_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """Random windows of seq_len + 1 tokens [B, T+1] (inputs and shifted targets)."""
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=gen)
    return torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()]).long()


def training_model(cfg: K2Config, seed: int) -> K2Model:
    """A K2 as the run trains it: random initial weights from ``seed``, training mode, and its experts run grouped
    (``MoE.experts_impl = "grouped"``, k2lab/model/speed/grouped_experts.py: one gradient pass per expert stack
    instead of one per expert)."""
    model = K2Model(cfg)
    model.init_weights(seed=seed)
    model.train()
    for module in model.modules():
        if isinstance(module, MoE):
            module.experts_impl = "grouped"
    return model


def next_token_loss(model: K2Model, batch: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy in nats of each next token ("mean" or "sum" over them): batch [B, T+1] ids, inputs
    batch[:, :-1], targets batch[:, 1:]. The head runs chunk by chunk (``k2lab.model.speed.loss``), so the batch's
    logits are never whole and ``hook_logits`` does not fire."""
    inputs = prepare_inputs(model, batch[:, :-1], attn_impl="naive")
    x = model.run_blocks(model.embed(inputs.ids), inputs)  # [B, T, D]
    return head_loss(model, x, batch[:, 1:].to(inputs.ids.device), reduction=reduction)


@torch.no_grad()
def bits_per_byte(model: K2Model, tokenizer: K2Tokenizer, tokens: torch.Tensor, seq_len: int,
                  batch_size: int = 16) -> float:
    """Held-out bits per byte: total negative log-likelihood in bits over the UTF-8 bytes of the predicted
    tokens, on consecutive non-overlapping windows (each window's first token is context only)."""
    windows = tokens[: len(tokens) // seq_len * seq_len].view(-1, seq_len).long()
    token_bytes = torch.tensor([len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size)])
    nats, nbytes = 0.0, 0
    for chunk in windows.split(batch_size):
        nats += next_token_loss(model, chunk, reduction="sum").item()
        nbytes += int(token_bytes[chunk[:, 1:]].sum())
    return nats / math.log(2) / nbytes


def unigram_bits_per_byte(train_tokens: torch.Tensor, tokenizer: K2Tokenizer, tokens: torch.Tensor,
                          seq_len: int) -> float:
    """The baseline: token frequencies of the training split (add-one smoothed), scored like bits_per_byte."""
    counts = torch.bincount(train_tokens.long(), minlength=tokenizer.vocab_size).double() + 1
    log_probs = (counts / counts.sum()).log()
    windows = tokens[: len(tokens) // seq_len * seq_len].view(-1, seq_len).long()[:, 1:]
    token_bytes = torch.tensor([len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size)])
    return (-log_probs[windows].sum() / math.log(2) / token_bytes[windows].sum()).item()


@dataclass
class StepProbes:
    """What the recipe needs from each forward, read through the model's probes: every head's max logit
    (QK-Clip) and every MoE layer's expert counts (bias balancing)."""

    max_logits: list[torch.Tensor] = field(default_factory=list)  # per layer [H]
    expert_counts: list[torch.Tensor] = field(default_factory=list)  # per MoE layer [E]

    def hooks(self, model: K2Model) -> list:
        """The ``(selector, fn)`` pairs for ``model.hooks`` that record every head's max logit and every MoE layer's
        expert counts into this object."""
        num_experts = model.config.n_routed_experts

        def record_max(max_logit, hook):  # [B, H]
            self.max_logits.append(max_logit.amax(dim=0))

        def record_load(idx, hook):  # [B, T, k]
            self.expert_counts.append(torch.bincount(idx.flatten(), minlength=num_experts))

        return [(lambda n: n.endswith("self_attn.hook_max_logit"), record_max),
                (lambda n: n.endswith("mlp.gate.hook_topk_idx"), record_load)]


def recipe_step(model: K2Model, opt: MuonClip, batch: torch.Tensor, qk_clip_tau: float, bias_step: float,
                loss_fn: Callable[[K2Model, torch.Tensor], torch.Tensor] = next_token_loss,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, StepProbes]:
    """One step of the recipe on ``batch`` [B, T+1]: forward with the probes attached, backward, MuonClip's
    update, then QK-Clip and the bias update from what the probes saw. Returns the loss, each head's max logit
    [L, H], QK-Clip's gamma [L, H] (1 = not clipped) and the probes (expert counts per MoE layer).
    ``loss_fn`` may be ``torch.compile(next_token_loss)``: the probes' hooks are traced into it."""
    probes = StepProbes()
    with model.hooks(probes.hooks(model)):
        loss = loss_fn(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    max_logits = torch.stack(probes.max_logits)  # [L, H]
    gamma = qk_clip(model, max_logits, qk_clip_tau)
    balance_router_bias(model, probes.expert_counts, bias_step)
    return loss.detach(), max_logits, gamma, probes


def train(cfg: K2Config, tc: TrainConfig, tokenizer: K2Tokenizer, log_every: int = 10,
          save: Callable[[K2Model | None, dict], None] | None = None) -> tuple[K2Model, dict]:
    """Run the recipe; returns the trained model and its log (config, per-step records, evaluations).

    ``save(model, log)``, if given, is called after each evaluation, so a run keeps what it did; if the run stops
    early (an interrupt, an error) it is called once more as ``save(None, log)`` with the log so far (the weights
    of a step cut short are not saved) before the error goes on."""
    check_train_config(tc)
    if not isinstance(cfg, K2Config):
        raise TypeError(f"cfg must be a K2Config, got {type(cfg).__name__}")
    if tc.threads:
        torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    gen = torch.Generator().manual_seed(tc.seed)
    library = token_stream(tokenizer, "train")  # [N] library code and prose
    tests = encode_documents(tokenizer, corpus.test_suite_documents("train"))  # [M], empty without Lib/test
    test_rows = round(tc.batch_size * tc.test_suite_share) if len(tests) > tc.seq_len else 0
    heldout_code = token_stream(tokenizer, "heldout", "code")
    if len(library) <= tc.seq_len + 1 or len(heldout_code) < 2 * tc.seq_len:
        raise ValueError(f"TrainConfig.seq_len={tc.seq_len} is too long for the corpus ({len(library):,} training "
                         f"and {len(heldout_code):,} held-out tokens)")
    model = training_model(cfg, tc.seed)
    opt = MuonClip.for_model(model, lr=tc.lr, weight_decay=tc.weight_decay, embed_lr_scale=tc.embed_lr_scale,
                             head_lr_scale=tc.head_lr_scale)
    loss_fn = torch.compile(next_token_loss) if tc.compile else next_token_loss  # evaluations run eager
    log: dict = {"model": asdict(cfg), "train": asdict(tc), "train_tokens": len(library) + len(tests),
                 "test_suite_rows": test_rows, "steps": [], "evals": []}
    start = time.perf_counter()
    try:
        for step in range(tc.steps):
            lr = wsd_lr(step, tc.steps, tc.lr, tc.warmup, tc.decay_fraction)
            bias_step = wsd_lr(step, tc.steps, tc.bias_step, 0, tc.decay_fraction)  # flat, then down with the lr
            for group in opt.param_groups:
                group["lr"] = lr
            rows = [sample_batch(library, tc.batch_size - test_rows, tc.seq_len, gen)] if tc.batch_size > test_rows \
                else []
            if test_rows:
                rows.append(sample_batch(tests, test_rows, tc.seq_len, gen))
            batch = torch.cat(rows)  # [B, T+1]
            loss, max_logits, gamma, probes = recipe_step(model, opt, batch, tc.qk_clip_tau, bias_step, loss_fn)
            log["steps"].append({
                "step": step, "loss": round(loss.item(), 4), "lr": lr, "bias_step": bias_step,
                "max_logits": max_logits.round(decimals=2).tolist(),
                "clipped_heads": int((gamma < 1).sum()),
                "expert_load": [c.tolist() for c in probes.expert_counts],
                "seconds": round(time.perf_counter() - start, 1),
            })
            if step % log_every == 0 or step == tc.steps - 1:
                tokens_per_s = (step + 1) * tc.batch_size * tc.seq_len / (time.perf_counter() - start)
                print(f"step {step:5d}  loss {loss.item():.3f}  lr {lr:.2e}  max logit {max_logits.max():.1f}  "
                      f"{tokens_per_s:,.0f} tok/s", flush=True)
            if (step + 1) % tc.eval_every == 0 or step == tc.steps - 1:
                model.eval()
                bpb = bits_per_byte(model, tokenizer, heldout_code, tc.seq_len)
                model.train()
                log["evals"].append({"step": step, "heldout_code_bpb": round(bpb, 4)})
                print(f"step {step:5d}  held-out code: {bpb:.3f} bits/byte", flush=True)
                if save is not None:
                    save(model, log)
    except BaseException:
        if save is not None:
            log["stopped_early"] = True
            save(None, log)
        raise
    model.eval()
    log["seconds"] = round(time.perf_counter() - start, 1)
    train_tokens = torch.cat([library, tests])  # the training split, for the baseline
    log["unigram_heldout_code_bpb"] = round(unigram_bits_per_byte(train_tokens, tokenizer, heldout_code,
                                                                  tc.seq_len), 4)
    return model, log


_BOOLS = {"true": True, "1": True, "false": False, "0": False}


def train_config_from(pairs: Iterable[str], base: TrainConfig | None = None) -> TrainConfig:
    """``TrainConfig`` with ``key=value`` overrides (``["steps=400", "lr=1e-2"]``), each value read as its
    field's type. Raises ValueError naming an unknown key or a value of the wrong type."""
    if isinstance(pairs, str) or not all(isinstance(pair, str) for pair in pairs):
        raise TypeError(f"pairs must be a list of 'key=value' strings, got {pairs!r}")
    tc = dataclasses.replace(base or TrainConfig())
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"{pair!r}: expected key=value with a TrainConfig field as key, one of {fields}")
        kind = type(getattr(tc, key))
        try:
            setattr(tc, key, _BOOLS[text.lower()] if kind is bool else kind(text))
        except (KeyError, ValueError):
            raise ValueError(f"{pair!r}: {key} takes {kind.__name__} values") from None
    check_train_config(tc)
    tc.eval_every = min(tc.eval_every, tc.steps)
    return tc


def prepare_output(out: Path, overwrite: bool) -> None:
    """Make sure the run can be kept before it starts: ``out`` is a folder (made if missing) that is empty unless
    ``overwrite``, files can be written in it and beside it (checkpoints are written in a sibling folder and
    swapped in); the tokenizer is copied in, so the folder loads on its own. Raises ValueError or OSError naming
    ``--out``."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        bundled = " (the bundled K2-nano)" if out.resolve() == NANO_DIR.resolve() else ""
        raise ValueError(f"--out {out}{bundled} already holds files; pass --overwrite to replace its checkpoint and "
                         "log, or choose another folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out.with_name(f".{out.name}.probe-{os.getpid()}")
        probe.mkdir()
        probe.rmdir()
        for name in (RANKS_FILE, CONFIG_FILE):
            if not (out / name).exists() or not (out / name).samefile(NANO_DIR / name):
                shutil.copyfile(NANO_DIR / name, out / name)
    except OSError as error:
        raise OSError(f"--out {out}: cannot write the run there ({error.strerror or error})") from None


def write_log(out: Path, log: dict) -> None:
    """The training log as JSON, replaced whole (never half-written)."""
    partial = out / f".training_log.json.{os.getpid()}"
    partial.write_text(json.dumps(log))
    os.replace(partial, out / "training_log.json")


def main() -> None:
    """``python -m k2lab.training``: parse the command line, train the preset, write the checkpoint and its log."""
    parser = argparse.ArgumentParser(description="Train K2-nano with K2's recipe on the standard library.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="nano")
    parser.add_argument("--out", type=Path, help="checkpoint folder (default: runs/<preset>); the bundled "
                        "K2-nano is k2lab/lab/assets/nano and is replaced only with --overwrite")
    parser.add_argument("--overwrite", action="store_true", help="replace the checkpoint and log in a non-empty --out")
    parser.add_argument("--width", type=int, help="hidden size, the preset's own by default; every matrix scales")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="override TrainConfig fields, e.g. --set steps=400 lr=1e-2 threads=1")
    args = parser.parse_args()
    out = args.out or Path("runs") / (args.preset if args.width is None else f"{args.preset}-w{args.width}")
    model_factory, train_factory = PRESETS[args.preset]
    try:
        model_cfg = model_factory() if args.width is None else model_factory(args.width)
        train_cfg = train_config_from(args.set, train_factory())
        prepare_output(out, args.overwrite)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    tokenizer = load_tokenizer(NANO_DIR)

    def save(model: K2Model | None, log: dict) -> None:
        if model is not None:
            save_checkpoint(model, out, format="fp8")
        write_log(out, log)

    _, log = train(model_cfg, train_cfg, tokenizer, save=save)
    write_log(out, log)  # the last evaluation saved the final weights
    print(f"held-out code: {log['evals'][-1]['heldout_code_bpb']:.3f} bits/byte "
          f"(unigram {log['unigram_heldout_code_bpb']:.3f}) after {log['seconds'] / 60:.1f} min; saved in {out}")
