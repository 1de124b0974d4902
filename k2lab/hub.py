"""The Hugging Face Hub, as k2lab reaches it: one file of a repo through the standard cache (``HF_HUB_CACHE`` /
``HF_HOME``), so that a second read takes the cached copy and ``HF_HUB_OFFLINE=1`` requests nothing. Checkpoints
(``k2lab.weights.download``: only the shards a slice needs) and tokenizers (``k2lab.tokenizer``) both fetch through
here.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_repo_id(name: str) -> bool:
    """``moonshotai/Kimi-K2-Instruct`` is; ``./ckpt``, ``/data/k2`` and ``a/b/c`` are not."""
    return bool(_REPO_ID.fullmatch(name)) and not name.startswith(".")


def fetch_file(repo_id: str, filename: str, revision: str | None = None) -> Path | None:
    """One file of a repo through the cache; None when the repo (at that revision) has no such file. Offline without
    a cached copy, huggingface_hub's LocalEntryNotFoundError propagates: whether the repo has the file is unknown."""
    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision))
    except LocalEntryNotFoundError:
        raise
    except EntryNotFoundError:  # the Hub answered: no such file
        return None


__all__ = ["fetch_file", "is_repo_id"]
