"""A checkpoint's own chat template (jinja), rendered as HF transformers renders it.

Releases ship their conversation layout as a jinja template: ``chat_template.jinja`` beside the tokenizer (K2-Thinking,
later K2 revisions) or a ``chat_template`` string in ``tokenizer_config.json`` (DeepSeek). Rendering it, rather than
re-writing each layout by hand, keeps every family member's turns exact: K2-Thinking's ``<think>...</think>`` (earlier
assistant turns emptied to ``<think></think>``), its tool-call sections, DeepSeek's ``<｜User｜>`` turns.

The environment matches HF's ``apply_chat_template``: a sandbox (templates come from the Hub and are untrusted),
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension (``{% break %}``), a ``tojson`` that does not
escape HTML and keeps non-ASCII text, ``raise_exception`` and ``strftime_now``. The sandbox caps each ``range`` at
100,000 steps, but not a template's total work: nested loops, or a string multiplied by a huge number, could still run
for hours or fill memory. So one rendering may run at most ``MAX_TEMPLATE_STEPS`` steps of Python (counted by a trace
function while it renders: a real layout takes tens of thousands) and build no string or list longer than
``MAX_TEMPLATE_ITEMS`` by ``*``; past either it stops with the reason. (Under a debugger or a coverage tool, which hold
the trace function themselves, the step count is left to them.)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

TEMPLATE_FILE = "chat_template.jinja"
# A rendering's budget: steps of Python in all (K2-Thinking's template takes about 17,000 for 40 messages), and the
# longest string or list ``*`` may make (``"=" * 80``: fine; ``"x" * 10**10``: no).
MAX_TEMPLATE_STEPS = 2_000_000
MAX_TEMPLATE_ITEMS = 1_000_000


class TemplateTooCostly(ValueError):
    """A chat template that would do more work than any real layout needs (see the module docstring)."""


def _counting(budget: list[int]):
    """A trace function that counts the steps of the frames it sees against ``budget`` and stops the rendering past
    it."""
    def trace(frame, event, arg):
        budget[0] -= 1
        if budget[0] < 0:
            raise TemplateTooCostly(f"the chat template ran more than {MAX_TEMPLATE_STEPS:,} steps in one rendering "
                                    f"(nested loops?); k2lab stops it there")
        return trace
    return trace


def find_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The chat template a tokenizer folder ships: ``chat_template.jinja`` first (it supersedes the config's copy,
    as in HF), else ``tokenizer_config.json``'s ``chat_template`` (a string, or HF's list of named templates, of
    which the "default" one is used); None when there is none."""
    file = folder / TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


@lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: tuple | None = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Budgeted(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            size = (len(left) * right if isinstance(left, str | list | tuple) and isinstance(right, int)
                    else len(right) * left if isinstance(right, str | list | tuple) and isinstance(left, int)
                    else None)
            if size is not None and size > MAX_TEMPLATE_ITEMS:
                raise TemplateTooCostly(f"the chat template multiplies a sequence to {size:,} items, more than "
                                        f"{MAX_TEMPLATE_ITEMS:,}; k2lab stops it there")
            if operator == "**" and isinstance(right, int | float) and abs(right) > 1_000:
                raise TemplateTooCostly(f"the chat template raises to the power {right}; k2lab stops it there")
            return super().call_binop(context, operator, left, right)

    env = Budgeted(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


def render_template(template: str, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                    add_generation_prompt: bool = True, **variables: Any) -> str:
    """The conversation rendered by ``template``. ``variables`` reach the template as globals: the special tokens
    (``bos_token``, ``eos_token``) and switches some templates read (K2.5's ``thinking``, DeepSeek-V3.1's
    ``thinking``)."""
    messages = json.loads(json.dumps(list(messages)))  # plain data: the template cannot reach the caller's objects
    tools = json.loads(json.dumps(list(tools))) if tools else None
    compiled = _compile(template)
    counted = sys.gettrace() is None  # a debugger's or coverage tool's trace function stays in charge
    if counted:
        sys.settrace(_counting([MAX_TEMPLATE_STEPS]))
    try:
        return compiled.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                               **variables)
    finally:
        if counted:
            sys.settrace(None)


def sorted_deep(value: Any) -> Any:
    """``value`` with every dict's keys sorted, at every depth: what Kimi's tokenizer does to tool declarations
    before its template renders them."""
    if isinstance(value, dict):
        return {k: sorted_deep(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [sorted_deep(v) for v in value]
    return value


def encode_with_template(tokenizer: Any, messages: Sequence[dict], tools: Sequence[dict] | None,
                         add_generation_prompt: bool, allow_special: bool) -> list[int]:
    """Token ids of the conversation as ``tokenizer.chat_template`` lays it out, special tokens read as such (what
    HF's apply_chat_template does). The rendered string no longer tells the template's markers from the messages'
    text, so under ``allow_special=False`` a special token's string inside the messages is refused rather than
    encoded either way."""
    if not allow_special:
        typed = tokenizer._special_re.search(json.dumps([list(messages), list(tools or [])], ensure_ascii=False))
        if typed is not None:
            raise ValueError(f"a message holds the special token {typed.group()!r}; with allow_special=False and a "
                             "shipped chat template k2lab cannot keep it plain text: remove it, or render the "
                             "template (render_template) and encode the parts yourself")
    if tools and getattr(tokenizer, "_sort_tool_keys", True):
        tools = sorted_deep(list(tools))
    names = {v: k for k, v in tokenizer.special_tokens.items()}
    text = render_template(tokenizer.chat_template, messages, tools, add_generation_prompt,
                           bos_token=names.get(tokenizer.bos_id, ""), eos_token=names.get(tokenizer.eos_id, ""))
    return tokenizer.encode(text, allow_special=True)
