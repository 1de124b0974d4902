"""Hostile inputs to training: bad TrainConfig values are refused before the corpus is encoded; the command never
writes into the bundled K2-nano unless asked, checks its output folder before training, and keeps what an
interrupted run did."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
import torch

import k2lab.training.train as train_module
from k2lab import K2Config, K2Model
from k2lab.lab.nano import NANO_DIR
from k2lab.tokenizer import load_tokenizer
from k2lab.training.train import TrainConfig, train, train_config_from

BAD_FIELDS = [("lr", -1.0), ("lr", 0.0), ("lr", float("nan")), ("steps", -5), ("steps", 0), ("steps", 2.5),
              ("test_suite_share", 2.0), ("test_suite_share", -0.1), ("seq_len", 0), ("eval_every", 0),
              ("batch_size", 0), ("batch_size", True), ("warmup", -1), ("decay_fraction", 1.5),
              ("weight_decay", float("inf")), ("qk_clip_tau", 0.0), ("bias_step", -1e-3), ("threads", 0),
              ("compile", "yes"), ("embed_lr_scale", -1.0), ("head_lr_scale", float("nan")), ("seed", -1)]


@pytest.mark.parametrize("field, value", BAD_FIELDS)
def test_a_bad_train_config_field_is_named(field, value):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{field} must be .*, got {value!r}"):
        TrainConfig(**{field: value})


@pytest.mark.parametrize("pair, named", [("lr=-1", r"TrainConfig\.lr must be a finite number > 0, got -1.0"),
                                         ("steps=-5", r"TrainConfig\.steps must be an integer >= 1, got -5"),
                                         ("test_suite_share=2.0", r"TrainConfig\.test_suite_share must be a number"),
                                         ("eval_every=0", r"TrainConfig\.eval_every must be an integer >= 1"),
                                         ("lr=nan", r"TrainConfig\.lr must be a finite number > 0, got nan")])
def test_a_bad_override_is_refused_by_value(pair, named):
    with pytest.raises(ValueError, match=named):
        train_config_from([pair])


def test_overrides_must_be_a_list_of_strings():
    with pytest.raises(TypeError, match="pairs must be a list of 'key=value' strings, got 'steps=3'"):
        train_config_from("steps=3")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(NANO_DIR)


def test_train_refuses_a_bad_config_before_encoding_the_corpus(tokenizer, monkeypatch):
    def encoded(*args, **kwargs):
        raise AssertionError("the corpus was encoded")
    monkeypatch.setattr(train_module, "token_stream", encoded)
    monkeypatch.setattr(train_module, "encode_documents", encoded)
    tc = TrainConfig()
    tc.batch_size = 0  # set after construction, as a notebook might
    with pytest.raises(ValueError, match=r"TrainConfig\.batch_size must be an integer >= 1, got 0"):
        train(K2Config.nano(32), tc, tokenizer)
    with pytest.raises(TypeError, match="cfg must be a K2Config, got dict"):
        train({"hidden_size": 32}, TrainConfig(), tokenizer)


def small_corpus(monkeypatch, tokens: int = 4000):
    """The corpus replaced by a short random stream, so that a run takes a few steps of a tiny model."""
    stream = torch.randint(0, 7936, (tokens,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    monkeypatch.setattr(train_module, "token_stream", lambda *args, **kwargs: stream)
    monkeypatch.setattr(train_module, "encode_documents", lambda *args, **kwargs: torch.zeros(0, dtype=torch.int32))


TINY_RUN = dict(steps=4, batch_size=2, seq_len=16, warmup=1, eval_every=2, threads=1)


def test_an_interrupted_run_saves_its_last_evaluation_and_its_log(tokenizer, monkeypatch):
    small_corpus(monkeypatch)
    step = train_module.recipe_step
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(*args, **kwargs)
    monkeypatch.setattr(train_module, "recipe_step", interrupted)
    saved = []
    with pytest.raises(KeyboardInterrupt):
        train(K2Config.nano(32), TrainConfig(**TINY_RUN), tokenizer,
              save=lambda model, log: saved.append((model, json.loads(json.dumps(log)))))
    (model, log_at_eval), (none, log_at_stop) = saved
    assert isinstance(model, K2Model) and none is None
    assert [e["step"] for e in log_at_eval["evals"]] == [1] and len(log_at_eval["steps"]) == 2
    assert log_at_stop["stopped_early"] is True and len(log_at_stop["steps"]) == 2


def test_a_seq_len_longer_than_the_corpus_is_named(tokenizer, monkeypatch):
    small_corpus(monkeypatch, tokens=100)
    with pytest.raises(ValueError, match=r"TrainConfig\.seq_len=256 is too long for the corpus"):
        train(K2Config.nano(32), TrainConfig(steps=2, threads=1), tokenizer)


def test_every_row_from_the_test_suite_runs(tokenizer, monkeypatch):
    small_corpus(monkeypatch)
    stream = train_module.token_stream()
    monkeypatch.setattr(train_module, "encode_documents", lambda *args, **kwargs: stream)
    _, log = train(K2Config.nano(32), TrainConfig(**{**TINY_RUN, "steps": 1, "test_suite_share": 1.0}), tokenizer)
    assert log["test_suite_rows"] == 2 and len(log["steps"]) == 1


# -- the command ---------------------------------------------------------------------------------------------


def digest(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def command(monkeypatch, tmp_path):
    """Runs ``python -m k2lab.training ARGS`` in tmp_path with a fake run (a tiny model, saved once) in place of
    training; returns whether the run started."""
    monkeypatch.chdir(tmp_path)
    started = []

    def fake_train(cfg, tc, tokenizer, save=None):
        started.append(True)
        model = K2Model(K2Config.nano(32))
        model.init_weights(seed=0)
        log = {"evals": [{"step": 0, "heldout_code_bpb": 9.0}], "unigram_heldout_code_bpb": 9.9, "seconds": 1.0}
        save(model, log)
        return model, log
    monkeypatch.setattr(train_module, "train", fake_train)

    def run(*args: str) -> bool:
        started.clear()
        monkeypatch.setattr(sys, "argv", ["k2lab.training", *args])
        train_module.main()
        return bool(started)
    return run


def test_the_command_never_writes_the_bundle_by_default(command, tmp_path):
    bundle = digest(NANO_DIR)
    assert command("--set", "steps=1")
    assert digest(NANO_DIR) == bundle
    out = tmp_path / "runs" / "nano"
    assert {"config.json", "model-1-of-1.safetensors", "training_log.json", "tiktoken.model"} <= set(digest(out))
    load_tokenizer(out)  # the run's folder carries its tokenizer


@pytest.mark.parametrize("make, args, named", [
    (lambda t: (t / "out").mkdir() or (t / "out" / "notes.txt").write_text("mine"), ["--out", "out"],
     "--out out already holds files; pass --overwrite"),
    (lambda t: None, ["--out", str(NANO_DIR)], "(the bundled K2-nano) already holds files; pass --overwrite"),
    (lambda t: (t / "file").write_text("x"), ["--out", "file"], "--out file is a file, not a folder"),
    (lambda t: (t / "file").write_text("x"), ["--out", "file/run"], "--out file/run: cannot write the run there"),
    (lambda t: None, ["--set", "steps=0"], "TrainConfig.steps must be an integer >= 1, got 0"),
])
def test_the_command_refuses_an_output_before_training(command, tmp_path, capsys, make, args, named):
    make(tmp_path)
    before = digest(NANO_DIR), {p.name for p in tmp_path.rglob("*")}
    with pytest.raises(SystemExit) as exit_info:
        command(*args)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err  # argparse's message, the argument named
    assert (digest(NANO_DIR), {p.name for p in tmp_path.rglob("*")}) == before


def test_overwrite_replaces_the_checkpoint_and_keeps_other_files(command, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    assert command("--out", "out", "--overwrite")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    assert json.loads((tmp_path / "out" / "training_log.json").read_text())["seconds"] == 1.0
