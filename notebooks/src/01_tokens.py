# %% [markdown]
# # 01 · Tokens
#
# A language model reads integers, not text. K2's tokenizer turns text into ids in three steps:
#
# 1. a **pre-tokenizer** cuts the text into pieces with a regular expression (words, numbers, punctuation,
#    whitespace), so no token can span two words;
# 2. **byte-pair encoding** ([BPE](GLOSSARY.md#bpe)) turns each piece into tokens: start from the piece's UTF-8 bytes and keep
#    merging the adjacent pair with the lowest rank, as long as some pair is in the vocabulary;
# 3. **special tokens** (`[BOS]`, `<|im_user|>`, ...) are matched first and get ids of their own.
#
# K2 has 163,840 ids: 163,584 BPE tokens (ranks) and 256 special ids after them. K2-nano's tokenizer has the same
# layout at 8,192 ids (7,936 + 256), learned on Python's standard library with K2's own regex.

# %% tags=["parameters"]
from pathlib import Path

import k2lab
from k2lab import lab

lab.setup_notebook()
settings = lab.LabSettings.from_env()
tok = lab.tokenizer(settings)  # the tokenizer alone: no weights needed here
where, root = Path(tok.name), Path(k2lab.__file__).parent.parent  # tok.name: the folder it came from, or a hub id
# the bundled tokenizer shows as k2lab/lab/assets/nano, not as a path on the machine that ran this cell
shown = str(where.relative_to(root)) if where.is_relative_to(root) else tok.name
print(f"K2Tokenizer({shown!r}, vocab_size={tok.vocab_size}, allow_special={tok.allow_special})")

# %% [markdown]
# ## The pre-tokenizer
#
# K2's regex (`k2lab.tokenizer.KIMI_PATTERN`) has eight alternatives, tried left to right at each position; the
# table gives the first five a row each and groups the last three, which all match whitespace, in its last row:
#
# | branch | matches | example |
# | --- | --- | --- |
# | `[\p{Han}]+` | a run of Chinese characters, on its own | `你好世界` |
# | upper\* lower+ | a word that ends in lower case, optionally after one punctuation or space | ` camel`, `Case`, `HTTPServer` |
# | upper+ lower\* | an all-caps or capitalised word | ` ALLCAPS` |
# | `\p{N}{1,3}` | numbers, in pieces of at most three digits | `123`, `456`, `7` |
# | punctuation | a run of punctuation, optionally after a space, with trailing newlines | ` ==` |
# | newlines, spaces | runs of whitespace; the last space before a word stays with the word | |
#
# Letters in the word branches exclude Han (`&&[^\p{Han}]`, a class intersection that Python's `re` cannot read;
# the Rust `tokenizers` library and tiktoken both can). Contractions (`'s`, `'t`, `'re`, ...) stick to their word.

# %%
from IPython.display import HTML
from tokenizers import Regex, pre_tokenizers

from k2lab import viz
from k2lab.tokenizer import KIMI_PATTERN

split = pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated")
sample = "HTTPServer camelCase ALLCAPS x = 1234567 don't 你好世界hello\n\n    return"
pieces = split.pre_tokenize_str(sample)  # [(piece, (start, end))]
HTML(viz.spans_html([(piece, None) for piece, _ in pieces]))

# %% [markdown]
# The numbers rule is checkable: a seven-digit number always becomes pieces of three, three and one digits, so
# the model sees digits in a fixed grouping.

# %%
# NBVAL_CHECK_OUTPUT
print([piece for piece, _ in split.pre_tokenize_str("x = 1234567")])

# %% [markdown]
# ## Byte-pair encoding
#
# The rank file (`tiktoken.model`) lists every token as a byte string with its rank; the 256 single bytes come
# first. Encoding a piece starts from its bytes and repeatedly merges the adjacent pair whose merged bytes have the
# lowest rank. `k2lab.tokenizer.rank_bpe(ranks, piece, max_rank=r)` stops before rank r, so calling it with
# growing r replays the merges one by one:

# %%
from k2lab.tokenizer import rank_bpe

num_ranks = min(tok.special_tokens.values())  # specials come right after the ranks
ranks = {tok.token_bytes(i): i for i in range(num_ranks)}
piece = b" tokenizer"
subwords = {piece[a:b] for a in range(len(piece)) for b in range(a + 2, len(piece) + 1)}
steps = sorted(ranks[s] for s in subwords if s in ranks)  # ranks of multi-byte tokens inside the piece
show = lambda parts: [p.decode(errors="replace") for p in parts]
previous = rank_bpe(ranks, piece, max_rank=0)
print(f"{'bytes':>20}: {show(previous)}")
for rank in steps:
    parts = rank_bpe(ranks, piece, max_rank=rank + 1)  # every merge up to this rank applied
    if parts != previous:
        print(f"rank {rank:>5} {tok.id_to_piece(rank)!r:>9}: {show(parts)}")
    previous = parts

# %% [markdown]
# The last line is what `encode` returns. The tokenizer object gives each token's id, text and character span:

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
# ## The running prompt
#
# Notebooks 00 to 07 follow one prompt, `lab.PROMPT`. Here are its tokens: K2-nano's 8,192-entry vocabulary has
# no single token for ` radius`, so it takes three (` r`, `adi`, `us`); K2's 163,840 entries hold far more whole
# words.

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
# conversation turns and tool calls; most are reserved.

# %%
# NBVAL_CHECK_OUTPUT
named = {name: i for name, i in tok.special_tokens.items() if not name.startswith("<|reserved")}
print(f"{len(tok.special_tokens)} special ids from {num_ranks:,}; vocabulary {tok.vocab_size:,}")
for name, i in named.items():
    print(f"{i:>7}  {name}")

# %% [markdown]
# ## The chat template
#
# K2-Instruct reads a conversation as turns (its [chat template](GLOSSARY.md#chat-template)), each `<|im_X|>role<|im_middle|>content<|im_end|>`. Without a system
# message, the template adds K2's default one; the generation prompt at the end opens the assistant's turn.
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
# `allow_special=True` (K2's default) it does: the six characters become the one special id. With
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
# ## Exercises
#
# **1. Predict, then run.** Into which pieces does the pre-tokenizer cut `"x = 1234567890"`? Write them down, then
# run `split.pre_tokenize_str`.
#
# **2. Change a knob.** In the BPE replay above, change `piece` to `b" radius"` and then to `b" perimeter"`. Predict
# first: how many merges does each take, and where does each stop?

# %%
# your code here

# %% [markdown]
# **3. Write it yourself: rank-BPE.** Given the ranks (bytes -> rank) and a piece's bytes, start from single bytes
# and repeatedly merge the adjacent pair whose merged bytes have the lowest rank, until no adjacent pair is in the
# ranks. The check runs your function on a small rank table where the order of merges matters.

# %%
from k2lab.lab import exercises


def my_bpe(ranks: dict[bytes, int], piece: bytes) -> list[bytes]:
    """The parts of ``piece`` after rank-BPE, e.g. [b' token', b'izer']."""
    raise NotImplementedError


print(exercises.check_bpe(my_bpe))

# %% [markdown]
# ## Solutions
#
# **1.** The number is cut in threes from the left (`\p{N}{1,3}`): `123`, `456`, `789`, `0`. The space before it
# is a piece of its own (the space before a word or number stays with it only for letters): `x`, ` =`, ` `,
# then the digits.

# %% tags=["solution"]
print([piece for piece, _ in split.pre_tokenize_str("x = 1234567890")])

# %% [markdown]
# **2.** The replay, for both pieces:

# %% tags=["solution"]
for word in (b" radius", b" perimeter"):
    parts, merges = rank_bpe(ranks, word, max_rank=0), 0
    for rank in sorted(ranks[word[a:b]] for a in range(len(word)) for b in range(a + 2, len(word) + 1)
                       if word[a:b] in ranks):
        step = rank_bpe(ranks, word, max_rank=rank + 1)
        merges += step != parts
        parts = step
    print(f"{word!r}: {merges} merges -> {show(parts)}")

# %% [markdown]
# **3.** Find the lowest-ranked adjacent pair, merge it, repeat; and the same function on the real ranks gives
# the tokenizer's own pieces:

# %% tags=["solution"]
def my_bpe(ranks: dict[bytes, int], piece: bytes) -> list[bytes]:
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while True:
        pairs = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
        if not pairs:
            return parts
        _, i = min(pairs)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


assert exercises.check_bpe(my_bpe)
print(exercises.check_bpe(my_bpe))
print(show(my_bpe(ranks, b" tokenizer")), "=", [t.text for t in tok.pieces(" tokenizer")])
