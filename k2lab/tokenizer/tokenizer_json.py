"""Tokenizers shipped as HF ``tokenizer.json`` (DeepSeek-V3 / R1 / V3.1 / V2), read with `tokenizers` directly.

Kimi ships tiktoken ranks (see tokenizer.py); DeepSeek ships the finished `tokenizers` model: byte-level BPE with its
own pre-tokenizer, merges and added tokens. k2lab reads it as is, so the ids are the release's by construction, and
wraps it in the same interface as K2's tokenizer (encode with a special-token policy, decode, pieces, the chat
template the folder ships).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Tokenizer

from .ranks import TokenizerFileError, bytes_to_unicode
from .template import find_chat_template
from .tokenizer import CONFIG_FILE, TOKENIZER_JSON, K2Tokenizer, read_tokenizer_config, token_content

_FROM_BYTE_LEVEL = {char: byte for byte, char in bytes_to_unicode().items()}


class JsonTokenizer(K2Tokenizer):
    """A ``tokenizer.json`` tokenizer with K2Tokenizer's interface; ``backend`` is the release's own Tokenizer.

    Special tokens are the added tokens marked special; with ``allow_special=False`` their strings in a text are
    encoded as ordinary text (``encode_special_tokens``), as K2's policy does. Texts are not cut into chunks: the
    safe places to cut are a property of Kimi's pre-tokenizer, not of this one."""

    _sort_tool_keys = False  # DeepSeek's tokenizer hands tools to its template as given

    def __init__(self, backend: Tokenizer, *, bos_token: str | None, eos_token: str | None,
                 allow_special: bool = True, name: str = "", chat_template: str | None = None) -> None:
        self.name = name
        self.allow_special = allow_special
        self.chat_template = chat_template
        self.backend = backend
        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self.special_tokens = {token.content: i for i, token in sorted(added.items()) if token.special}
        for role, token in (("bos_token", bos_token), ("eos_token", eos_token)):
            if token is not None and token not in self.special_tokens:
                raise TokenizerFileError(f"{name}: {role} {token!r} is not one of the special tokens")
        self.bos_id = self.special_tokens[bos_token] if bos_token is not None else None
        self.eos_id = self.special_tokens[eos_token] if eos_token is not None else None
        self._token_bytes = [b""] * backend.get_vocab_size(with_added_tokens=True)
        for piece, i in backend.get_vocab(with_added_tokens=True).items():
            in_byte_level = i not in added and all(c in _FROM_BYTE_LEVEL for c in piece)
            self._token_bytes[i] = bytes(_FROM_BYTE_LEVEL[c] for c in piece) if in_byte_level else piece.encode()
        longest_first = sorted(self.special_tokens, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, longest_first)) or r"(?!)")
        # The same model reading special tokens' strings as text: encode splits specials off itself.
        self._text_backend = Tokenizer.from_str(backend.to_str())
        self._text_backend.encode_special_tokens = True

    @staticmethod
    def _chunks(text: str) -> list[str]:
        return [text] if text else []


def load_tokenizer_json(folder: Path, *, allow_special: bool = True, name: str = "") -> JsonTokenizer:
    """A folder holding ``tokenizer.json`` (and usually ``tokenizer_config.json`` naming BOS, EOS and the chat
    template)."""
    try:
        backend = Tokenizer.from_file(str(folder / TOKENIZER_JSON))
    except Exception as error:  # tokenizers raises a plain Exception for a malformed file
        raise TokenizerFileError(f"{folder / TOKENIZER_JSON}: not a tokenizers file ({error})") from None
    decoder = (json.loads(backend.to_str()).get("decoder") or {}).get("type")
    if decoder != "ByteLevel":
        raise TokenizerFileError(f"{folder / TOKENIZER_JSON}: decoder {decoder!r}; k2lab reads byte-level BPE "
                                 "tokenizers (DeepSeek's), whose tokens are bytes")
    config = read_tokenizer_config(folder / CONFIG_FILE) if (folder / CONFIG_FILE).is_file() else {}
    return JsonTokenizer(backend, bos_token=token_content(config.get("bos_token")),
                         eos_token=token_content(config.get("eos_token")), allow_special=allow_special,
                         name=name or str(folder), chat_template=find_chat_template(folder, config))
