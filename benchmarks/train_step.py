"""What one training step of K2-nano costs at each width, and what each of the step's speed choices saves.

    python -m benchmarks.train_step [--widths 128 192 256] [--rounds 5] [--threads 2]

A step is ``k2lab.training.train.recipe_step``, what the bundled run repeats: a forward of 16 x 256 tokens with the
recipe's probes attached, the backward, MuonClip's update, QK-Clip and the bias update. The widths are
``K2Config.nano(width)``, stepped eagerly as the run steps them. Beside the bundled width, each contender undoes
one choice of the run:

- the head's loss through the whole [4096, 8192] logits tensor and ``F.cross_entropy``, not ``k2lab.model.speed.loss``'s
  chunks;
- attention through explicit scores and softmax (``hook_attn_scores`` probed), not the fused kernel plus the
  ``hook_max_logit`` probe;
- Newton-Schulz in the other dtype (bfloat16 where the run uses float32, or the reverse);
- the loss compiled with ``torch.compile`` (compiled in the untimed warmup round).

All contenders alternate round by round in one process, and the ratios are the figures to quote. Two threads by
default, as the bundled run trains.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k2lab import K2Config, K2Model, count_parameters
from k2lab.training.optim import MuonClip, native_bfloat16
from k2lab.training.train import TrainConfig, next_token_loss, recipe_step, training_model

from .timing import alternate


def full_logits_loss(model: K2Model, batch: torch.Tensor) -> torch.Tensor:
    """The loss through the model's own head: every logit [B, T, V] materialised, then F.cross_entropy."""
    logits = model(batch[:, :-1], attn_impl="naive")  # [B, T, V]
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _explicit_scores(name: str) -> bool:
    return name.endswith("self_attn.hook_attn_scores")


@dataclass
class Contender:
    cfg: K2Config
    ns_dtype: torch.dtype | None = None  # None: the run's own choice
    loss: str = "chunked"  # or "full logits"
    explicit_scores: bool = False
    compiled: bool = False

    def step(self, batch: torch.Tensor):
        """A closure running one step of the recipe on ``batch`` [B, T+1] (the model and optimiser live in it)."""
        tc = TrainConfig()
        model = training_model(self.cfg, seed=0)
        opt = MuonClip.for_model(model, lr=tc.lr, weight_decay=tc.weight_decay, ns_dtype=self.ns_dtype)
        loss_fn = next_token_loss if self.loss == "chunked" else full_logits_loss
        loss_fn = torch.compile(loss_fn) if self.compiled else loss_fn
        hooks = [(_explicit_scores, lambda scores, hook: None)] if self.explicit_scores else []

        def run():
            with model.hooks(hooks):
                return recipe_step(model, opt, batch, tc.qk_clip_tau, tc.bias_step, loss_fn)
        return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 192, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tc = TrainConfig()
    batch = torch.randint(0, 7936, (tc.batch_size, tc.seq_len + 1), generator=torch.Generator().manual_seed(0))
    nano = K2Config.nano()
    bundled = nano.hidden_size
    other_dtype = torch.float32 if native_bfloat16("cpu") else torch.bfloat16
    contenders = {f"width {w}": Contender(K2Config.nano(w)) for w in sorted({*args.widths, bundled})}
    contenders |= {
        f"width {bundled}, head loss through full logits": Contender(nano, loss="full logits"),
        f"width {bundled}, attention through explicit scores": Contender(nano, explicit_scores=True),
        f"width {bundled}, Newton-Schulz in {str(other_dtype).removeprefix('torch.')}": Contender(
            nano, ns_dtype=other_dtype),
        f"width {bundled}, loss compiled": Contender(nano, compiled=True),
    }
    seconds = alternate({name: c.step(batch) for name, c in contenders.items()}, rounds=args.rounds)
    tokens = tc.batch_size * tc.seq_len
    reference = seconds[f"width {bundled}"]
    print(f"one training step of {tc.batch_size} x {tc.seq_len} tokens, {args.threads} threads, median of "
          f"{args.rounds} alternating rounds (native bfloat16 matmuls on this CPU: {native_bfloat16('cpu')}):")
    for name, s in seconds.items():
        params = count_parameters(contenders[name].cfg).total
        print(f"  {name:52s} {s * 1000:7.0f} ms  {tokens / s:7,.0f} tokens/s  {s / reference:5.2f}x the run's "
              f"{bundled}-wide step  ({params / 1e6:.1f} M parameters)")


if __name__ == "__main__":
    main()
