"""The K2 tokenizer: tiktoken parity, special-token policy, chat template, Hub loading and errors."""

import base64
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tiktoken.load import load_tiktoken_bpe

import k2lab.tokenizer.tokenizer as tokenizer_module
from k2lab.lab import NANO_DIR
from k2lab.tokenizer import load_tokenizer
from k2lab.tokenizer.chat import render_chat
from k2lab.tokenizer.ranks import TokenizerFileError, recover_merges
from k2lab.tokenizer.tokenizer import KIMI_PATTERN, special_tokens_from_config
from k2lab.training.corpus import documents

SAMPLES = [
    "",
    "Hello, world! It's K2's tokenizer; they'll see. DON'T SHOUT, McDonald's HTTPServer.",
    'def f(x: int) -> int:\n    """Double x."""\n    return x * 2  # comment\n\n\nclass A(B):\n\tpass\n',
    "for (int i = 0; i < n; ++i) { a[i] = b[i] << 2; }  // C++\r\n#include <stdio.h>\r\n",
    "中文English混合，北京市 Pascal。人工智能是计算机科学的一个分支。",
    "日本語のテキストとカタカナ、ひらがな。東京タワー",
    "한국어 텍스트입니다. 안녕하세요!",
    "emoji 😀👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 flags 🇯🇵🇫🇷 keycap 1️⃣",
    "café naïve résumé Ångström ﬁ ﬂ ﬀ Œuvre straße ǅ ᾧ e\u0301 a\u0308\u0323",
    "spaces:    four, eight        end   \n   \n\n\n    indented\t\ttabs\t \t mixed",
    "CRLF\r\nline\r\n\r\nbare CR\rcarriage\r\r\n",
    "numbers 12345678901234567890 3.14159265358979 1,000,000 0x7fff ٣٤٥ ⅫⅢ ²³",
    "a" * 300 + " " + "ab" * 200 + "=" * 120 + "\n" * 50 + " " * 70 + "😀" * 40,
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी, ไทย",
    "nbsp\u00a0here ideographic\u3000space zero\u200bwidth\x00null\x1bescape\x7fdel",
    "math ∑∫√∞ ≤≥ arrows → ⇒ box ┌─┐ quotes “ ” ‘ ’ « »",
]


def tiktoken_encoding(path: Path, tok) -> tiktoken.Encoding:
    """tiktoken on the same rank file, read by tiktoken's own loader: the reference implementation."""
    ranks = load_tiktoken_bpe(str(path / "tiktoken.model"))
    return tiktoken.Encoding("ref", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=tok.special_tokens)


@pytest.fixture(scope="module")
def nano():
    return load_tokenizer(NANO_DIR)


@pytest.fixture(scope="module")
def nano_ref(nano):
    return tiktoken_encoding(NANO_DIR, nano)


def train_tiny_ranks(text: str, num_merges: int) -> dict[bytes, int]:
    """A deliberately small, independent byte-level BPE trainer: ranks are the order merges were learned."""
    words = Counter(tuple(bytes([b]) for b in word.encode()) for word in text.replace("\n", " \n").split(" ") if word)
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(num_merges):
        pairs = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        ranks.setdefault(a + b, len(ranks))
        merged = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if word[i : i + 2] == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return ranks


def write_release(path: Path, ranks: dict[bytes, int], added: dict[int, str]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda x: x[1])]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    config = {"added_tokens_decoder": {str(i): {"content": name} for i, name in added.items()}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


# -- parity with tiktoken ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_nano_matches_tiktoken(nano, nano_ref, text):
    assert nano.encode(text) == nano_ref.encode(text, allowed_special="all")
    assert nano.decode(nano.encode(text)) == text


def test_nano_matches_tiktoken_on_heldout_corpus(nano, nano_ref):
    docs = [doc.text for doc in documents("heldout")]
    assert nano.encode_batch(docs) == nano_ref.encode_batch(docs, allowed_special="all")


def test_synthetic_ranks_match_tiktoken(tmp_path):
    text = "\n".join(SAMPLES) * 3 + open(tokenizer_module.__file__, encoding="utf-8").read()
    ranks = train_tiny_ranks(text, num_merges=400)
    path = write_release(tmp_path / "tiny", ranks, {len(ranks): "[BOS]", len(ranks) + 1: "[EOS]"})
    tok = load_tokenizer(path)
    ref = tiktoken_encoding(path, tok)
    assert tok.vocab_size == len(ranks) + 256 and tok.bos_id == len(ranks)
    for sample in [*SAMPLES, text]:
        assert tok.encode(sample) == ref.encode(sample, allowed_special="all")


def test_merges_follow_rank_bpe_not_length_or_id(tmp_path):
    # "abc" is built from "a"+"bc" because "bc" outranks "ab"; a merge list ordered by length or id
    # would pair "ab"+"c" and then fail to build "abc" inside "abcd".
    ranks = {bytes([b]): b for b in range(256)} | {b"bc": 256, b"ab": 257, b"abc": 258}
    assert recover_merges(ranks)[-1] == (b"a", b"bc")
    path = write_release(tmp_path / "abc", ranks, {259: "[BOS]", 260: "[EOS]"})
    tok = load_tokenizer(path)
    ref = tiktoken_encoding(path, tok)
    for text in ["abc", "abcd", "xabcabcab", "ab abc bcab"]:
        assert tok.encode(text) == ref.encode(text)
    assert tok.encode("abcd") == [258, ord("d")]


def test_long_texts_are_cut_safely(nano, nano_ref, monkeypatch):
    # With tiny chunks every safe cut is taken, so a wrong cut rule shows up at once.
    monkeypatch.setattr(tokenizer_module, "CHUNK_CHARS", 3)
    for text in SAMPLES:
        assert nano.encode(text) == nano_ref.encode(text, allowed_special="all")


@settings(max_examples=300, deadline=None, database=None)
@given(st.text(st.characters(exclude_categories=("Cs",)), max_size=200))
def test_roundtrip_and_parity_on_any_text(nano, nano_ref, text):
    ids = nano.encode(text, allow_special=False)
    assert nano.decode(ids) == text
    assert ids == nano_ref.encode_ordinary(text)


@settings(max_examples=200, deadline=None, database=None)
@given(st.text(st.sampled_from(list(" \t\n\r\u00a0\u3000ab'sZ9_.,(中😀é")), max_size=120))
def test_cutting_never_changes_ids(nano, nano_ref, text):
    saved = tokenizer_module.CHUNK_CHARS
    tokenizer_module.CHUNK_CHARS = 2  # hypothesis runs many examples per test, so no monkeypatch here
    try:
        assert nano.encode(text, allow_special=False) == nano_ref.encode_ordinary(text)
    finally:
        tokenizer_module.CHUNK_CHARS = saved


def test_lone_surrogates_become_replacement_characters_like_tiktoken(nano, nano_ref):
    assert nano.encode("a\ud800b") == nano.encode("a\ufffdb") == nano_ref.encode("a\ud800b")
    assert nano.encode("\ud83d\ude00") == nano.encode("😀")  # a surrogate pair is joined first
    assert nano.decode(nano.encode("x\udfffy")) == "x\ufffdy"


# -- vocabulary and special tokens ------------------------------------------------------------------------


def test_nano_layout(nano):
    assert nano.vocab_size == 8192 == nano.backend.get_vocab_size()
    assert (nano.bos_id, nano.eos_id) == (7936, 7937)
    assert len(nano.special_tokens) == 256 and min(nano.special_tokens.values()) == 7936
    assert nano.special_tokens["<|im_end|>"] == 7938 and nano.special_tokens["<|im_middle|>"] == 7953
    assert nano.special_tokens["<|reserved_token_7941|>"] == 7941
    assert [nano.token_bytes(i) for i in (0, 65, 255)] == [b"\x00", b"A", b"\xff"]


def test_k2_special_ids_follow_the_ranks():
    added = {"163584": {"content": "[BOS]"}, "163585": {"content": "[EOS]"}, "163601": {"content": "<|im_middle|>"}}
    specials = special_tokens_from_config({"added_tokens_decoder": added}, 163_584, "tokenizer_config.json")
    assert len(specials) == 256 and max(specials.values()) == 163_839
    assert (specials["[BOS]"], specials["[EOS]"], specials["<|im_middle|>"]) == (163_584, 163_585, 163_601)
    assert specials["<|reserved_token_163600|>"] == 163_600


def test_special_tokens_under_both_policies(nano, nano_ref):
    text = "[BOS]Hi<|im_end|> and <|reserved_token_8000|>"
    allowed = nano.encode(text)
    assert allowed[0] == nano.bos_id and nano.special_tokens["<|im_end|>"] in allowed and 8000 in allowed
    assert allowed == nano_ref.encode(text, allowed_special="all")
    plain = nano.encode(text, allow_special=False)
    assert plain == nano_ref.encode_ordinary(text) and max(plain) < 7936
    assert nano.decode(allowed) == nano.decode(plain) == text
    untrusted = load_tokenizer(NANO_DIR, allow_special=False)
    assert untrusted.encode(text) == plain and untrusted.encode(text, allow_special=True) == allowed
    assert nano.backend.encode("<|im_end|>").ids == [7938]


def test_pieces_carry_offsets_and_readable_partial_bytes(nano):
    text = "héllo 世界 <|im_end|>"
    pieces = nano.pieces(text)
    assert [p.id for p in pieces] == nano.encode(text)
    assert b"".join(p.raw for p in pieces) == text.encode()
    assert pieces[-1].text == "<|im_end|>" and (pieces[-1].start, pieces[-1].end) == (len(text) - 10, len(text))
    for p in pieces:
        assert p.text == text[p.start : p.end] or p.text.startswith("<0x")
    partial = [p for p in pieces if p.text.startswith("<0x")]
    assert partial and all(p.end - p.start == 1 for p in partial)
    assert nano.id_to_piece(0xE4) == "<0xE4>" and nano.id_to_piece(nano.eos_id) == "[EOS]"


# -- chat template ------------------------------------------------------------------------------------------

DEFAULT_SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"


def test_chat_default_system_and_generation_prompt():
    rendered = render_chat([{"role": "user", "content": "Hi"}])
    assert rendered == DEFAULT_SYSTEM + "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    assert render_chat([]) == "<|im_assistant|>assistant<|im_middle|>"


def test_chat_multi_turn_with_system_and_names():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?", "name": "ada"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "3+3?"}]},
    ]
    assert render_chat(messages, add_generation_prompt=False) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>ada<|im_middle|>2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>4<|im_end|>"
        "<|im_user|>user<|im_middle|>And 3+3?<|im_end|>"
    )


def test_chat_tools_tool_calls_and_results():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                "description": "Weather of a city",
            },
        }
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "functions.get_weather:1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "Sunny"},
    ]
    assert render_chat(messages, tools) == (
        "<|im_system|>tool_declare<|im_middle|>"
        '[{"function": {"description": "Weather of a city", "name": "get_weather", "parameters": '
        '{"properties": {"city": {"type": "string"}}, "type": "object"}}, "type": "function"}]<|im_end|>'
        + DEFAULT_SYSTEM
        + "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Checking.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Zürich"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\nSunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )


def test_chat_rejects_image_parts():
    with pytest.raises(ValueError, match="text parts"):
        render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_apply_chat_template_ids(nano):
    messages = [{"role": "user", "content": "Say <|im_end|> please"}]
    ids = nano.apply_chat_template(messages)
    assert ids == nano.encode(render_chat(messages))  # the release's behaviour: markers in text are live
    im_end = nano.special_tokens["<|im_end|>"]
    assert ids.count(im_end) == 3 and ids[-1] == nano.special_tokens["<|im_middle|>"]
    safe = nano.apply_chat_template(messages, allow_special=False)
    assert safe.count(im_end) == 2 and nano.decode(safe) == nano.decode(ids)


# -- loading from the Hub cache ------------------------------------------------------------------------------


def test_loads_a_repo_id_from_the_hub_cache_offline(tmp_path, nano):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--k2lab--nano"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(NANO_DIR / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    # huggingface_hub reads these at import, so the load runs in a fresh interpreter. The endpoint is a
    # closed local port: should offline mode be ignored, the test fails instead of reaching the network.
    env = os.environ | {
        "HF_HOME": str(tmp_path / "home"),
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "1",
        "HF_ENDPOINT": "http://127.0.0.1:9",
    }
    script = (
        "import json; from k2lab.tokenizer import load_tokenizer\n"
        "out = {'main': load_tokenizer('k2lab/nano').encode('Hello, K2!'),\n"
        f"       'pinned': load_tokenizer('k2lab/nano', revision='{commit}').vocab_size}}\n"
        "try:\n    load_tokenizer('k2lab/not-cached')\n"
        "except FileNotFoundError as e:\n    out['missing'] = str(e)\n"
        "print(json.dumps(out))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["main"] == nano.encode("Hello, K2!") and out["pinned"] == 8192
    assert "tiktoken.model" in out["missing"] and "k2lab/not-cached" in out["missing"]


# -- errors ----------------------------------------------------------------------------------------------------


def copy_nano(tmp_path: Path) -> Path:
    path = tmp_path / "tok"
    shutil.copytree(NANO_DIR, path)
    return path


def test_malformed_rank_line_names_file_and_line(tmp_path):
    path = copy_nano(tmp_path)
    lines = (path / "tiktoken.model").read_text().splitlines()
    for bad in ["QUJD", "QUJD x", "not*base64 300", "QUJD 1 2"]:
        (path / "tiktoken.model").write_text("\n".join([*lines[:2], bad, *lines[3:]]) + "\n")
        with pytest.raises(TokenizerFileError, match=r"tiktoken\.model:3: expected '<base64 token> <rank>'"):
            load_tokenizer(path)


def test_duplicate_rank_names_file_line_and_rank(tmp_path):
    path = copy_nano(tmp_path)
    lines = (path / "tiktoken.model").read_text().splitlines()
    lines[5] = base64.b64encode(b"zzqq!").decode() + " 1"
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    with pytest.raises(TokenizerFileError, match=r"tiktoken\.model:6: duplicate rank 1 \(first given on line 2\)"):
        load_tokenizer(path)


def test_missing_rank_and_bad_added_token_are_named(tmp_path):
    path = copy_nano(tmp_path)
    lines = (path / "tiktoken.model").read_text().splitlines()
    (path / "tiktoken.model").write_text("\n".join(lines[:100] + lines[101:]) + "\n")
    with pytest.raises(TokenizerFileError, match="rank 100 is missing"):
        load_tokenizer(path)
    path = copy_nano(tmp_path / "again")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["42"] = {"content": "<|oops|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerFileError, match=r"tokenizer_config\.json: added token '<\|oops\|>' has id 42"):
        load_tokenizer(path)


def test_missing_file_is_named(tmp_path):
    path = copy_nano(tmp_path)
    (path / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"tokenizer_config\.json: missing"):
        load_tokenizer(path)
    (path / "tiktoken.model").unlink()  # neither layout's files: the rank file is named first
    with pytest.raises(FileNotFoundError, match=r"tiktoken\.model: missing"):
        load_tokenizer(path)


def test_a_hub_repo_with_ranks_but_no_config_is_named(tmp_path, hub_repo):
    path = copy_nano(tmp_path)
    (path / "tokenizer_config.json").unlink()
    hub_repo(path)
    with pytest.raises(FileNotFoundError, match=r"tokenizer_config\.json: Hub repo 'moonshotai/Kimi-K2' has tiktoken"):
        load_tokenizer("moonshotai/Kimi-K2")


def test_decode_rejects_ids_out_of_range(nano):
    with pytest.raises(ValueError, match=r"token id 9000 is out of range for a vocabulary of 8192 ids"):
        nano.decode([1, 2, 9000])
    with pytest.raises(ValueError, match=r"token id -1 is out of range"):
        nano.decode([-1])
