"""Hostile inputs to the tokenizer: pathological whitespace encodes as tiktoken does; bad arguments and bad files
raise errors that name them."""

import re

import pytest
import tiktoken
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiktoken.load import load_tiktoken_bpe

import k2lab.tokenizer.tokenizer as tokenizer_module
from k2lab.lab import NANO_DIR
from k2lab.tokenizer import load_tokenizer
from k2lab.tokenizer.ranks import TokenizerFileError
from k2lab.tokenizer.tokenizer import KIMI_PATTERN


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(NANO_DIR)


@pytest.fixture(scope="module")
def ref(tok):
    ranks = load_tiktoken_bpe(str(NANO_DIR / "tiktoken.model"))
    return tiktoken.Encoding("ref", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=tok.special_tokens)


WHITESPACE_TEXTS = [
    " " * 200_000,
    "x" + " " * 200_000 + "y",
    "x" + "\t" * 200_000 + "y",
    "def f():\n" + " \t" * 60_000 + "\n" + "  " * 30_000 + "return 1",
    "a." + "\n\n" + " " * 50_000 + "!" + "\u3000 " * 30_000 + "\x1c" + " " * 9_000 + "1",
    "end with spaces" + " " * 70_000,
    "\n" + " " * 40_000 + "\r\n" + "\t" * 40_000,
]


@pytest.mark.parametrize("threshold", [4096, 3])
@pytest.mark.parametrize("text", WHITESPACE_TEXTS, ids=range(len(WHITESPACE_TEXTS)))
def test_long_whitespace_runs_encode_as_tiktoken_does(tok, ref, text, threshold, monkeypatch):
    """Long whitespace tails skip the regex; at the default threshold and at a tiny one (every run), ids equal
    tiktoken's."""
    monkeypatch.setattr(tokenizer_module, "_LONG_WHITESPACE_TAIL",
                        re.compile(rf"[^\S\r\n\x1c-\x1f]{{{threshold},}}"))
    assert tok.encode(text) == ref.encode(text, disallowed_special=())
    assert tok.decode(tok.encode(text)) == text


WHITESPACE_MIX = st.lists(st.sampled_from([" ", " ", "\t", "\n", "\r", "a", "B", "1", ".", "\u3000", "\x1c", "中",
                                            "\x85", "\u2028", "\x0b", "\xa0", "'s", "<|im_end|>"]), max_size=40)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=WHITESPACE_MIX)
def test_every_whitespace_tail_cut_out_still_matches_tiktoken(tok, ref, parts, monkeypatch):
    """With the threshold at 1 every whitespace tail skips the regex: mixed whitespace (Unicode spaces, the
    separators Python calls whitespace and the engines do not, CR, LF) beside words, digits, punctuation and
    special tokens still gives tiktoken's ids."""
    monkeypatch.setattr(tokenizer_module, "_LONG_WHITESPACE_TAIL", re.compile(r"[^\S\r\n\x1c-\x1f]{1,}"))
    text = "".join(parts)
    assert tok.encode(text, allow_special=True) == ref.encode(text, allowed_special="all")
    assert tok.encode(text, allow_special=False) == ref.encode(text, disallowed_special=())


def test_ten_million_spaces_and_tabs_encode_without_a_panic(tok):
    """`tokenizers` panicked (retry-limit-in-match) past ten million; tiktoken itself errors past a million, so
    the ids are checked by decoding, and against the tokens of a short run (a run of spaces is one pre-token)."""
    for ch in (" ", "\t"):
        ids = tok.encode(ch * 10_000_000)
        assert tok.decode(ids) == ch * 10_000_000


@pytest.mark.parametrize("text, error, named", [
    (None, TypeError, "text must be a str, got NoneType"),
    (b"bytes", TypeError, r"text must be a str, got bytes; decode the bytes first"),
    (12, TypeError, "text must be a str, got int"),
])
def test_encode_names_a_bad_text(tok, text, error, named):
    with pytest.raises(error, match=named):
        tok.encode(text)


def test_encode_batch_refuses_one_string_and_names_the_bad_item(tok):
    with pytest.raises(TypeError, match=r"texts must be a list of str, got str; for one text use encode"):
        tok.encode_batch("hello")
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str, got NoneType"):
        tok.encode_batch(["a", None])
    with pytest.raises(TypeError, match="allow_special must be True, False or None, got 'yes'"):
        tok.encode("a", allow_special="yes")


@pytest.mark.parametrize("ids, error, named", [
    ([1.5], TypeError, r"token ids must be integers, got 1.5 \(float\)"),
    ([1, "2"], TypeError, r"token ids must be integers, got '2'"),
    ([True], TypeError, "token ids must be integers, got True"),
    ("abc", TypeError, "ids must be token ids"),
    (torch.tensor([[1, 2, 3]]), ValueError, r"shape \[1, 3\]; decode one row, e.g. tok.decode\(ids\[0\]\)"),
    (torch.tensor([1.0, 2.0]), TypeError, "token ids must be integers, got 1.0"),
    ([10**9], ValueError, "token id 1000000000 is out of range"),
])
def test_decode_names_bad_ids(tok, ids, error, named):
    with pytest.raises(error, match=named):
        tok.decode(ids)


def test_decode_takes_a_1d_tensor_from_generate(tok):
    ids = tok.encode("Hello, K2!")
    assert tok.decode(torch.tensor(ids)) == "Hello, K2!"
    assert tok.decode(torch.tensor([ids])[0]) == "Hello, K2!"


@pytest.mark.parametrize("messages, error, named", [
    ([{"content": "hi"}], ValueError, r"messages\[0\] needs a 'role'"),
    ([{"role": "user", "content": "a"}, {"role": None}], ValueError, r"messages\[1\] needs a 'role'.*None"),
    (["hi"], TypeError, r"messages\[0\] must be a dict"),
    ("hi", TypeError, "messages must be a list of dicts"),
    ([{"role": "user", "content": 5}], TypeError, r"messages\[0\]\['content'\] must be a str, None or a list"),
    ([{"role": "user", "content": [{"type": "text"}]}], ValueError, "a text part needs a 'text' string"),
    ([{"role": "tool", "content": "42"}], ValueError, r"messages\[0\] is a tool result and needs a 'tool_call_id'"),
    ([{"role": "assistant", "tool_calls": ["f"]}], ValueError,
     r"messages\[0\]\['tool_calls'\]\[0\] needs an 'id' and a 'function' with 'arguments'"),
    ([{"role": "assistant", "tool_calls": [{"id": "f:0", "function": {"name": "f"}}]}], ValueError,
     r"\['tool_calls'\]\[0\] needs an 'id' and a 'function' with 'arguments'"),
])
def test_chat_names_a_bad_message(tok, messages, error, named):
    with pytest.raises(error, match=named):
        tok.apply_chat_template(messages)


@pytest.mark.parametrize("tools", ["search", {"name": "f"}, ["f"]])
def test_chat_names_bad_tools(tok, tools):
    with pytest.raises(TypeError, match="tools must be None or a list of function declarations"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools)


@pytest.mark.parametrize("content, named", [
    (b"\x80\x81\xff\x00binary", r"tiktoken.model: not a tiktoken rank file \(byte 0 is not UTF-8"),
    (b"not base64 at all\n", r"tiktoken.model:1: expected '<base64 token> <rank>'"),
    (b"", "tiktoken.model: no ranks in the file"),
])
def test_a_binary_or_corrupt_rank_file_is_named(tmp_path, content, named):
    (tmp_path / "tiktoken.model").write_bytes(content)
    (tmp_path / "tokenizer_config.json").write_bytes((NANO_DIR / "tokenizer_config.json").read_bytes())
    with pytest.raises(TokenizerFileError, match=named):
        load_tokenizer(tmp_path)


def test_a_binary_config_file_is_named(tmp_path):
    (tmp_path / "tiktoken.model").write_bytes((NANO_DIR / "tiktoken.model").read_bytes())
    (tmp_path / "tokenizer_config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TokenizerFileError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)


def test_load_tokenizer_names_a_bad_argument():
    with pytest.raises(TypeError, match="path_or_repo_id must be a folder or a Hub repo id, got None"):
        load_tokenizer(None)
    with pytest.raises(TypeError, match="allow_special must be True or False, got 'no'"):
        load_tokenizer(NANO_DIR, allow_special="no")
