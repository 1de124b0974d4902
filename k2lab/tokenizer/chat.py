"""Kimi-K2-Instruct's chat template, written out in plain Python (no jinja at run time).

The released template lays a conversation out as turns, each `<|im_X|>role<|im_middle|>content<|im_end|>`:

    <|im_system|>tool_declare<|im_middle|>[tools as JSON]<|im_end|>        only when tools are given
    <|im_system|>system<|im_middle|>You are Kimi, ...<|im_end|>            when no system message leads
    <|im_user|>user<|im_middle|>Hi<|im_end|>
    <|im_assistant|>assistant<|im_middle|>text<|tool_calls_section_begin|>
        <|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"x": 1}<|tool_call_end|>
        <|tool_calls_section_end|><|im_end|>
    <|im_system|>f<|im_middle|>## Return of functions.f:0\n(result)<|im_end|>
    <|im_assistant|>assistant<|im_middle|>                                  the generation prompt

There are no newlines between the pieces above; they are broken here to be read. A message's `name`,
when set, replaces its role in the header. User turns use `<|im_user|>`, assistant turns
`<|im_assistant|>`, every other role (system, tool) `<|im_system|>`. JSON is written as the template's
`tojson` does (`json.dumps` with `ensure_ascii=False`), and tool declarations have their keys sorted
at every depth, as the release's tokenizer does before rendering.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"
TOOL_CALLS_BEGIN = "<|tool_calls_section_begin|>"
TOOL_CALLS_END = "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN = "<|tool_call_begin|>"
TOOL_CALL_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
TOOL_CALL_END = "<|tool_call_end|>"


def chat_segments(
    messages: Sequence[dict], tools: Sequence[dict] | None = None, add_generation_prompt: bool = True
) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is_control) pieces; control pieces are special-token strings.

    Keeping the template's markers apart from the messages' text lets a tokenizer encode the markers
    as control tokens while treating the text under its own special-token policy.
    """
    _check_messages(messages, tools)
    out: list[tuple[str, bool]] = []

    def turn(marker: str, role: str) -> None:
        out.extend([(marker, True), (role, False), (IM_MIDDLE, True)])

    if tools:
        turn(IM_SYSTEM, "tool_declare")
        out.extend([(json.dumps(tools, ensure_ascii=False, sort_keys=True), False), (IM_END, True)])
    if messages and messages[0]["role"] != "system":
        turn(IM_SYSTEM, "system")
        out.extend([(DEFAULT_SYSTEM_PROMPT, False), (IM_END, True)])
    for message in messages:
        role = message["role"]
        marker = {"user": IM_USER, "assistant": IM_ASSISTANT}.get(role, IM_SYSTEM)
        turn(marker, message.get("name") or role)
        if role == "assistant" and message.get("tool_calls"):
            if message.get("content"):
                out.append((_content_text(message["content"]), False))
            out.append((TOOL_CALLS_BEGIN, True))
            for call in message["tool_calls"]:
                arguments = call["function"]["arguments"]
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                out.extend([(TOOL_CALL_BEGIN, True), (call["id"], False), (TOOL_CALL_ARGUMENT_BEGIN, True)])
                out.extend([(arguments, False), (TOOL_CALL_END, True)])
            out.append((TOOL_CALLS_END, True))
        elif role == "tool":
            out.append((f"## Return of {message['tool_call_id']}\n{_content_text(message.get('content'))}", False))
        elif message.get("content") is not None:
            out.append((_content_text(message["content"]), False))
        out.append((IM_END, True))
    if add_generation_prompt:
        turn(IM_ASSISTANT, "assistant")
    return [(text, is_control) for text, is_control in out if text]


def render_chat(
    messages: Sequence[dict], tools: Sequence[dict] | None = None, add_generation_prompt: bool = True
) -> str:
    """The conversation as one string, exactly as Kimi-K2-Instruct's chat template renders it.

    messages: dicts with "role" and "content" (a string, None, or a list of {"type": "text", "text": ...}
    parts), optionally "name"; assistant messages may carry OpenAI-style "tool_calls" (each with "id"
    and "function": {"name", "arguments"}), tool messages a "tool_call_id". tools: OpenAI-style function
    declarations.
    """
    return "".join(text for text, _ in chat_segments(messages, tools, add_generation_prompt))


def _check_messages(messages: Sequence[dict], tools: Sequence[dict] | None) -> None:
    """Each message a dict with a string "role" and content the template can render; the error names the message."""
    if isinstance(messages, (str, dict)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts with 'role' and 'content', got {type(messages).__name__}")
    if tools is not None and (isinstance(tools, (str, dict)) or not isinstance(tools, Sequence)
                              or not all(isinstance(t, dict) for t in tools)):
        raise TypeError(f"tools must be None or a list of function declarations (dicts), got {tools!r:.80}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] needs a 'role' (a str such as 'user'), got {message.get('role')!r}")
        content = message.get("content")
        if not (content is None or isinstance(content, str) or isinstance(content, list) and all(
                isinstance(part, dict) for part in content)):
            raise TypeError(f"messages[{i}]['content'] must be a str, None or a list of parts, got {content!r:.80}")
        if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise ValueError(f"messages[{i}] is a tool result and needs a 'tool_call_id' (a str)")
        for j, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") if isinstance(call, dict) else None
            if not (isinstance(function, dict) and isinstance(call.get("id"), str) and "arguments" in function):
                raise ValueError(f"messages[{i}]['tool_calls'][{j}] needs an 'id' and a 'function' with 'arguments', "
                                 f"got {call!r:.80}")


def _content_text(content: str | list | None) -> str:
    """A message's content as text: a string as is, text parts joined. K2-Instruct reads no images."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise ValueError(f"Kimi-K2-Instruct's template renders text parts only, got a {part.get('type')!r} part")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"a text part needs a 'text' string, got {part!r:.80}")
        texts.append(part["text"])
    return "".join(texts)
