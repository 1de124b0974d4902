"""Fetching a checkpoint from the Hugging Face Hub: only the files a load needs.

K2's release is about 1 TB in 61 shards. A slice (``num_layers=4``) needs a handful of them, so we first fetch
config.json and the shard index (small), work out which shards hold the slice's tensors, and hand exactly those names to
``snapshot_download`` as ``allow_patterns``, with the tokenizer files (``k2lab.hub`` fetches the small ones). Everything
goes through the standard cache (``HF_HUB_CACHE`` / ``HF_HOME``): a second load reads the cached copy, and with
``HF_HUB_OFFLINE=1`` nothing is requested and the cache alone is used.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from huggingface_hub import snapshot_download
from tqdm.auto import tqdm

from ..config import K2Config
from ..hub import fetch_file
from .reader import INDEX_FILE, SINGLE_FILE, CheckpointError, read_weight_map
from .schema import checkpoint_tensors

# Small files fetched with any slice: what k2lab.load_tokenizer reads (K2 ships a tiktoken rank file) and the
# generation defaults. The repository's Python files are never fetched: k2lab runs no remote code.
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
# A stored format's companions of tensor ``X.weight`` are named ``X.weight_<part>`` (FP8's ``weight_scale_inv``;
# INT4's ``weight_packed``, ``weight_scale``, ``weight_shape``): the tensor an index entry belongs to.
_COMPANION = re.compile(r"(.*\.weight)_\w+")


def allow_patterns(cfg: K2Config, weight_map: Mapping[str, str] | None, source: str = INDEX_FILE) -> list[str]:
    """The files a load of ``cfg`` (already sliced to its blocks) needs: config, index, tokenizer files and the
    shards holding its tensors as stored, in whatever format (a matrix's FP8 scales or INT4 packing included).
    ``weight_map`` None: a single-file checkpoint."""
    patterns = ["config.json", *TOKENIZER_FILES]
    if weight_map is None:
        return patterns + [SINGLE_FILE]
    shards_of: dict[str, set[str]] = {}  # tensor -> the shards holding it or its companions
    for name, shard in weight_map.items():
        companion = _COMPANION.fullmatch(name)
        shards_of.setdefault(companion[1] if companion else name, set()).add(shard)
    shards = set()
    for spec in checkpoint_tensors(cfg):
        if spec.name not in shards_of:
            raise CheckpointError(f"tensor {spec.name} is not in {source}")
        shards |= shards_of[spec.name]
    return patterns + [INDEX_FILE, *sorted(shards)]


def download(repo_id: str, cfg: K2Config, revision: str | None = None, progress: bool | None = None) -> Path:
    """The local snapshot folder holding what a load of ``cfg`` needs from ``repo_id``; fetched if not cached.
    ``progress=False`` silences the download bars (default: huggingface_hub's own setting)."""
    index = fetch_file(repo_id, INDEX_FILE, revision)
    weight_map = read_weight_map(index) if index is not None else None
    patterns = allow_patterns(cfg, weight_map, f"{repo_id}/{INDEX_FILE}")
    quiet = {"tqdm_class": _Silent} if progress is False else {}
    return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, **quiet))


class _Silent(tqdm):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "disable": True})
