"""What the checkers' tests share (tests/lab/test_checkers_*.py): asserting a verdict, and a learner's own BPE, the
right rule written from its definition (count pairs, merge the most frequent, repeat) for the wrong ones to vary."""

from __future__ import annotations

from collections import Counter

from k2lab.lab import exercises as ex


def passes(verdict: ex.Verdict) -> None:
    assert isinstance(verdict, ex.Verdict)
    assert verdict.ok and repr(verdict).startswith("✓"), verdict.message


def fails_with(verdict: ex.Verdict, reason: str) -> None:
    assert isinstance(verdict, ex.Verdict)
    assert not verdict.ok and repr(verdict).startswith("✗"), verdict.message
    assert reason in verdict.message, verdict.message


def pairs_in(ranks, parts):
    """(rank, position) of every adjacent pair of ``parts`` whose merge ``ranks`` knows."""
    return [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1) if parts[i] + parts[i + 1] in ranks]


def byte_sequences(words):
    return [[bytes([b]) for b in word.encode()] for word in words]


def count_pairs(sequences, weights):
    counts = Counter()
    for seq, n in zip(sequences, weights, strict=True):
        for pair in zip(seq[:-1], seq[1:], strict=True):
            counts[pair] += n
    return counts


def merge_pair(seq, pair):
    out, i = [], 0
    while i < len(seq):
        if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
            out.append(seq[i] + seq[i + 1])
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out


def learn_merges(sequences, weights, num_merges, pick=max):
    """``num_merges`` merges, each of the pair ``pick`` chooses by count (max: the most frequent)."""
    merges = []
    for _ in range(num_merges):
        counts = count_pairs(sequences, weights)
        pair = pick(counts, key=counts.get)
        merges.append(pair)
        sequences = [merge_pair(seq, pair) for seq in sequences]
    return merges
