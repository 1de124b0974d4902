"""The site's home page (docs/index.md): its five-line code sample runs as printed, offline, on the bundled K2-nano,
and does what its comments say; its install commands are README's; its figure is committed."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
HOME = (REPO / "docs" / "index.md").read_text()


def _block(language: str) -> str:
    found = re.findall(rf"^```{language}\n(.*?)^```$", HOME, flags=re.M | re.S)
    assert len(found) == 1, f"docs/index.md should hold one {language} block, found {len(found)}"
    return found[0]


def test_the_code_sample_runs_and_does_what_it_says():
    code = _block("python")
    assert len(code.strip().splitlines()) == 5
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/index.md", "exec"), namespace)  # noqa: S102 - the page's own sample
    model, cache = namespace["model"], namespace["cache"]
    text = printed.getvalue()
    assert text.startswith("def area(radius):") and len(text.split("def area(radius):", 1)[1].strip()) > 0
    idx = cache["topk_idx", 5]  # "layer 5's chosen experts [B, T, k]"
    prompt_tokens = len(model.tokenizer.encode("def area(radius):"))
    assert idx.shape == (1, prompt_tokens, model.config.num_experts_per_tok)
    assert idx.dtype == torch.long and 0 <= int(idx.min()) and int(idx.max()) < model.config.n_routed_experts
    assert namespace["logits"].shape == (1, prompt_tokens, model.config.vocab_size)


def test_the_install_commands_are_readmes_and_the_figure_is_there():
    readme = (REPO / "README.md").read_text()
    for command in _block("bash").strip().splitlines():
        assert command.strip() in readme, f"the home page's {command!r} is not among README's commands"
    figure = re.search(r"\]\((assets/home/[^)]+\.png)\)", HOME)
    assert figure and (REPO / "docs" / figure.group(1)).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
