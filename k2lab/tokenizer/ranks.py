"""tiktoken rank files and the BPE merges they imply.

K2 ships its vocabulary the tiktoken way: `tiktoken.model` lists every byte string with its rank and holds no
merge list, yet a `tokenizers` BPE model needs one. We recover it the way tiktoken itself would build each
token: run rank-BPE on the token's bytes using only lower ranks, and the last two parts are its merge.
(Ordering merges by id or by length instead looks right on most text and then silently disagrees.)
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path


class TokenizerFileError(ValueError):
    """A tokenizer file is malformed; the message names the file (and the line, where there is one)."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte maps to a printable character.

    Printable Latin-1 bytes stand for themselves; the rest (controls, space, ...) are moved to 256 and
    up, so that a vocabulary of byte strings becomes a vocabulary of ordinary strings.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in mapping)
    for n, b in enumerate(shifted):
        mapping[b] = chr(256 + n)
    return dict(sorted(mapping.items()))


# As a str.translate table: takes a latin-1 decoded byte string to its byte-level spelling.
_BYTE_LEVEL = bytes_to_unicode()


def byte_level(token: bytes) -> str:
    """A byte string spelled in the byte-level alphabet, as `tokenizers` stores it."""
    return token.decode("latin-1").translate(_BYTE_LEVEL)


def load_ranks(path: str | Path) -> dict[bytes, int]:
    """Read a tiktoken rank file: one `base64token rank` per line, ranks 0..n-1 each used once."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise TokenizerFileError(
            f"{path}: not a tiktoken rank file (byte {error.start} is not UTF-8 text; expected lines of "
            "'<base64 token> <rank>')"
        ) from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        token = b""
        if len(fields) == 2 and fields[1].isdecimal():
            try:
                token = base64.b64decode(fields[0], validate=True)
            except binascii.Error:
                pass
        if not token:
            raise TokenizerFileError(f"{path}:{lineno}: expected '<base64 token> <rank>', got {line[:80]!r}")
        rank = int(fields[1])
        if rank in line_of_rank:
            raise TokenizerFileError(
                f"{path}:{lineno}: duplicate rank {rank} (first given on line {line_of_rank[rank]})"
            )
        if token in ranks:
            raise TokenizerFileError(f"{path}:{lineno}: token {token!r} listed twice (first with rank {ranks[token]})")
        ranks[token] = rank
        line_of_rank[rank] = lineno
    if not ranks:
        raise TokenizerFileError(f"{path}: no ranks in the file")
    if len(line_of_rank) != max(line_of_rank) + 1:
        missing = next(r for r in range(len(line_of_rank)) if r not in line_of_rank)
        raise TokenizerFileError(f"{path}: ranks must run 0..n-1 without gaps; rank {missing} is missing")
    return ranks


def rank_bpe(ranks: dict[bytes, int], token: bytes, max_rank: int | None = None) -> list[bytes]:
    """Split `token` the way tiktoken encodes it: merge the lowest-ranked adjacent pair until none is left.

    With `max_rank`, only merges into tokens ranked below it count: applied to a token's own bytes with
    its own rank, the two parts left over are the merge that builds it.
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    while True:
        best, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best, best_rank = i, rank
        if best < 0:
            return parts
        parts[best : best + 2] = [parts[best] + parts[best + 1]]


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The BPE merge list implied by a rank file, in rank order (so merge priority equals rank).

    A token that rank-BPE cannot build from two parts gets no merge; it can still come out when a
    whole pre-token equals it, as in tiktoken (the BPE model matches whole words first).
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            parts = rank_bpe(ranks, token, max_rank=rank)
            if len(parts) == 2:
                merges.append((parts[0], parts[1]))
    return merges
