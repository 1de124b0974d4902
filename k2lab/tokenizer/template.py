"""A checkpoint's own chat template (jinja), rendered as HF transformers renders it.

Releases ship their conversation layout as a jinja template: ``chat_template.jinja`` beside the tokenizer (K2-Thinking,
later K2 revisions) or a ``chat_template`` string in ``tokenizer_config.json`` (DeepSeek). Rendering it, rather than
re-writing each layout by hand, keeps every family member's turns exact: K2-Thinking's ``<think>...</think>`` (earlier
assistant turns emptied to ``<think></think>``), its tool-call sections, DeepSeek's ``<｜User｜>`` turns.

The environment matches HF's ``apply_chat_template``: a sandbox (templates come from the Hub and are untrusted),
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension (``{% break %}``), a ``tojson`` that does not
escape HTML and keeps non-ASCII text, ``raise_exception`` and ``strftime_now``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

TEMPLATE_FILE = "chat_template.jinja"


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

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
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
    return _compile(template).render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     **variables)


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
