"""K2's tokenizer (tiktoken ranks read into HF ``tokenizers`` with Kimi's pre-tokenizer) and its chat layout."""

from .chat import render_chat
from .ranks import TokenizerFileError, load_ranks, rank_bpe, recover_merges
from .release import load_tokenizer
from .tokenizer import KIMI_PATTERN, K2Tokenizer, Token

__all__ = [
    "KIMI_PATTERN", "K2Tokenizer", "Token", "TokenizerFileError", "load_ranks", "load_tokenizer", "rank_bpe",
    "recover_merges", "render_chat",
]
