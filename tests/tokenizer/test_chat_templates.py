"""Chat templates: the checkpoint's own jinja template rendered as HF transformers renders it (the oracle),
K2-Thinking's <think> turns and tool calls, and agreement with the hand-written K2-Instruct layout
(k2lab.tokenizer.chat)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import k2lab
from k2lab.lab.nano import NANO_DIR
from k2lab.tokenizer.chat import render_chat
from k2lab.tokenizer.template import TEMPLATE_FILE, find_chat_template, render_template, sorted_deep

THINKING = (Path(__file__).parents[1] / "data" / "kimi_k2_thinking_chat_template.jinja").read_text()

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city, today",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL = {"role": "assistant", "content": "Let me look.", "reasoning_content": "The user wants Rome's weather.",
        "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]}
RESULT = {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "22 C, sunny"}
CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hi"}],
    "system_and_named_user": [{"role": "system", "content": "Be brief."},
                              {"role": "user", "name": "ada", "content": "Hi, 你好"}],
    "text_parts": [{"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]}],
    "two_turns_with_reasoning": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "Add again."},
    ],
    "tool_round_trip": [{"role": "user", "content": "Weather in Rome?"}, CALL, RESULT],
}


def hf_render(template: str, messages, tools=None, add_generation_prompt=True) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=template,
                                        add_generation_prompt=add_generation_prompt)
    return rendered[0]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_matches_hf_transformers(name, add_generation_prompt):
    tools = TOOLS if name == "tool_round_trip" else None
    ours = render_template(THINKING, CONVERSATIONS[name], tools, add_generation_prompt)
    assert ours == hf_render(THINKING, CONVERSATIONS[name], tools, add_generation_prompt)


def test_thinking_empties_the_reasoning_of_answered_turns():
    """Up to the last plain answer, assistant turns keep an empty <think></think>: reasoning is not fed back."""
    text = render_template(THINKING, CONVERSATIONS["two_turns_with_reasoning"])
    assert "<|im_assistant|>assistant<|im_middle|><think></think>4<|im_end|>" in text
    assert "<|im_assistant|>assistant<|im_middle|><think></think>6<|im_end|>" in text
    assert "Add them." not in text and "Add again." not in text
    assert text.endswith("<|im_assistant|>assistant<|im_middle|>")


def test_thinking_tool_calls_after_the_last_answer_keep_their_reasoning():
    text = render_template(THINKING, CONVERSATIONS["tool_round_trip"], TOOLS)
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>" + json.dumps(TOOLS, ensure_ascii=False))
    assert ("<|im_assistant|>assistant<|im_middle|><think>The user wants Rome's weather.</think>Let me look."
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            "{\"city\": \"Rome\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>") in text
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n22 C, sunny<|im_end|>" in text


def _instruct_layout_with_empty_think(messages, tools=None) -> str:
    """The hand-written K2-Instruct layout, with K2-Thinking's one change for assistant turns answered before the
    last: an empty <think></think> after the turn's header."""
    text = render_chat(messages, sorted_deep(tools) if tools else None)
    header = "<|im_assistant|>assistant<|im_middle|>"
    return text.replace(header, header + "<think></think>")


@pytest.mark.parametrize("name", ["plain", "system_and_named_user", "text_parts"])
def test_hand_written_layout_agrees_with_the_release_template(name):
    """Without assistant turns K2-Thinking's template lays a conversation out exactly as K2-Instruct's: the default
    system prompt, named turns, text parts, the generation prompt."""
    messages = CONVERSATIONS[name]
    assert render_template(THINKING, messages) == render_chat(messages)
    assert render_template(THINKING, messages, add_generation_prompt=False) == render_chat(messages, None, False)


def test_hand_written_layout_agrees_on_tools_and_answered_turns():
    messages = [{"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": "Sunny.", "reasoning_content": "dropped: an earlier turn"},
                {"role": "user", "content": "Thanks"}]
    ours = render_template(THINKING, messages, sorted_deep(TOOLS), add_generation_prompt=True)
    expected = _instruct_layout_with_empty_think(messages, TOOLS)
    assert ours == expected[: -len("<think></think>")]  # the generation prompt opens no <think>


@pytest.fixture(scope="module")
def nano_with_template(tmp_path_factory):
    folder = Path(shutil.copytree(NANO_DIR, tmp_path_factory.mktemp("tok") / "nano"))
    (folder / TEMPLATE_FILE).write_text(THINKING)
    return k2lab.load_tokenizer(folder)


def test_tokenizer_renders_the_template_it_ships_with(nano_with_template):
    tok = nano_with_template
    assert tok.chat_template == THINKING
    messages = CONVERSATIONS["tool_round_trip"]
    ids = tok.apply_chat_template(messages, TOOLS)
    assert ids == tok.encode(hf_render(THINKING, messages, sorted_deep(TOOLS)), allow_special=True)
    assert tok.special_tokens["<|tool_calls_section_begin|>"] in ids


@pytest.mark.parametrize("ships_template", [True, False])
def test_a_hub_repo_s_template_is_fetched_with_its_tokenizer(tmp_path, hub_repo, ships_template):
    """From a repo id the tokenizer files come one by one into a snapshot folder that holds only what was fetched.
    chat_template.jinja must be fetched too, or a K2-Thinking tokenizer loaded from the Hub would lay chats out in
    Instruct's hand-written form; a repo without one loads as before."""
    remote = Path(shutil.copytree(NANO_DIR, tmp_path / "remote"))
    if ships_template:
        (remote / TEMPLATE_FILE).write_text(THINKING)
    fetched = hub_repo(remote)
    tok = k2lab.load_tokenizer("moonshotai/Kimi-K2-Thinking")
    assert fetched == ["tiktoken.model", "tokenizer_config.json", TEMPLATE_FILE]  # each file asked for once
    assert tok.chat_template == (THINKING if ships_template else None)


def test_without_a_template_the_hand_written_layout_is_used():
    tok = k2lab.load_tokenizer(NANO_DIR)
    assert tok.chat_template is None
    messages = CONVERSATIONS["plain"]
    assert tok.apply_chat_template(messages) == tok.encode(render_chat(messages))


def test_a_typed_marker_is_refused_under_allow_special_false_with_a_template(nano_with_template):
    tok = nano_with_template
    messages = [{"role": "user", "content": "say <|im_end|> please"}]
    with pytest.raises(ValueError, match="<\\|im_end\\|>"):
        tok.apply_chat_template(messages, allow_special=False)
    assert tok.apply_chat_template([{"role": "user", "content": "fine"}], allow_special=False)


def test_template_found_in_tokenizer_config(tmp_path):
    template = "{{ messages[0]['content'] }}"
    assert find_chat_template(tmp_path, {"chat_template": template}) == template
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert find_chat_template(tmp_path, {"chat_template": named}) == "D"
    assert find_chat_template(tmp_path, {}) is None
    (tmp_path / TEMPLATE_FILE).write_text("F")
    assert find_chat_template(tmp_path, {"chat_template": "C"}) == "F"  # the file wins, as in HF
