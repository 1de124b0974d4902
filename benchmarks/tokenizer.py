"""Encoding throughput of k2lab's tokenizer against tiktoken on the same ranks.

    python -m benchmarks.tokenizer [--mb 4] [--rounds 5]

Encodes the first few MB of the corpus's train split with the nano tokenizer three ways, alternating
runs so that a busy machine slows each one alike, and prints the median of each:
k2lab's encode (chunked, parallel batch), tiktoken's encode, and `tokenizers` on the whole string at once.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from benchmarks.timing import alternate
from k2lab.lab import NANO_DIR
from k2lab.tokenizer import load_tokenizer
from k2lab.tokenizer.tokenizer import KIMI_PATTERN, RANKS_FILE
from k2lab.training import corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4.0, help="megabytes of corpus text to encode")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    tok = load_tokenizer(NANO_DIR)
    ranks = load_tiktoken_bpe(str(NANO_DIR / RANKS_FILE))
    reference = tiktoken.Encoding(
        "nano", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=tok.special_tokens
    )
    text = corpus.corpus_text("train")[: int(args.mb * 1e6)]
    megabytes = len(text.encode()) / 1e6

    runs: dict[str, Callable[[], list[int]]] = {
        "k2lab encode": lambda: tok.encode(text),
        "tiktoken encode": lambda: reference.encode(text, allowed_special="all"),
        "tokenizers, one string": lambda: tok.backend.encode(text).ids,
    }
    ids = {name: run() for name, run in runs.items()}
    if len({tuple(v) for v in ids.values()}) != 1:
        raise SystemExit("the three encoders disagree")
    medians = alternate(runs, rounds=args.rounds)

    threads = os.environ.get("RAYON_NUM_THREADS", str(os.cpu_count()))
    print(f"{megabytes:.2f} MB of corpus text, {len(ids['k2lab encode']):,} tokens, {threads} threads for tokenizers")
    for name, seconds in medians.items():
        print(f"  {name:24s} {seconds:6.3f} s  {megabytes / seconds:6.2f} MB/s")
    ratio = medians["k2lab encode"] / medians["tiktoken encode"]
    print(f"k2lab / tiktoken time ratio: {ratio:.2f} (median of {args.rounds} alternating rounds)")


if __name__ == "__main__":
    main()
