"""DeepSeek-style tokenizer.json releases: load_tokenizer reads them with `tokenizers` directly; ids against the file's
own Tokenizer and HF transformers' PreTrainedTokenizerFast (chat template included)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import k2lab
from k2lab.tokenizer.ranks import TokenizerFileError
from k2lab.tokenizer.template import TEMPLATE_FILE
from k2lab.tokenizer.tokenizer_json import JsonTokenizer

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
# A DeepSeek-like layout, written for this test: BOS, the system text, then User / Assistant turns.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
CORPUS = ["def add(a, b):\n    return a + b\n", "Hello world, hello tokens!", "深度求索 DeepSeek 你好",
          "émoji 🙂 ok"] * 20
TEXTS = ["Hello world", "  spaces\n\nand lines\t", "深度求索", "🙂🙂 émoji", f"{BOS}a{USER}b", ""]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[BOS, EOS, USER, ASSISTANT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": {"content": BOS, "special": True}, "eos_token": EOS, "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return folder


@pytest.fixture(scope="module")
def tok(folder):
    return k2lab.load_tokenizer(folder)


def test_loads_as_a_tokenizer_json_release(tok, folder):
    assert isinstance(tok, JsonTokenizer)
    own = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.vocab_size == own.get_vocab_size(with_added_tokens=True)
    assert (tok.bos_id, tok.eos_id) == (own.token_to_id(BOS), own.token_to_id(EOS))
    assert tok.chat_template == TEMPLATE


@pytest.mark.parametrize("text", TEXTS)
def test_ids_are_the_files_own(tok, folder, text):
    own = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode(text)
    assert ids == own.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == own.decode(ids, skip_special_tokens=False) == text
    assert b"".join(p.raw for p in tok.pieces(text)) == text.encode()


def test_special_strings_stay_text_when_not_allowed(tok):
    ids = tok.encode(f"{BOS}hi{EOS}", allow_special=False)
    assert not set(ids) & set(tok.special_tokens.values())
    assert tok.decode(ids) == f"{BOS}hi{EOS}"
    assert tok.encode(f"{BOS}hi", allow_special=True)[0] == tok.bos_id


def test_chat_template_ids_match_hf_transformers(tok, folder):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token=BOS, eos_token=EOS)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "add(1, 2)?"}]
    want = hf.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    ids = tok.apply_chat_template(messages)
    assert ids == list(want)
    assert ids[0] == tok.bos_id and ids[-1] == tok.special_tokens[ASSISTANT]


def test_a_tokenizer_json_that_is_not_byte_level_is_refused(tmp_path):
    tok = Tokenizer(models.BPE())
    tok.decoder = decoders.Metaspace()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerFileError, match="byte-level"):
        k2lab.load_tokenizer(tmp_path)


def test_a_hub_repo_s_template_is_fetched_with_its_tokenizer_json(folder, tmp_path, hub_repo):
    """A tokenizer.json release from a repo id: its chat_template.jinja comes along (see test_chat_templates)."""
    remote = Path(shutil.copytree(folder, tmp_path / "remote"))
    (remote / TEMPLATE_FILE).write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    fetched = hub_repo(remote)
    tok = k2lab.load_tokenizer("deepseek-ai/DeepSeek-V3")
    assert isinstance(tok, JsonTokenizer)
    assert tok.chat_template == (remote / TEMPLATE_FILE).read_text()
    # the rank file is asked for once, to tell the layouts apart; every file once
    assert fetched == ["tiktoken.model", "tokenizer.json", "tokenizer_config.json", TEMPLATE_FILE]


def test_a_hub_repo_without_a_config_loads_as_a_folder_without_one_does(folder, tmp_path, hub_repo):
    """Beside tokenizer.json the config is optional, from the Hub as from a folder: no BOS or EOS is named then (K2's
    layout needs its config: test_tokenizer)."""
    remote = Path(shutil.copytree(folder, tmp_path / "remote"))
    (remote / "tokenizer_config.json").unlink()
    hub_repo(remote)
    from_hub, from_folder = k2lab.load_tokenizer("deepseek-ai/DeepSeek-V3"), k2lab.load_tokenizer(remote)
    assert from_hub.bos_id is None and from_folder.bos_id is None
    assert from_hub.encode("Hello world") == from_folder.encode("Hello world")
