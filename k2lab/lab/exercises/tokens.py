"""01: the tokenizer. Encoding with ranks (``check_bpe``) and learning them (``check_bpe_training``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from ...tokenizer.ranks import rank_bpe, recover_merges
from .checking import Verdict, call, checker, named

Ranks = dict[bytes, int]
Merge = tuple[bytes, bytes]

# --- encoding: rank-BPE -------------------------------------------------------------------------------------------

# A toy rank file on which the right rule (merge the lowest-ranked pair, repeat) and each wrong one learners write
# (the first mergeable pair from the left, the highest rank first, one merge only, the longest known token from the
# left, the pair ranked by its left part, every local minimum merged in one sweep) give different parts on at least
# one piece, and no two wrong rules agree on all of them; one piece becomes a single token, so that a rule that stops
# early (at two parts, say) shows.
_TOY_RANKS = {bytes([b]): b for b in range(256)} | {b"cc": 256, b"cca": 257, b"acca": 258, b"ccca": 259, b"ba": 260,
                                                    b"ac": 261}
_TOY_PIECES = [b"bacca", b"baccca", b"baccc", b"acccc", b"acca"]  # the last merges down to one token


def _bytes_of(piece: bytes) -> list[bytes]:
    return [piece[i: i + 1] for i in range(len(piece))]


def _merge_while(choose: Callable[[Ranks, list[bytes], list[int]], int]) -> Callable[[Ranks, bytes], list[bytes]]:
    """A BPE that merges, while any adjacent pair is in the ranks, the pair at the index ``choose(ranks, parts,
    mergeable)`` picks among the mergeable pairs' indices: the right rule and each wrong one differ only there."""
    def bpe(ranks: Ranks, piece: bytes) -> list[bytes]:
        parts = _bytes_of(piece)
        while mergeable := [i for i in range(len(parts) - 1) if parts[i] + parts[i + 1] in ranks]:
            i = choose(ranks, parts, mergeable)
            parts[i: i + 2] = [parts[i] + parts[i + 1]]
        return parts
    return bpe


_first_pair_bpe = _merge_while(lambda ranks, parts, mergeable: mergeable[0])
_highest_rank_bpe = _merge_while(lambda ranks, parts, mergeable: max(mergeable, key=lambda i: (
    ranks[parts[i] + parts[i + 1]], i)))
_rightmost_tie_bpe = _merge_while(lambda ranks, parts, mergeable: max(mergeable, key=lambda i: (
    -ranks[parts[i] + parts[i + 1]], i)))
_left_part_bpe = _merge_while(lambda ranks, parts, mergeable: min(mergeable, key=lambda i: (ranks[parts[i]], i)))


def _one_merge_bpe(ranks: Ranks, piece: bytes) -> list[bytes]:
    parts = _bytes_of(piece)
    pairs = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1) if parts[i] + parts[i + 1] in ranks]
    if pairs:
        _, i = min(pairs)
        parts[i: i + 2] = [parts[i] + parts[i + 1]]
    return parts


def _longest_match(ranks: Ranks, piece: bytes) -> list[bytes]:
    parts, start = [], 0
    while start < len(piece):
        end = max(end for end in range(start + 1, len(piece) + 1) if piece[start:end] in ranks)
        parts.append(piece[start:end])
        start = end
    return parts


def _local_minima_bpe(ranks: Ranks, piece: bytes) -> list[bytes]:
    """Every mergeable pair ranked below its left neighbour and not above its right one, merged in one sweep."""
    parts = _bytes_of(piece)
    while True:
        rank = [ranks.get(parts[i] + parts[i + 1], float("inf")) for i in range(len(parts) - 1)]
        minima = {i for i, r in enumerate(rank) if r < float("inf") and (i == 0 or r < rank[i - 1])
                  and (i == len(rank) - 1 or r <= rank[i + 1])}
        if not minima:
            return parts
        merged, i = [], 0
        while i < len(parts):
            step = 2 if i in minima else 1
            merged.append(b"".join(parts[i: i + step]))
            i += step
        parts = merged


_BPE_MISTAKES: list[tuple[str, Callable[[Ranks, bytes], list[bytes]]]] = [
    ("you merged the first mergeable pair from the left; merge the pair with the LOWEST rank first, wherever it is",
     _first_pair_bpe),
    ("you merged the HIGHEST-ranked pair first; a rank is the order the merges were learned in, so the LOWEST rank "
     "merges first", _highest_rank_bpe),
    ("you stopped after one merge; keep merging while any adjacent pair is in the ranks", _one_merge_bpe),
    ("where the lowest-ranked pair occurs twice (b'ccc' holds b'cc' at two places), you merged the rightmost; merge "
     "the LEFTMOST occurrence first, as tiktoken does", _rightmost_tie_bpe),
    ("you matched the longest known token from the left (greedy longest match, as WordPiece does); BPE merges "
     "adjacent pairs instead, the lowest rank first, and can end in other parts", _longest_match),
    ("you ranked each pair by its LEFT part's rank (ranks[left]); a pair's rank is the merged token's, "
     "ranks[left + right]", _left_part_bpe),
    ("you merged every pair that ranks below its neighbours in one sweep; BPE merges ONE pair at a time, the "
     "lowest-ranked, and then looks again, since each merge changes the pairs around it", _local_minima_bpe),
]


def _bpe_type_error(piece: bytes, out: object) -> Verdict | None:
    """A verdict when ``out`` is not a list of bytes parts, naming what it is instead."""
    if out is None:
        return named("your function returned None; did you forget `return`?")
    if not isinstance(out, (list, tuple)):
        return named(f"{piece!r}: return a list of bytes parts, got a {type(out).__name__}")
    if out and all(isinstance(p, int) for p in out):
        return named(f"{piece!r}: return the parts as bytes, not their ranks (got {list(out)})")
    if out and all(isinstance(p, str) for p in out):
        return named(f"{piece!r}: return bytes (b'ab'), not str ('ab')")
    if not all(isinstance(p, bytes) for p in out):
        return named(f"{piece!r}: every part must be bytes, got {list(out)}")
    return None


@checker
def check_bpe(fn: Callable) -> Verdict:
    """``fn(ranks: dict[bytes, int], piece: bytes) -> list[bytes]``: rank-BPE, as tiktoken and K2 encode: start from
    the piece's bytes, merge the adjacent pair with the lowest rank, repeat until no adjacent pair is in the ranks.
    Checked against ``k2lab.tokenizer.rank_bpe`` on toy ranks where the usual wrong rules all give other parts."""
    outputs = []
    for piece in _TOY_PIECES:
        out, error = call(fn, dict(_TOY_RANKS), piece)
        if error is not None:
            return error
        wrong_type = _bpe_type_error(piece, out)
        if wrong_type is not None:
            return wrong_type
        outputs.append(list(out))
    expected = [rank_bpe(_TOY_RANKS, piece) for piece in _TOY_PIECES]
    if outputs == expected:
        return Verdict(True, f"rank-BPE: matches k2lab.tokenizer.rank_bpe on {len(_TOY_PIECES)} pieces")
    for message, mistake in _BPE_MISTAKES:
        if outputs == [mistake(_TOY_RANKS, piece) for piece in _TOY_PIECES]:
            return named(message, "rank-BPE")
    piece, out, right = next(case for case in zip(_TOY_PIECES, outputs, expected, strict=True) if case[1] != case[2])
    if b"".join(out) != piece:
        return named(f"{piece!r}: your parts do not join back to the piece: {out}")
    unknown = [part for part in out if part not in _TOY_RANKS]
    if unknown:
        return named(f"{piece!r}: your parts {unknown} are not tokens of the ranks: every part is a token, and a "
                     f"merge makes one only when left + right is in the ranks")
    left = [(out[i], out[i + 1]) for i in range(len(out) - 1) if out[i] + out[i + 1] in _TOY_RANKS]
    if left:
        a, b = left[0]
        return named(f"{piece!r}: your parts {out} still hold a pair the ranks can merge ({a!r} + {b!r} = "
                     f"{a + b!r}, rank {_TOY_RANKS[a + b]}): keep merging while any adjacent pair is in the ranks")
    return Verdict(False, f"{piece!r}: expected {right}, got {out}")


# --- learning: BPE training ---------------------------------------------------------------------------------------

# A small corpus in which each usual training mistake picks another pair than the right rule at some merge within
# _NUM_MERGES: frequent "the" (so that counts change after merging t+h), "The" at the start of sentences (lower-casing
# the text merges other pairs), é (two bytes in UTF-8), words ending in "e" before a space and ". " (pairs that only
# exist across pre-tokens), and one word repeated many times.
_CORPUS = [
    "The theme: the these there. The thesis. The then. The other. The three. The thin.",
    "café, thé, été. Le café, le thé. Été, été, été. Né, né, dé.",
    "ok ok ok ok ok ok ok ok ok, be be be be. The one. The tone. The bone. The stone.",
]
_NUM_MERGES = 16
_HELD_OUT = "The café, the theme."

Symbols = list[bytes]
Words = list[tuple[Symbols, int]]  # each distinct sequence's current symbols and how often it occurs


def _split_kimi() -> Callable[[str], list[str]]:
    """Kimi K2's pre-tokenizer split (its regex, run by ``tokenizers``): text -> pre-tokens."""
    from tokenizers import Regex, pre_tokenizers  # a k2lab dependency; imported here, where the split is needed

    from ...tokenizer.tokenizer import KIMI_PATTERN

    split = pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated")
    return lambda text: [piece for piece, _ in split.pre_tokenize_str(text)]


def _as_bytes(text: str) -> Symbols:
    return [bytes([b]) for b in text.encode()]


def _as_characters(text: str) -> Symbols:
    return [c.encode() for c in text]


def _words(pieces: Iterable[str], units: Callable[[str], Symbols], weighted: bool = True) -> Words:
    return [(units(piece), n if weighted else 1) for piece, n in Counter(pieces).items()]


def _merged(words: Words, merges: Iterable[Merge]) -> Words:
    """Apply the merges in order, each to every adjacent occurrence from the left."""
    for left, right in merges:
        joined = left + right
        updated = []
        for symbols, n in words:
            out, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == left and symbols[i + 1] == right:
                    out.append(joined)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            updated.append((out, n))
        words = updated
    return words


def _merged_first_only(words: Words, merges: Iterable[Merge]) -> Words:
    """The mistake: apply each merge to its first occurrence in each sequence only."""
    for left, right in merges:
        updated = []
        for symbols, n in words:
            symbols = list(symbols)
            i = next((i for i in range(len(symbols) - 1) if (symbols[i], symbols[i + 1]) == (left, right)), None)
            if i is not None:
                symbols[i: i + 2] = [left + right]
            updated.append((symbols, n))
        words = updated
    return words


def _pair_counts(words: Words) -> Counter[Merge]:
    """How often each adjacent pair occurs, each sequence weighted by how often it occurs (overlaps count)."""
    counts: Counter[Merge] = Counter()
    for symbols, n in words:
        for pair in zip(symbols[:-1], symbols[1:], strict=True):
            counts[pair] += n
    return counts


def train_bpe(texts: list[str], num_merges: int, pre_tokenize: Callable[[str], list[str]]) -> list[Merge]:
    """The reference: byte-level BPE training. Split each text into pre-tokens, start every pre-token from its UTF-8
    bytes, then ``num_merges`` times count the adjacent pairs inside the pre-tokens (each weighted by how often it
    occurs), merge the most frequent pair everywhere and record it. Ties go to the pair whose bytes sort first
    (``check_bpe_training`` accepts any of the tied pairs)."""
    words = _words((piece for text in texts for piece in pre_tokenize(text)), _as_bytes)
    merges: list[Merge] = []
    for _ in range(num_merges):
        counts = _pair_counts(words)
        if not counts:
            break
        best = max(counts.values())
        merge = min(pair for pair, n in counts.items() if n == best)
        merges.append(merge)
        words = _merged(words, [merge])
    return merges


def _as_merges(out: object) -> tuple[list[Merge] | None, Verdict | None]:
    """The learner's answer as a merge list: a list of (left, right) pairs, or a rank dict (its merges recovered
    the way k2lab reads tiktoken files)."""
    if out is None:
        return None, named("BPE training: your function returned None; did you forget `return`?")
    if isinstance(out, dict):
        if not all(isinstance(token, bytes) for token in out):
            return None, named("BPE training: a rank dict maps bytes tokens to ranks; yours has other keys")
        return recover_merges(out), None
    if not isinstance(out, (list, tuple)):
        return None, named(f"BPE training: return the merges as a list of (left, right) bytes pairs, got a "
                                    f"{type(out).__name__}")
    for item in out:
        if isinstance(item, bytes):
            return None, named("BPE training: return each merge as a pair (left, right), e.g. (b't', b'h'), "
                                        f"not the merged token ({item!r})")
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            return None, named(f"BPE training: each merge is a pair (left, right); got {item!r}")
        if any(isinstance(part, str) for part in item):
            return None, named(f"BPE training: merges are of bytes (b'th'), not str ({tuple(item)!r}): BPE "
                                        "on bytes can encode any text")
        if not all(isinstance(part, bytes) for part in item):
            return None, named(f"BPE training: the parts of a merge are bytes; got {item!r}")
    return [tuple(item) for item in out], None


def _whole_character(part: bytes) -> bool:
    """Whether ``part`` is one non-ASCII character's UTF-8 bytes (several bytes, one character)."""
    try:
        return len(part) > 1 and len(part.decode()) == 1
    except UnicodeDecodeError:
        return False


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


NOT_MOST_FREQUENT = "that is not a most frequent pair"


def _learned_by(words: Words, merges: list[Merge], merge: Callable[[Words, Iterable[Merge]], Words] = _merged,
                recount: bool = True, most: bool = True) -> bool:
    """Whether every one of ``merges`` is what a training rule picks at its step: the most (``most``) or least
    frequent pair of ``words`` after the merges before it, counted again each step (``recount``) or once."""
    first = _pair_counts(words)
    for i, pair in enumerate(merges):
        counts = _pair_counts(words) if recount else Counter({p: n for p, n in first.items() if p not in merges[:i]})
        if not counts or counts.get(pair, 0) != (max if most else min)(counts.values()):
            return False
        words = merge(words, [pair])
    return True


def _diagnose_rule(texts: list[str], pre_tokenize: Callable[[str], list[str]], merges: list[Merge]) -> str | None:
    """The usual training mistake that learns exactly these merges, each at its step, if one does."""
    pieces = [piece for text in texts for piece in pre_tokenize(text)]
    lowered = [piece for text in texts for piece in pre_tokenize(text.lower())]
    rules = [
        ("you started from characters, not bytes: start every pre-token from its UTF-8 bytes, so that a character's "
         "bytes merge like any other pair and any text can be encoded", _words(pieces, _as_characters), {}),
        ("you lower-cased the text: BPE learns from the bytes as they are ('T' and 't' are different bytes, and K2's "
         "tokens keep the case)", _words(lowered, _as_bytes), {}),
        ("you did not count the pairs again after merging: each merge changes the counts (count again before every "
         "merge)", _words(pieces, _as_bytes), dict(recount=False)),
        ("you counted each distinct pre-token once; weight each pre-token's pairs by how often it occurs in the "
         "corpus", _words(pieces, _as_bytes, weighted=False), {}),
        ("you counted pairs across pre-token boundaries: split each text with pre_tokenize first and count pairs "
         "only inside each pre-token", _words(texts, _as_bytes), {}),
        ("you split the texts on whitespace yourself: use the pre_tokenize function you are given (K2's regex), "
         "which keeps each space with the word after it, so that b' the' can become a token",
         _words((word for text in texts for word in text.split()), _as_bytes), {}),
        ("you merged only the first occurrence of each pair in a pre-token; merge EVERY occurrence (' été' holds the "
         "pair of é's two bytes twice)", _words(pieces, _as_bytes), dict(merge=_merged_first_only)),
        ("you merged the least frequent pair; merge the MOST frequent one", _words(pieces, _as_bytes),
         dict(most=False)),
    ]
    return next((message for message, words, how in rules if _learned_by(words, merges, **how)), None)


NOT_MOST_FREQUENT = "that is not a most frequent pair"


def _diagnose_merge(texts: list[str], pre_tokenize: Callable[[str], list[str]], done: list[Merge],
                    merge: Merge, later_merges: list[Merge] = ()) -> tuple[str, str]:
    """Why ``merge`` is not a most frequent pair after the right merges ``done``: (the mistake, details), from that
    step alone (when no usual mistake learns the whole list)."""
    pieces = [piece for text in texts for piece in pre_tokenize(text)]
    words = _merged(_words(pieces, _as_bytes), done)
    counts = _pair_counts(words)
    best_n = max(counts.values())
    best = min(pair for pair, n in counts.items() if n == best_n)
    situation = (f"you merged {merge}, seen {_times(counts.get(merge, 0))}; the most frequent pair then is {best}, "
                 f"seen {_times(best_n)}")
    symbols = {symbol for symbols, _ in words for symbol in symbols}
    made = {left + right for left, right in done}
    character = next((part for part in merge if part not in symbols and part not in made and _whole_character(part)),
                     None)
    if character is not None:
        return (f"you started from characters, not bytes ({character!r} is one character, {len(character)} bytes): "
                f"start every pre-token from its UTF-8 bytes, so that a character's bytes merge like any other pair "
                f"and any text can be encoded"), situation
    if 0 < counts.get(merge, 0) == min(counts.values()):
        return "you merged the least frequent pair; merge the MOST frequent one", situation
    later = [(k, m) for k, m in enumerate(later_merges, start=len(done) + 2) if m[0] + m[1] in merge]
    if merge not in counts and later:
        k, m = later[0]
        return (f"your merges are out of order: {merge} needs {m[0] + m[1]!r}, which your merge {k} makes; return "
                f"them in the order they were learned"), situation
    if merge not in counts:
        if merge in _pair_counts(_words(pieces, _as_bytes)):
            return ("that pair occurs in the text, but no longer once the earlier merges are made everywhere: merge "
                    "each learned pair at every place it occurs, in every pre-token, before counting again"), situation
        return "that pair never occurs next to each other after the earlier merges", situation
    return NOT_MOST_FREQUENT, situation


@checker
def check_bpe_training(fn: Callable) -> Verdict:
    """``fn(texts: list[str], num_merges: int, pre_tokenize: Callable[[str], list[str]]) -> list[tuple[bytes,
    bytes]]``: learn ``num_merges`` BPE merges from ``texts``, in the order learned. Byte-level: split each text with
    ``pre_tokenize`` (K2's pre-tokenizer here), start every pre-token from its UTF-8 bytes, count the adjacent pairs
    inside each pre-token (a pre-token that occurs n times counts n times), merge the most frequent pair everywhere,
    record it as (left, right), and repeat, counting again each time. Several pairs may tie for most frequent; any
    of them is accepted (``train_bpe`` takes the one whose bytes sort first). A rank dict (the 256 bytes, then each
    merged token in order) is accepted too.

    Each merge is checked against the counts after your own earlier merges; the first that is not a most frequent
    pair is explained. Then your merges encode a held-out line with ``k2lab.tokenizer.rank_bpe``."""
    pre_tokenize = _split_kimi()
    out, error = call(fn, list(_CORPUS), _NUM_MERGES, pre_tokenize)
    if error is not None:
        return error
    merges, wrong_type = _as_merges(out)
    if wrong_type is not None:
        return wrong_type
    words = _words((piece for text in _CORPUS for piece in pre_tokenize(text)), _as_bytes)
    for i, merge in enumerate(merges[:_NUM_MERGES]):
        counts = _pair_counts(words)
        if counts and counts.get(merge, 0) == max(counts.values()):
            words = _merged(words, [merge])
            continue
        mistake, situation = _diagnose_merge(list(_CORPUS), pre_tokenize, merges[:i], merge, merges[i + 1:])
        mistake = _diagnose_rule(list(_CORPUS), pre_tokenize, merges[:_NUM_MERGES]) or mistake
        if mistake == NOT_MOST_FREQUENT:
            return Verdict(False, f"BPE training, merge {i + 1}: {mistake} ({situation})")
        return Verdict(False, f"BPE training, merge {i + 1}: {mistake} ({situation})", mistake=mistake)
    if len(merges) != _NUM_MERGES:
        return named(f"BPE training: you returned {len(merges)} merges; asked for {_NUM_MERGES} (the 256 "
                              f"single bytes are the start, not merges)")
    ties = ("the same list as exercises.train_bpe" if merges == train_bpe(_CORPUS, _NUM_MERGES, pre_tokenize)
            else "ties broken otherwise than exercises.train_bpe, which is as right")
    ranks = {bytes([b]): b for b in range(256)} | {left + right: 256 + i for i, (left, right) in enumerate(merges)}
    held_out = [part for piece in pre_tokenize(_HELD_OUT) for part in rank_bpe(ranks, piece.encode())]
    return Verdict(True, f"BPE training: each of your {len(merges)} merges is a most frequent pair at its step "
                         f"({ties}); with them {_HELD_OUT!r} encodes as {len(held_out)} tokens instead of "
                         f"{len(_HELD_OUT.encode())} bytes: {held_out}")
