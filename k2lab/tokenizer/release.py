"""Finding and loading a tokenizer release: a local folder or a Hub repo, in K2's layout (tiktoken.model +
tokenizer_config.json: ``tokenizer.K2Tokenizer``) or DeepSeek's (tokenizer.json: ``tokenizer_json``)."""

from __future__ import annotations

import os
from pathlib import Path

from .ranks import TokenizerFileError, load_ranks
from .template import TEMPLATE_FILE, find_chat_template
from .tokenizer import (
    CONFIG_FILE,
    RANKS_FILE,
    TOKENIZER_JSON,
    K2Tokenizer,
    read_tokenizer_config,
    special_tokens_from_config,
    token_content,
)
from .tokenizer_json import load_tokenizer_json


def _fetch_chat_template(repo_id: str, revision: str | None) -> None:
    """Bring a Hub repo's ``chat_template.jinja`` into the cache beside its tokenizer files, where
    ``find_chat_template`` looks: K2-Thinking and later K2 revisions ship their chat layout only there. A repo
    without one leaves nothing (``k2lab.hub.fetch_file``), and so does a cache without one while offline: the template
    is optional, so the tokenizer loads as it did before, from what is cached."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    from ..hub import fetch_file

    try:
        fetch_file(repo_id, TEMPLATE_FILE, revision)
    except LocalEntryNotFoundError:
        pass


def release_layout(folder: Path) -> str | None:
    """The file that holds a local tokenizer release's vocabulary: RANKS_FILE for K2's layout (with CONFIG_FILE
    beside it), TOKENIZER_JSON for DeepSeek's (a folder without a rank file); None for a folder holding neither."""
    if (folder / RANKS_FILE).is_file():
        return RANKS_FILE if (folder / CONFIG_FILE).is_file() else None
    return TOKENIZER_JSON if (folder / TOKENIZER_JSON).is_file() else None


def find_release(path_or_repo_id: str | Path, revision: str | None) -> tuple[Path, str]:
    """(folder, the file holding the vocabulary: ``release_layout``'s answer) of a tokenizer release: a local
    directory, or else a Hub repo through its cache (HF_HUB_OFFLINE). From the Hub each file is asked for once: the
    rank file, or where the repo has none ``tokenizer.json``, then the config (optional beside ``tokenizer.json``, as
    in a folder) and the chat template where the repo ships one."""
    local = Path(path_or_repo_id).expanduser()
    if local.is_dir():
        layout = release_layout(local)
        if layout is None:
            missing = next(name for name in (RANKS_FILE, CONFIG_FILE) if not (local / name).is_file())
            raise FileNotFoundError(f"{local / missing}: missing (a K2 tokenizer directory holds {RANKS_FILE} and "
                                    f"{CONFIG_FILE}; a DeepSeek one {TOKENIZER_JSON})")
        return local, layout
    from huggingface_hub import hf_hub_download

    from ..hub import fetch_file

    repo = str(path_or_repo_id)

    def unavailable(name: str, error: Exception) -> FileNotFoundError:
        return FileNotFoundError(f"{name}: {repo!r} is not a local directory and the file could not be had from the "
                                 f"Hugging Face Hub or its cache ({type(error).__name__}: {error})")

    try:
        folder, layout = Path(hf_hub_download(repo, RANKS_FILE, revision=revision)).parent, RANKS_FILE
    except Exception as error:  # invalid id, offline without a cached copy, no such file, no network
        try:  # no rank file: a tokenizer.json release, if there is one
            folder, layout = Path(hf_hub_download(repo, TOKENIZER_JSON, revision=revision)).parent, TOKENIZER_JSON
        except Exception:
            raise unavailable(RANKS_FILE, error) from error
    try:
        config = fetch_file(repo, CONFIG_FILE, revision)  # None: the repo has none
    except Exception as error:
        raise unavailable(CONFIG_FILE, error) from error
    if config is None and layout == RANKS_FILE:
        raise FileNotFoundError(f"{CONFIG_FILE}: Hub repo {repo!r} has {RANKS_FILE} but not this file")
    _fetch_chat_template(repo, revision)
    return folder, layout


def load_tokenizer(
    path_or_repo_id: str | Path, *, revision: str | None = None, allow_special: bool = True
) -> K2Tokenizer:
    """Load a tokenizer in K2's release layout (tiktoken.model + tokenizer_config.json), or a ``tokenizer.json``
    release (DeepSeek-V3/R1/V3.1/V2), read with `tokenizers` directly (k2lab.tokenizer.tokenizer_json). The chat
    template the folder ships, if any, lays out ``apply_chat_template``.

    `path_or_repo_id` is a local directory or a Hub repo id (e.g. "moonshotai/Kimi-K2-Instruct"); for a
    repo only the release's files (and ``chat_template.jinja`` where the repo ships one) are fetched, each once,
    through the Hub cache (``find_release``), so HF_HUB_OFFLINE=1 works once they are cached. `allow_special` sets
    the default special-token policy of encode (see K2Tokenizer).
    """
    if not isinstance(path_or_repo_id, (str, os.PathLike)) or not str(path_or_repo_id):
        raise TypeError(f"path_or_repo_id must be a folder or a Hub repo id, got {path_or_repo_id!r}")
    if not isinstance(allow_special, bool):
        raise TypeError(f"allow_special must be True or False, got {allow_special!r}")
    folder, layout = find_release(path_or_repo_id, revision)
    if layout == TOKENIZER_JSON:
        return load_tokenizer_json(folder, allow_special=allow_special, name=str(path_or_repo_id))
    ranks_path, config_path = folder / RANKS_FILE, folder / CONFIG_FILE
    config = read_tokenizer_config(config_path)
    ranks = load_ranks(ranks_path)
    specials = special_tokens_from_config(config, len(ranks), config_path)
    names = {}
    for role, default in (("bos_token", "[BOS]"), ("eos_token", "[EOS]")):
        names[role] = token_content(config.get(role) or default)
        if names[role] not in specials:
            raise TokenizerFileError(f"{config_path}: {role} {names[role]!r} is not one of the special tokens")
    return K2Tokenizer(ranks, specials, allow_special=allow_special, name=str(path_or_repo_id),
                       chat_template=find_chat_template(config_path.parent, config), **names)
