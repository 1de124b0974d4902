"""A griffe extension for the API pages (mkdocs.yml names it): docstring lines that start with ``>>>`` (and their
``...`` continuations) become a fenced ``pycon`` block, so Markdown shows a session, not nested block quotes."""

from __future__ import annotations

import re

import griffe

PROMPT = re.compile(r"^(\s*)(>>>|\.\.\.)( |$)")


def fence_doctests(text: str) -> str:
    out, block, indent = [], [], ""
    for line in text.split("\n") + [""]:
        m = PROMPT.match(line)
        if m and (block or m.group(2) == ">>>"):
            if not block:
                indent = m.group(1)
            block.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            continue
        if block:
            out += ["", f"{indent}```pycon", *[indent + b for b in block], f"{indent}```", ""]
            block = []
        out.append(line)
    return "\n".join(out[:-1])


class DoctestBlocks(griffe.Extension):
    def on_instance(self, *, node, obj, agent, **kwargs) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
