"""Train the nano tokenizer and write it to k2lab/lab/assets/nano/ in K2's release layout.

    python scripts/train_nano_tokenizer.py [--out k2lab/lab/assets/nano]

8,192 ids like a miniature K2: 7,936 BPE ranks (the 256 single bytes, then 7,680 merges) followed by
256 special ids named as in K2's tokenizer_config.json. The BPE is trained by `tokenizers` on the
corpus's train split with Kimi's pre-tokenizer regex. BPE training has no randomness, so the same
Python (the corpus is its standard library) gives the same files.

tiktoken.model holds ranks, and a rank file is only right if rank-BPE rebuilds every token from two
lower-ranked parts in the order the trainer learned them. The script checks that, then checks that
k2lab's loader, tiktoken and the trained tokenizer give the same ids on the held-out split.
"""

from __future__ import annotations

import argparse
import base64
import json
import time
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from k2lab.lab import NANO_DIR
from k2lab.tokenizer.ranks import bytes_to_unicode, rank_bpe
from k2lab.tokenizer.tokenizer import (
    CONFIG_FILE,
    KIMI_PATTERN,
    NUM_RESERVED_SPECIAL_TOKENS,
    RANKS_FILE,
    kimi_pre_tokenizer,
    load_tokenizer,
)
from k2lab.training import corpus

VOCAB_SIZE = 8192
NUM_RANKS = VOCAB_SIZE - NUM_RESERVED_SPECIAL_TOKENS  # 7,936

# K2's named special tokens, by offset from the first special id (163,584 in K2). The other offsets
# are <|reserved_token_{id}|>.
K2_SPECIAL_OFFSETS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}
# K2 marks the tool-call markers as not "special" (they stay visible when special tokens are skipped).
VISIBLE_SPECIALS = {11, 12, 13, 14, 15}


def train_bpe() -> Tokenizer:
    """Byte-level BPE with NUM_RANKS tokens, trained on the train split (code and prose)."""
    trainer = BpeTrainer(
        vocab_size=NUM_RANKS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer = Tokenizer(BPE())
    tokenizer.pre_tokenizer = kimi_pre_tokenizer()
    tokenizer.train_from_iterator((doc.text for doc in corpus.documents("train")), trainer=trainer)
    return tokenizer


def ranks_of(tokenizer: Tokenizer) -> dict[bytes, int]:
    """Ranks: byte b gets rank b, then the learned tokens in the order they were learned (their trainer id)."""
    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab = tokenizer.get_vocab()
    if len(vocab) != NUM_RANKS:
        raise RuntimeError(f"trained {len(vocab)} tokens, expected {NUM_RANKS}")
    ranks = {bytes([b]): b for b in range(256)}
    for piece in sorted(vocab, key=vocab.__getitem__):
        token = bytes(byte_of[ch] for ch in piece)
        if len(token) > 1:
            ranks[token] = len(ranks)
    if len(ranks) != NUM_RANKS:
        raise RuntimeError("the trained vocabulary does not hold all 256 bytes exactly once")
    return ranks


def check_rank_bpe(ranks: dict[bytes, int]) -> None:
    """Every token must be rebuilt by rank-BPE from exactly two lower-ranked parts."""
    for token, rank in ranks.items():
        if len(token) > 1 and len(rank_bpe(ranks, token, max_rank=rank)) != 2:
            raise RuntimeError(f"token {token!r} (rank {rank}) is not reachable by rank-BPE")


def write_release(ranks: dict[bytes, int], out: Path) -> None:
    """tiktoken.model (ranks = ids) and a tokenizer_config.json shaped like K2's."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(), key=lambda t: t[1])]
    (out / RANKS_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
    added = {
        str(NUM_RANKS + offset): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": offset not in VISIBLE_SPECIALS,
        }
        for offset, name in K2_SPECIAL_OFFSETS.items()
    }
    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": [K2_SPECIAL_OFFSETS[i] for i in (2, 3, 4, 6, 7, 9, 10, 17)],
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def check_parity(trained: Tokenizer, out: Path) -> dict[str, float]:
    """k2lab's loader == tiktoken == the trainer's own tokenizer on the held-out split; bytes per token."""
    tok = load_tokenizer(out)
    ranks = load_tiktoken_bpe(str(out / RANKS_FILE))
    reference = tiktoken.Encoding("k2lab-nano", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens={})
    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    rank_of_trainer_id = {i: ranks[bytes(byte_of[ch] for ch in piece)] for piece, i in trained.get_vocab().items()}
    bytes_per_token = {}
    for kind in ("code", "prose"):
        docs = [doc.text for doc in corpus.documents("heldout", kind)]
        ours = tok.encode_batch(docs, allow_special=False)
        theirs = reference.encode_ordinary_batch(docs)
        trainer_ids = [[rank_of_trainer_id[i] for i in e.ids] for e in trained.encode_batch(docs)]
        if not ours == theirs == trainer_ids:
            raise RuntimeError(f"held-out {kind}: k2lab, tiktoken and the trained tokenizer disagree")
        bytes_per_token[kind] = sum(len(d.encode()) for d in docs) / sum(map(len, ours))
    return bytes_per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=NANO_DIR)
    args = parser.parse_args()
    start = time.perf_counter()
    trained = train_bpe()
    trained_at = time.perf_counter()
    ranks = ranks_of(trained)
    check_rank_bpe(ranks)
    write_release(ranks, args.out)
    bytes_per_token = check_parity(trained, args.out)
    print(f"trained {NUM_RANKS} ranks + {NUM_RESERVED_SPECIAL_TOKENS} specials in {trained_at - start:.1f} s")
    print("held-out bytes per token: " + ", ".join(f"{k} {v:.3f}" for k, v in bytes_per_token.items()))
    print(f"wrote {args.out / RANKS_FILE} and {args.out / CONFIG_FILE}")


if __name__ == "__main__":
    main()
