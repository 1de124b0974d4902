# %% [markdown]
# # 01 · Tokens
#
# A language model reads integers, not text. The simplest mapping gives every byte its own id: 256 ids, and any
# text at all can be written with them. Its cost is length: attention compares every position with every other, so
# a text twice as long costs four times as much, and a byte carries little meaning on its own. The opposite choice,
# one id per word, makes sequences short but needs an open-ended vocabulary (every identifier, typo and language)
# and still fails on a word it never saw. **Byte-pair encoding** ([BPE](GLOSSARY.md#bpe)) sits between the two:
# start from bytes, and learn from a corpus which byte sequences are frequent enough to deserve an id of their own.
#
# K2's tokenizer turns text into ids in three steps:
#
# 1. a **pre-tokenizer** cuts the text into pieces with a regular expression (words, numbers, punctuation,
#    whitespace), so no token can span two words;
# 2. **BPE** turns each piece into tokens: start from the piece's UTF-8 bytes and keep merging the adjacent pair
#    with the lowest rank (the earliest learned), as long as some pair is in the vocabulary;
# 3. **special tokens** (`[BOS]`, `<|im_user|>`, ...) are matched first and get ids of their own.
#
# In this notebook you write the two halves of BPE yourself: **learning** the ranks from a corpus, then
# **encoding** with them, and you check both against k2lab's tokenizer.
#
# *Sources.* K2's vocabulary has 163,840 ids (`vocab_size` in the released `config.json`): 163,584 BPE tokens in
# the released rank file `tiktoken.model`, then 256 special ids named in `tokenizer_config.json`; the regex is
# `pat_str` in the release's `tokenization_kimi.py`. What the sources leave unsaid: neither the K2 report nor the
# release says how the ranks were learned (on which corpus, in which language mix, with which trainer). We know
# the result, not the recipe. K2-nano's tokenizer has the same layout at 8,192 ids (7,936 + 256); k2lab learned it
# on Python's standard library with K2's own regex.

# %% tags=["parameters"]
from k2lab import lab

lab.setup_notebook()
settings = lab.LabSettings.from_env()
tok = lab.tokenizer(settings)  # the tokenizer alone: no weights needed here
name = "K2-nano (bundled)" if settings.is_nano else settings.model
print(f"{name}: vocab_size={tok.vocab_size:,}, allow_special={tok.allow_special}")

# %% [markdown]
# ## Bytes first
#
# UTF-8 writes an ASCII character in one byte, `é` in two, `你` in three. Every text is a byte string, so a
# tokenizer that starts from bytes never meets an unknown symbol. Here is how much BPE shortens the lab's running
# prompt (`lab.PROMPT`, which notebooks 00 to 07 all follow):

# %%
# NBVAL_CHECK_OUTPUT
print(f"{len(lab.PROMPT)} characters, {len(lab.PROMPT.encode())} bytes -> {len(tok.encode(lab.PROMPT))} tokens")
print({c: list(c.encode()) for c in "aé你"})

# %% [markdown]
# ## The pre-tokenizer
#
# K2's regex (`k2lab.tokenizer.KIMI_PATTERN`) has eight alternatives, tried left to right at each position. One row
# each:
#
# | # | alternative | matches | example |
# | --- | --- | --- | --- |
# | 1 | `[\p{Han}]+` | a run of Chinese characters, on its own | `你好世界` |
# | 2 | upper\* lower+ | a word that ends in lower case, after at most one space or punctuation mark | ` camel`, `Case`, `HTTPServer` |
# | 3 | upper+ lower\* | an all-caps or capitalised word, likewise | ` ALLCAPS` |
# | 4 | `\p{N}{1,3}` | a number, in pieces of at most three digits | `123`, `456`, `7` |
# | 5 | ` ?[^\s\p{L}\p{N}]+[\r\n]*` | a run of punctuation, after at most one space, with the newlines after it | ` ==`, `):↵` |
# | 6 | `\s*[\r\n]+` | whitespace that ends in newlines | `↵↵` |
# | 7 | `\s+(?!\S)` | spaces not followed by text: all but the last space before a word, which goes with the word | `···` before `·return` |
# | 8 | `\s+` | any other whitespace, such as the space before a number | `·` before `123` |
#
# Letters in alternatives 2 and 3 exclude Han (`&&[^\p{Han}]`, a class intersection that Python's `re` cannot read;
# the Rust `tokenizers` library and tiktoken both can). Contractions (`'s`, `'t`, `'re`, ...) stick to their word.
# Below, each coloured box is one piece (`·` is a space, `↵` a newline):

# %%
from IPython.display import HTML
from tokenizers import Regex, pre_tokenizers

from k2lab import viz
from k2lab.tokenizer import KIMI_PATTERN

split = pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated")


def pre_tokenize(text: str) -> list[str]:
    """K2's pre-tokenizer: text -> pieces (no piece spans two words)."""
    return [piece for piece, _ in split.pre_tokenize_str(text)]


sample = "HTTPServer camelCase ALLCAPS x = 1234567 don't 你好世界hello\n\n    return"
HTML(viz.spans_html([(piece, None) for piece in pre_tokenize(sample)]))

# %% [markdown]
# The numbers rule is checkable: a seven-digit number always becomes pieces of three, three and one digits, so
# the model sees digits in a fixed grouping.

# %%
# NBVAL_CHECK_OUTPUT
print(pre_tokenize("x = 1234567"))

# %% [markdown]
# ## Learning the ranks: BPE training
#
# Where do the ranks come from? From a corpus, by a greedy loop:
#
# 1. cut every text into pre-tokens and count how often each distinct pre-token occurs;
# 2. write every pre-token as its UTF-8 bytes (the 256 single bytes are the starting vocabulary, ranks 0..255);
# 3. count every adjacent pair of symbols inside the pre-tokens, a pre-token that occurs n times counting n times;
# 4. merge the most frequent pair everywhere it occurs, record it as the next merge (its rank is 256, 257, ...);
# 5. count again (the merge changed the pairs around it) and repeat, as many times as you want merges.
#
# The pre-tokenizer is what keeps merges inside words: without it, `e` at the end of `the` and the space after it
# would be a frequent pair, and tokens would straddle word boundaries. Here are the pre-tokens of a small corpus
# and their counts:

# %%
# NBVAL_CHECK_OUTPUT
from collections import Counter

corpus = ["the cat sat on the mat. the cat ate.", "the theme of the thesis: café, thé."]
words = Counter(piece for text in corpus for piece in pre_tokenize(text))
print(words.most_common(8))
print("' café' as bytes:", [bytes([b]) for b in " café".encode()])

# %% [markdown]
# **Predict** before you write anything: which pair of bytes will be merged first in this corpus, and which second?
# (Count ` t`, `th`, `he` and `at` in your head, each pre-token weighted by its count.)
#
# ### Exercise 1 ★★ · Write it yourself: BPE training
#
# Write `my_train_bpe(texts, num_merges, pre_tokenize)`: return the merges in the order learned, each as a pair of
# byte strings `(left, right)`. Running the cell checks it (`@lab.mine` calls `exercises.check_bpe_training`, which
# runs it on its own small corpus with K2's pre-tokenizer and checks each merge against the counts after your earlier
# ones; a mistake it knows, such as characters instead of bytes, counting across pre-tokens, counting once and never
# again, or each pre-token counted once, is named) and keeps it in your module, `mine.py`.

# %%
from k2lab.lab import exercises


@lab.mine
def my_train_bpe(texts: list[str], num_merges: int, pre_tokenize) -> list[tuple[bytes, bytes]]:
    """Learn num_merges BPE merges from texts: [(b't', b'h'), (b'th', b'e'), ...]."""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Work on the distinct pre-tokens, each with how often it occurs, written as a sequence of symbols that starts as
# its UTF-8 bytes. A round counts the adjacent pairs (a pre-token seen n times counts n times), merges the most
# frequent pair everywhere, and records it. The merge changes the pairs around it, so the next round counts again.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Keep a dict from each distinct pre-token's current symbols (a tuple of byte strings) to its count. Each round:
# a `Counter` of `zip(seq, seq[1:])` over every sequence, adding the sequence's count; `max(counts, key=counts.get)`
# is the pair to merge; then rebuild every sequence, replacing each adjacent `(left, right)` from left to right by
# `left + right`. Start the symbols with `bytes([b]) for b in piece.encode()`, not with the characters.

# %% [markdown] tags=["solution"]
# The three steps are three small functions: count the pairs, merge one pair everywhere, and the loop that does both
# `num_merges` times. Counting again every round matters: merging `t`+`h` removes the `h e` pairs inside `the` and
# creates `th e` ones. The solution has a name of its own, `solution_train_bpe`, so running it never replaces yours;
# the first merges of the small corpus above, the answer to the prediction, sit in a fold of their own.

# %% tags=["solution"]
# Solution (click to show)
def count_pairs(sequences: dict[tuple[bytes, ...], int]) -> Counter:
    counts = Counter()
    for seq, n in sequences.items():
        for pair in zip(seq, seq[1:]):
            counts[pair] += n  # a pre-token seen n times counts n times
    return counts


def merge(seq: tuple[bytes, ...], pair: tuple[bytes, bytes]) -> tuple[bytes, ...]:
    out, i = [], 0
    while i < len(seq):
        if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
            out.append(seq[i] + seq[i + 1])
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return tuple(out)


def solution_train_bpe(texts: list[str], num_merges: int, pre_tokenize) -> list[tuple[bytes, bytes]]:
    pieces = Counter(piece for text in texts for piece in pre_tokenize(text))
    sequences = {tuple(bytes([b]) for b in piece.encode()): n for piece, n in pieces.items()}  # bytes, not chars
    merges = []
    for _ in range(num_merges):
        counts = count_pairs(sequences)
        if not counts:
            break
        best = max(counts, key=counts.get)
        merges.append(best)
        sequences = {merge(seq, best): n for seq, n in sequences.items()}
    return merges


print(exercises.check_bpe_training(solution_train_bpe))
print(solution_train_bpe(corpus, 4, pre_tokenize))

# %% [markdown]
# ### Your trainer on real text
#
# K2-nano's ranks were learned on Python's standard library. Run the trainer on one module of it, `textwrap.py`
# (about 20,000 characters; it takes a second), and compare the first merges with K2-nano's vocabulary. The trainer
# is yours from `mine.py` if it passed its check, else the reference (the first line printed says which). The exact
# list depends on your Python version's copy of the file, so this cell's output is not checked:

# %%
import inspect
import textwrap

mine = lab.mine.load("my_train_bpe")  # your module: yours where it passed its check, the reference elsewhere
num_ranks = min(tok.special_tokens.values())  # specials come right after the ranks
nano_ranks = {tok.token_bytes(i): i for i in range(num_ranks)}

trained_merges = mine.my_train_bpe([inspect.getsource(textwrap)], 300, pre_tokenize)
learned = [left + right for left, right in trained_merges]
print("the first 16 tokens learned:", [t.decode(errors="replace") for t in learned[:16]])
print(f"{sum(t in nano_ranks for t in learned)} of the {len(learned)} tokens are in K2-nano's vocabulary")
print("K2-nano's ranks of the first 8:", [nano_ranks.get(t) for t in learned[:8]])

# %% [markdown]
# Runs of spaces come first: Python's indentation is the most frequent thing in the file. Then frequent subwords
# (`in`, `en`, ` t`, ...) and soon whole words (` the`, ` in`). Most of these tokens are also K2-nano's, and its
# first ranks (256, 257, ...) are the same whitespace runs: the same algorithm on the same kind of text. K2's own
# 163,584 ranks came out of the same kind of loop on a far larger and more varied corpus (which one, the sources do
# not say).
#
# ## Encoding with the ranks: rank-BPE
#
# Training applied its merges in a fixed order. To encode a new piece, replay that order: start from its bytes and
# repeatedly merge the adjacent pair whose merged bytes have the **lowest rank** (the one learned earliest), until no
# adjacent pair is in the vocabulary. A rank file such as `tiktoken.model` stores only the tokens and their ranks,
# no merge list: the ranks are enough. `k2lab.tokenizer.rank_bpe(ranks, piece, max_rank=r)` stops before rank r, so
# calling it with growing r replays the merges one by one, here with K2-nano's ranks:

# %%
from k2lab.tokenizer import rank_bpe

piece = b" tokenizer"
subwords = {piece[a:b] for a in range(len(piece)) for b in range(a + 2, len(piece) + 1)}
steps = sorted(nano_ranks[s] for s in subwords if s in nano_ranks)  # ranks of multi-byte tokens inside the piece
show = lambda parts: [p.decode(errors="replace") for p in parts]
previous = rank_bpe(nano_ranks, piece, max_rank=0)
print(f"{'bytes':>20}: {show(previous)}")
for rank in steps:
    parts = rank_bpe(nano_ranks, piece, max_rank=rank + 1)  # every merge up to this rank applied
    if parts != previous:
        print(f"rank {rank:>5} {tok.id_to_piece(rank)!r:>9}: {show(parts)}")
    previous = parts

# %% [markdown]
# The last line is what `encode` returns. Notice that the merges do not run from left to right: which pair merges
# next depends only on the ranks.
#
# ### Exercise 2 ★★ · Write it yourself: rank-BPE
#
# Given the ranks (bytes -> rank) and a piece's bytes, start from single bytes and repeatedly merge the adjacent pair
# whose merged bytes have the lowest rank, until no adjacent pair is in the ranks. The check runs your function on a
# small rank table where the order of merges matters, so merging the first pair from the left, the highest rank
# first, or the longest known token are each caught and named.

# %%
@lab.mine
def my_bpe(ranks: dict[bytes, int], piece: bytes) -> list[bytes]:
    """The parts of ``piece`` after rank-BPE, e.g. [b' token', b'izer']."""
    raise NotImplementedError

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# A merge is allowed only when the two adjacent parts joined are a token of the vocabulary, and among the allowed
# merges the lowest rank goes first, wherever it sits in the piece. Repeat until no adjacent pair joins into a token.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Keep `parts`, a list of byte strings, starting as `[piece[i:i + 1] for i in range(len(piece))]`. In a loop, list
# `(ranks[a + b], i)` for every adjacent pair `a, b = parts[i], parts[i + 1]` whose join is in `ranks`; stop when
# there is none; otherwise take the `min` (lowest rank, then leftmost) and replace `parts[i:i + 2]` by the join.

# %% [markdown] tags=["solution"]
# Find the lowest-ranked adjacent pair, merge it, repeat. `min` over `(rank, position)` also settles a tie the way
# tiktoken does: when the same pair occurs twice, the leftmost merges first.

# %% tags=["solution"]
# Solution (click to show)
def solution_bpe(ranks: dict[bytes, int], piece: bytes) -> list[bytes]:
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while True:
        pairs = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
        if not pairs:
            return parts
        _, i = min(pairs)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


print(exercises.check_bpe(solution_bpe))

# %% [markdown]
# ### Your two pieces together
#
# The merges become ranks (the 256 bytes first, then each merge in the order learned), and `my_bpe` encodes with
# them, piece by piece after the pre-tokenizer: a whole tokenizer, from your own code where you wrote it (the first
# lines printed say which pieces are yours).

# %%
mine = lab.mine.load("my_train_bpe", "my_bpe")
trained_ranks = {bytes([b]): b for b in range(256)} | {token: 256 + i for i, token in enumerate(learned)}


def encode_with(ranks: dict[bytes, int], text: str) -> list[bytes]:
    return [part for piece in pre_tokenize(text) for part in mine.my_bpe(ranks, piece.encode())]


held_out = "def perimeter(radius):\n    return 2 * 3.14159 * radius"
with_trained, with_nano = encode_with(trained_ranks, held_out), encode_with(nano_ranks, held_out)
print(f"{len(held_out.encode())} bytes -> {len(with_trained)} tokens with the {len(learned)} merges learned above, "
      f"{len(with_nano)} with K2-nano's {num_ranks - 256:,}")

# %% [markdown]
# The 300 merges, learned from one file, already save about a third of the bytes on a line they never saw; K2-nano's
# 7,680 save more than half. And with K2-nano's ranks, `my_bpe` is the tokenizer:

# %%
# NBVAL_CHECK_OUTPUT
with_nano_ranks = [t.decode() for t in encode_with(nano_ranks, lab.PROMPT)]
print("my_bpe with K2-nano's ranks == the tokenizer:", with_nano_ranks == [t.text for t in tok.pieces(lab.PROMPT)])

# %% [markdown]
# ## K2-nano's vocabulary at work
#
# The tokenizer object gives each token's id, text and character span:

# %%
# NBVAL_CHECK_OUTPUT
for t in tok.pieces(" tokenizer"):
    print(t.id, repr(t.text), (t.start, t.end))

# %% [markdown]
# A piece the vocabulary has never seen falls apart into smaller tokens, down to single bytes. K2-nano learned
# on English and Python, so Chinese characters become raw UTF-8 bytes (written `<0xE4>` and so on; it takes three
# tokens per character), where K2's own vocabulary has many of them as single tokens.

# %%
HTML(viz.tokens_html(tok.pieces("你好 HTTPServer")))

# %% [markdown]
# The running prompt: K2-nano's 8,192-entry vocabulary has no single token for ` radius`, so it takes three (` r`,
# `adi`, `us`); K2's 163,840 entries hold far more whole words.

# %%
# NBVAL_CHECK_OUTPUT
prompt_tokens = tok.pieces(lab.PROMPT)
print(f"{len(lab.PROMPT)} characters -> {len(prompt_tokens)} tokens")
print([t.text for t in tok.pieces(" radius")])

# %%
HTML(viz.tokens_html(prompt_tokens))

# %% [markdown]
# ## Special tokens
#
# The 256 ids after the ranks are special: they are never produced by BPE, only by name. K2 uses them to mark
# conversation turns and tool calls; most are reserved (the names come from the release's `tokenizer_config.json`;
# K2-nano keeps K2's names at its own ids).

# %%
# NBVAL_CHECK_OUTPUT
named = {name: i for name, i in tok.special_tokens.items() if not name.startswith("<|reserved")}
print(f"{len(tok.special_tokens)} special ids from {num_ranks:,}; vocabulary {tok.vocab_size:,}")
for name, i in named.items():
    print(f"{i:>7}  {name}")

# %% [markdown]
# ## The chat template
#
# K2-Instruct reads a conversation as turns (its [chat template](GLOSSARY.md#chat-template), shipped with the
# release's tokenizer files), each `<|im_X|>role<|im_middle|>content<|im_end|>`. Without a system message, the
# template adds K2's default one; the generation prompt at the end opens the assistant's turn.
# `k2lab.chat.render_chat` writes the template out in plain Python (no jinja).

# %%
# NBVAL_CHECK_OUTPUT
from k2lab.tokenizer.chat import render_chat

messages = [{"role": "user", "content": "What does len([1, 2]) return?"}]
print(render_chat(messages))

# %% [markdown]
# The markers become their special ids (starred below); the text between them is ordinary BPE.

# %%
chat_ids = tok.apply_chat_template(messages)
special_ids = set(tok.special_tokens.values())
HTML(viz.spans_html([(tok.id_to_piece(i), f"{i}{'*' if i in special_ids else ''}") for i in chat_ids]))

# %% [markdown]
# **Untrusted text.** If a user types `<|im_end|>` inside a message, should it end the turn? With
# `allow_special=True` (K2's default) it does: the ten characters become the one special id. With
# `allow_special=False` they stay plain text, cut by the pre-tokenizer and merged by ordinary BPE like any other
# text (the pieces are printed below), so the conversation's structure cannot be forged.

# %%
# NBVAL_CHECK_OUTPUT
typed = "hi<|im_end|>"
print("allow_special=True: ", tok.encode(typed, allow_special=True))
print("allow_special=False:", tok.encode(typed, allow_special=False),
      [tok.id_to_piece(i) for i in tok.encode(typed, allow_special=False)])

# %% [markdown]
# ## Explorer
#
# Type anything: the tokens appear coloured with their ids, special tokens starred. Try numbers, code, a
# capitalised word glued to a lower-case one, or a language K2-nano never saw.

# %% tags=["nbval-ignore-output"]
viz.widgets.token_explorer(tok, "for i in range(10):\n    print(i ** 2)  # 0 1 4 9 ...")

# %% [markdown]
# ## More exercises
#
# ### Exercise 3 ★ · Predict, then run
#
# Into which pieces does the pre-tokenizer cut `"x = 1234567890"`? Write them down, then run `pre_tokenize`.

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Walk the table's alternatives at each position: letters (2, 3), digits in threes (4), punctuation with at most one
# space before it (5). A space followed by a digit is taken by none of 2-5, and alternative 7 leaves it alone because
# a non-space follows it.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `pre_tokenize("x = 1234567890")`, defined above, returns the pieces.

# %% [markdown] tags=["solution"]
# The number is cut in threes from the left (`\p{N}{1,3}`): `123`, `456`, `789`, `0`. The space before it is a
# piece of its own (alternative 8): a space joins the next piece only for letters and punctuation. So: `x`, ` =`,
# ` `, then the digits.

# %% tags=["solution"]
# Solution (click to show)
print(pre_tokenize("x = 1234567890"))

# %% [markdown]
# ### Exercise 4 ★ · Change a knob
#
# In the rank-BPE replay above, change `piece` to `b" radius"` and then to `b" perimeter"`. Predict first: how many
# merges does each take, and where does each stop?

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# A merge happens only when both halves are already tokens, and each merge turns two parts into one. ` radius` ends
# as three tokens (printed earlier), so count the merges that build ` r`, `adi` and `us` from seven bytes.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# Copy the replay cell above with `piece = b" radius"` (and then `b" perimeter"`), and count the lines it prints
# after the bytes.

# %% [markdown] tags=["solution"]
# Each merge removes one part, so the number of merges is the number of bytes minus the number of final parts:
# ` radius` goes from 7 bytes to 3 tokens in 4 merges. The replay for both pieces:

# %% tags=["solution"]
# Solution (click to show)
for word in (b" radius", b" perimeter"):
    parts, merges = rank_bpe(nano_ranks, word, max_rank=0), 0
    for rank in sorted(nano_ranks[word[a:b]] for a in range(len(word)) for b in range(a + 2, len(word) + 1)
                       if word[a:b] in nano_ranks):
        step = rank_bpe(nano_ranks, word, max_rank=rank + 1)
        merges += step != parts
        parts = step
    print(f"{word!r}: {merges} merges -> {show(parts)}")

# %% [markdown]
# ### Exercise 5 ★★ · Change a knob: no pre-tokenizer
#
# Train 300 merges on `textwrap.py` again with `mine.my_train_bpe` (yours, or the reference), but pass
# `lambda text: [text]` as the pre-tokenizer, so the whole file is one piece. Predict: which kind of tokens appear
# that K2's regex forbids? How many of the 300 contain a letter followed by a space?

# %%
# your code here

# %% [markdown] tags=["hint"]
# **Hint 1 · the idea**
#
# Without the regex, nothing stops a merge across a word's end: look for tokens such as `e ` or `s.`, a word's last
# letters glued to the space or punctuation after it.

# %% [markdown] tags=["hint"]
# **Hint 2 · the code**
#
# `[l + r for l, r in mine.my_train_bpe([inspect.getsource(textwrap)], 300, lambda text: [text])]`, then count the
# tokens for which `re.search(rb"[a-z] ", t)` finds something.

# %% [markdown] tags=["solution"]
# Without the pre-tokenizer, the most frequent pairs straddle word boundaries: a word's end merges with the space,
# newline or punctuation after it (`e `, `s.`, `):` plus indentation), so the vocabulary spends ids on fragments
# such as `e the` that mean nothing on their own. The regex forbids exactly these: every K2 token lies inside one
# piece.

# %% tags=["solution"]
# Solution (click to show)
import re

whole = [left + right for left, right in mine.my_train_bpe([inspect.getsource(textwrap)], 300, lambda text: [text])]
crossing = [t for t in whole if re.search(rb"[a-z] ", t)]
print(f"{len(crossing)} of {len(whole)} tokens hold a letter followed by a space, e.g.",
      [t.decode(errors="replace") for t in crossing[:8]])
print("with K2's regex:", sum(bool(re.search(rb"[a-z] ", t)) for t in learned))
