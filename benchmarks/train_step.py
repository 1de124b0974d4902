"""What one training step of K2-nano costs at each width, and what torch.compile and Newton-Schulz in
bfloat16 save.

    python -m benchmarks.train_step [--widths 128 192 256] [--rounds 5] [--threads 2]

A step is ``k2lab.train.recipe_step``, what the bundled run repeats: a forward of 16 x 256 tokens with the
recipe's probes attached, the backward, MuonClip's update, QK-Clip and the bias update. The widths
are ``K2Config.nano(width)``, stepped eagerly; then the bundled width stepped as the run does, through
``torch.compile(next_token_loss)`` (compiled in the untimed warmup round), and with Newton-Schulz iterating
in float32 instead of bfloat16. All contenders alternate round by round in one process, and the ratios are the
figures to quote. Two threads by default, as the bundled run trains.
"""

from __future__ import annotations

import argparse

import torch

from k2lab import K2Config, K2Model, count_parameters
from k2lab.optim import MuonClip
from k2lab.train import TrainConfig, next_token_loss, recipe_step

from .timing import alternate


def training_step(cfg: K2Config, ns_dtype: torch.dtype, compiled: bool, batch: torch.Tensor):
    """A closure running one step of the recipe on ``batch`` [B, T+1] (the model and optimiser live in it)."""
    tc = TrainConfig()
    model = K2Model(cfg)
    model.init_weights(seed=0)
    model.train()
    opt = MuonClip.for_model(model, lr=tc.lr, weight_decay=tc.weight_decay, ns_dtype=ns_dtype)
    loss_fn = torch.compile(next_token_loss) if compiled else next_token_loss
    return lambda: recipe_step(model, opt, batch, tc.qk_clip_tau, tc.bias_step, loss_fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 192, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tc = TrainConfig()
    batch = torch.randint(0, 7936, (tc.batch_size, tc.seq_len + 1), generator=torch.Generator().manual_seed(0))
    bundled = K2Config.nano().hidden_size
    contenders = {f"width {w}": (K2Config.nano(w), torch.bfloat16, False) for w in sorted({*args.widths, bundled})}
    contenders[f"width {bundled}, compiled (as the run trains)"] = (K2Config.nano(), torch.bfloat16, True)
    contenders[f"width {bundled}, Newton-Schulz in float32"] = (K2Config.nano(), torch.float32, False)
    seconds = alternate({name: training_step(*contender, batch) for name, contender in contenders.items()},
                        rounds=args.rounds)
    tokens = tc.batch_size * tc.seq_len
    reference = seconds[f"width {bundled}"]
    print(f"one training step of {tc.batch_size} x {tc.seq_len} tokens, {args.threads} threads, "
          f"median of {args.rounds} alternating rounds:")
    for name, s in seconds.items():
        params = count_parameters(contenders[name][0]).total
        print(f"  {name:42s} {s * 1000:7.0f} ms  {tokens / s:7,.0f} tokens/s  {s / reference:5.2f}x the eager "
              f"{bundled}-wide step  ({params / 1e6:.1f} M parameters)")


if __name__ == "__main__":
    main()
