"""The Kimi K2 tokenizer: tiktoken's rank file, run by Hugging Face `tokenizers`.

K2 ships its vocabulary the tiktoken way: `tiktoken.model` lists every byte string with its rank, and
`tokenizer_config.json` names the special ids above the ranks. A rank file holds no merge list, yet a
`tokenizers` BPE model needs one. We recover it the way tiktoken itself would build each token: run
rank-BPE on the token's bytes using only lower ranks, and the last two parts are its merge. (Ordering
merges by id or by length instead looks right on most text and then silently disagrees.)

The pre-tokenizer is Kimi's own regex, passed explicitly. Converters default to GPT-4's pattern, and a
vocabulary trained with Kimi's pattern hides that mistake on most text. The regex uses `&&` class
intersection, which tiktoken's and tokenizers' engines read the same way (Python's `re` cannot).

    tok = load_tokenizer("moonshotai/Kimi-K2-Instruct")   # or a local directory, or k2lab.lab.NANO_DIR
    ids = tok.encode("Hello, K2!")
    tok.decode(ids)
"""

from __future__ import annotations

import codecs
import json
import operator
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from .chat import chat_segments
from .ranks import TokenizerFileError, byte_level, recover_merges
from .template import encode_with_template

KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
r"""Kimi K2's pre-tokenizer (``pat_str`` in the release's tokenization_kimi.py): Han runs on their own, then GPT-4-style
words, 1-3 digit numbers, punctuation runs, newlines and other whitespace. Letters exclude Han (``&&[^\p{Han}]``) so
that the first branch gets them."""

RANKS_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_JSON = "tokenizer.json"  # DeepSeek's layout: the finished `tokenizers` model (k2lab.tokenizer.tokenizer_json)
NUM_RESERVED_SPECIAL_TOKENS = 256  # ids len(ranks) .. len(ranks)+255, as in K2 (163,584 + 256 = 163,840)

# The nano tokenizer (8,192 ids) trained on the standard library by scripts/train_nano_tokenizer.py.

# Texts longer than this are cut at safe places and encoded as one parallel batch (see _chunks).
CHUNK_CHARS = 4096


@dataclass(frozen=True)
class Token:
    """One token of an encoded text, for display.

    `start`/`end` are character offsets into the text. A token holding only part of a character's
    UTF-8 bytes spans that whole character, so neighbouring tokens may share a span. `text` is the
    token's text, with bytes that are not whole characters written as <0xNN>.
    """

    id: int
    text: str
    start: int
    end: int
    raw: bytes


def kimi_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Kimi's regex split, then bytes to the byte-level alphabet (no second regex: use_regex=False)."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def build_backend(
    ranks: dict[bytes, int],
    merges: list[tuple[bytes, bytes]],
    special_tokens: dict[str, int] | None = None,
) -> Tokenizer:
    """A `tokenizers.Tokenizer` equal to tiktoken on these ranks: byte-level BPE, Kimi's split, no normalizer.

    `merges` come from recover_merges(ranks). Special tokens, if given, must take the ids right after
    the ranks, in order.
    """
    vocab = {byte_level(token): rank for token, rank in ranks.items()}
    model = BPE(vocab=vocab, merges=[(byte_level(a), byte_level(b)) for a, b in merges], ignore_merges=True)
    backend = Tokenizer(model)
    backend.pre_tokenizer = kimi_pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    if special_tokens:
        by_id = sorted(special_tokens.items(), key=lambda item: item[1])
        backend.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in by_id])
        for name, i in by_id:
            if backend.token_to_id(name) != i:
                raise ValueError(f"special token {name!r} (id {i}) is also an ordinary token of the vocabulary")
    return backend


def special_tokens_from_config(config: dict, num_ranks: int, path: str | Path) -> dict[str, int]:
    """The 256 reserved ids after the ranks, named by `added_tokens_decoder` (absolute ids) or reserved."""
    names = {i: f"<|reserved_token_{i}|>" for i in range(num_ranks, num_ranks + NUM_RESERVED_SPECIAL_TOKENS)}
    for key, entry in config.get("added_tokens_decoder", {}).items():
        try:
            i = int(key)
            name = entry["content"] if isinstance(entry, dict) else entry
        except (ValueError, KeyError, TypeError):
            raise TokenizerFileError(f"{path}: bad added_tokens_decoder entry {key!r}: {entry!r}") from None
        if i not in names:
            raise TokenizerFileError(
                f"{path}: added token {name!r} has id {i}, outside the special range "
                f"{num_ranks}..{num_ranks + NUM_RESERVED_SPECIAL_TOKENS - 1} that follows the {num_ranks} ranks"
            )
        names[i] = name
    specials = {name: i for i, name in names.items()}
    if len(specials) != len(names):
        raise TokenizerFileError(f"{path}: two special ids share a name")
    return specials


def _readable_bytes(error: UnicodeDecodeError) -> tuple[str, int]:
    return "".join(f"<0x{b:02X}>" for b in error.object[error.start : error.end]), error.end


codecs.register_error("k2lab.hexbytes", _readable_bytes)

# Safe places to cut a long text: every regex match ends there whatever follows, and no lookahead
# reaches across. That holds after "\n" when a non-space follows, and before " " when a non-space
# precedes (see K2Tokenizer._chunks). "Non-space" is kept to characters no engine calls whitespace.
_SAFE_CUT = re.compile(r"(?<=\n)(?=[!-~\w])|(?<=[!-~\w])(?= )")
_SURROGATE = re.compile("[\ud800-\udfff]")
# Whitespace other than newlines (what both engines call \s: not the separators \x1c-\x1f, which Python's re
# also counts), in a run long enough to make the regex backtrack for long (see K2Tokenizer._chunks).
LONG_WHITESPACE = 4096
_LONG_WHITESPACE_TAIL = re.compile(rf"[^\S\r\n\x1c-\x1f]{{{LONG_WHITESPACE},}}")


class _WholePiece(str):
    """Text known to be one pre-token of Kimi's regex: it skips the regex and goes to the BPE whole."""


def _safe_cuts(text: str) -> list[str]:
    r"""Cut a long text at safe places, so that `tokenizers` encodes it as a fast parallel batch.

    `tokenizers` is several times slower than tiktoken on one huge string. A cut is safe where every
    match of Kimi's regex ends whatever comes after: after "\n" followed by a non-space (no branch runs a
    newline into a non-space), and before " " preceded by a non-space (no branch puts a space after a
    non-space). The only lookahead, `\s+(?!\S)`, cannot end at such a cut: after "\n" the branch
    `\s*[\r\n]+` always wins first, and before " " the last character is not a space.
    """
    if not text:
        return []
    chunks = []
    start = 0
    while len(text) - start > CHUNK_CHARS:
        cut = _SAFE_CUT.search(text, start + CHUNK_CHARS)
        if cut is None:
            break
        chunks.append(text[start : cut.start()])
        start = cut.start()
    chunks.append(text[start:])
    return chunks


def _check_text(text: object, name: str) -> None:
    if not isinstance(text, str):
        hint = "; decode the bytes first (text.decode('utf-8'))" if isinstance(text, (bytes, bytearray)) else ""
        raise TypeError(f"{name} must be a str, got {type(text).__name__}{hint}")


class K2Tokenizer:
    """Encode and decode with a K2-layout tokenizer; `backend` is the underlying `tokenizers.Tokenizer`.

    Special tokens: with `allow_special=True` (K2's own behaviour) a special token's string inside the
    text becomes that special id; with `allow_special=False` it is encoded as ordinary bytes, which is
    what untrusted text (user input, web pages) should get. The default is set at load time and can be
    overridden per call.

    Lone surrogates: text that cannot be UTF-8 encoded is repaired first as tiktoken does it, so the ids
    agree with tiktoken's: surrogate pairs are joined into their character and lone surrogates become
    U+FFFD. (`tokenizers` alone would raise.) decode(encode(s)) == s for every other string.
    """

    def __init__(
        self,
        ranks: dict[bytes, int],
        special_tokens: dict[str, int],
        *,
        bos_token: str,
        eos_token: str,
        allow_special: bool = True,
        name: str = "",
        chat_template: str | None = None,
    ) -> None:
        self.name = name
        self.allow_special = allow_special
        self.chat_template = chat_template  # the checkpoint's own jinja layout; None: the hand-written K2 layout
        self.special_tokens = dict(sorted(special_tokens.items(), key=lambda item: item[1]))
        self.bos_id = self.special_tokens[bos_token]
        self.eos_id = self.special_tokens[eos_token]
        self._token_bytes = [b""] * (len(ranks) + len(special_tokens))
        for token, i in ranks.items():
            self._token_bytes[i] = token
        for special, i in special_tokens.items():
            self._token_bytes[i] = special.encode("utf-8")
        # Specials are found by one regex, longest first, so the leftmost longest match wins as in tokenizers.
        longest_first = sorted(special_tokens, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, longest_first)))
        merges = recover_merges(ranks)
        self.backend = build_backend(ranks, merges, special_tokens)
        # The same BPE without special tokens: encode splits specials off itself and sends plain text here,
        # so that a special token's string is never matched when the policy says it is plain text.
        self._text_backend = build_backend(ranks, merges)

    @property
    def vocab_size(self) -> int:
        """Tokens in the vocabulary: the ranks' plus the special tokens (163,840 for K2)."""
        return len(self._token_bytes)

    def __repr__(self) -> str:
        return f"K2Tokenizer({self.name!r}, vocab_size={self.vocab_size}, allow_special={self.allow_special})"

    # -- encoding ---------------------------------------------------------------------------------------

    def encode(self, text: str, allow_special: bool | None = None) -> list[int]:
        """Token ids of `text` (no BOS is added). `allow_special=None` uses the tokenizer's default."""
        _check_text(text, "text")
        return self.encode_batch([text], allow_special)[0]

    def encode_batch(self, texts: Sequence[str], allow_special: bool | None = None) -> list[list[int]]:
        """Token ids of each text, encoded together in one parallel batch."""
        if isinstance(texts, (str, bytes)) or not isinstance(texts, Iterable):
            raise TypeError(f"texts must be a list of str, got {type(texts).__name__}; for one text use encode(text)")
        texts = list(texts)
        for i, text in enumerate(texts):
            _check_text(text, f"texts[{i}]")
        if allow_special is not None and not isinstance(allow_special, bool):
            raise TypeError(f"allow_special must be True, False or None, got {allow_special!r}")
        allow = self.allow_special if allow_special is None else allow_special
        layouts = [self._layout(text, allow) for text in texts]
        plain = [part for layout in layouts for part in layout if type(part) is str]
        encoded = iter(self._text_backend.encode_batch_fast(plain, add_special_tokens=False))
        batch = []
        for layout in layouts:
            ids: list[int] = []
            for part in layout:
                if isinstance(part, _WholePiece):  # one pre-token, past the regex: BPE alone
                    ids += [t.id for t in self._text_backend.model.tokenize(byte_level(part.encode("utf-8")))]
                elif isinstance(part, str):
                    ids += next(encoded).ids
                else:
                    ids.append(part)
            batch.append(ids)
        return batch

    def encode_padded(self, texts: Sequence[str], padding_side: str = "left", pad_id: int | None = None,
                      allow_special: bool | None = None):
        """A padded batch: ``(ids, attention_mask)``, two long tensors [B, T], T the longest text's length, the
        mask 1 at tokens and 0 at pads. ``padding_side="left"`` (for generation: every row ends at its last token)
        or ``"right"``. Pads are ``pad_id``, by default the ``[PAD]`` special token if the vocabulary has one, else
        EOS; the model never reads them when given the mask."""
        import torch  # only this method needs torch

        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if isinstance(texts, str) or not texts:
            raise ValueError(f"texts must be a non-empty list of strings (one text: encode); got {texts!r:.60}")
        pad = self.special_tokens.get("[PAD]", self.eos_id) if pad_id is None else pad_id
        self._check_ids([pad])
        rows = self.encode_batch(texts, allow_special)
        width = max(len(row) for row in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            cols = slice(width - len(row), width) if padding_side == "left" else slice(0, len(row))
            ids[i, cols] = torch.tensor(row, dtype=torch.long)
            mask[i, cols] = 1
        return ids, mask

    def _layout(self, text: str, allow_special: bool) -> list[str | int]:
        """`text` as plain chunks (str) and special ids (int), in order."""
        text = _repair_surrogates(text)
        if not allow_special:
            return self._chunks(text)
        layout: list[str | int] = []
        start = 0
        for match in self._special_re.finditer(text):
            layout += self._chunks(text[start : match.start()])
            layout.append(self.special_tokens[match.group()])
            start = match.end()
        layout += self._chunks(text[start:])
        return layout

    @staticmethod
    def _chunks(text: str) -> list[str]:
        r"""Cut a text into pieces that encode, one by one, to exactly the ids of the whole.

        A long tail of whitespace without a newline (the end of a whitespace run, followed by a non-space
        or by the end) makes the regex engines backtrack once per character over it: `\s*[\r\n]+` looks
        for a newline that never comes, and past ten million characters `tokenizers` panics (tiktoken
        errors past about a million). Its pre-tokens are known without the regex: a match ends where the
        tail starts (after the run's last newline, or after a non-space), and `\s+(?!\S)` takes the tail
        whole at the end of the text, or all but its last character, which joins what follows. So such a
        tail is cut out as one `_WholePiece` that goes to the BPE directly, and the regex sees the rest.
        """
        chunks: list[str] = []
        start = 0
        for tail in _LONG_WHITESPACE_TAIL.finditer(text):
            end = tail.end()
            if end < len(text) and text[end] in "\r\n":  # not a tail: the run goes on to a newline
                continue
            keep_last = end < len(text)  # the tail's last character joins the next pre-token
            chunks += _safe_cuts(text[start : tail.start()])
            chunks.append(_WholePiece(text[tail.start() : end - keep_last]))
            start = end - keep_last
        return chunks + _safe_cuts(text[start:])

    # -- decoding and inspection ------------------------------------------------------------------------

    def token_bytes(self, i: int) -> bytes:
        """The bytes of one token (a special token's are its name in UTF-8)."""
        i = _id_list([i])[0]
        self._check_ids([i])
        return self._token_bytes[i]

    def id_to_piece(self, i: int) -> str:
        """One token as readable text: bytes that are not whole UTF-8 characters show as <0xNN>."""
        return self.token_bytes(i).decode("utf-8", errors="k2lab.hexbytes")

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`: a list of ints or a 1-D tensor or array; broken UTF-8 becomes U+FFFD."""
        ids = _id_list(ids)
        self._check_ids(ids)
        return b"".join(map(self._token_bytes.__getitem__, ids)).decode("utf-8", errors="replace")

    def _check_ids(self, ids: list[int]) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(
                f"token id {bad} is out of range for a vocabulary of {self.vocab_size} ids (0..{self.vocab_size - 1})"
            )

    def pieces(self, text: str, allow_special: bool | None = None) -> list[Token]:
        """The tokens of `text` with their character spans, for visualisation."""
        _check_text(text, "text")
        text = _repair_surrogates(text)
        char_of_byte = [i for i, ch in enumerate(text) for _ in range(len(ch.encode("utf-8")))]
        char_of_byte.append(len(text))
        tokens = []
        pos = 0
        for i in self.encode(text, allow_special):
            raw = self._token_bytes[i]
            start, end = char_of_byte[pos], char_of_byte[pos + len(raw) - 1] + 1
            tokens.append(Token(i, raw.decode("utf-8", errors="k2lab.hexbytes"), start, end, raw))
            pos += len(raw)
        return tokens

    # -- chat ---------------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        tools: Sequence[dict] | None = None,
        add_generation_prompt: bool = True,
        allow_special: bool | None = None,
    ) -> list[int]:
        """Token ids of a conversation: rendered by the checkpoint's own chat template where the tokenizer folder
        ships one (``chat_template``, see k2lab.tokenizer.template), else in Kimi-K2-Instruct's layout written out
        in k2lab.tokenizer.chat (K2-nano ships no template).

        The layout's own markers always become control tokens. Text inside the messages follows the
        special-token policy: with allow_special=True (the release's behaviour) the result equals
        encode(render_chat(...)); with False, a marker typed inside a message stays plain text. A shipped template
        renders one string, so there a marker inside a message is refused under allow_special=False.
        """
        allow = self.allow_special if allow_special is None else allow_special
        if self.chat_template is not None:
            return encode_with_template(self, messages, tools, add_generation_prompt, allow)
        ids: list[int] = []
        text = ""
        for segment, is_control in chat_segments(messages, tools, add_generation_prompt):
            if is_control:
                if segment not in self.special_tokens:
                    raise ValueError(f"the chat template needs the special token {segment!r}, which {self} lacks")
                ids += self.encode(text, allow) + [self.special_tokens[segment]]
                text = ""
            else:
                text += segment
        return ids + self.encode(text, allow)


def _id_list(ids: object) -> list[int]:
    """Token ids as a list of ints: from a list, a tuple or a 1-D tensor or array (a 2-D one is refused)."""
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"ids must be token ids (a list of int or a 1-D tensor), got a {type(ids).__name__}")
    shape = getattr(ids, "shape", None)
    if shape is not None and len(shape) != 1:
        hint = "; decode one row, e.g. tok.decode(ids[0])" if len(shape) == 2 else ""
        raise ValueError(f"ids must be 1-D token ids, got a tensor of shape {list(shape)}{hint}")
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    for i in ids:
        if isinstance(i, bool) or not hasattr(type(i), "__index__"):  # ints and numpy integers
            raise TypeError(f"token ids must be integers, got {i!r} ({type(i).__name__})")
    return [operator.index(i) for i in ids]


def _repair_surrogates(text: str) -> str:
    """tiktoken's fix-up for text that is not valid UTF-8: join surrogate pairs, lone ones become U+FFFD."""
    if text.isascii() or not _SURROGATE.search(text):
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def read_tokenizer_config(path: Path) -> dict:
    """A release's ``tokenizer_config.json`` as a dict; a file that is not a JSON object is named."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise TokenizerFileError(f"{path}:{error.lineno}: not valid JSON ({error.msg})") from None
    except UnicodeDecodeError as error:
        raise TokenizerFileError(f"{path}: not UTF-8 text (byte {error.start}); expected JSON") from None
    if not isinstance(config, dict):
        raise TokenizerFileError(f"{path}: expected a JSON object, got a {type(config).__name__}")
    return config


def token_content(value: object) -> object:
    """A special token named in a tokenizer config, written as its string or as an AddedToken object."""
    return value["content"] if isinstance(value, dict) else value
