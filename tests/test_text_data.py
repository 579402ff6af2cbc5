"""``data=text``: the user's .txt and .jsonl files, tokenised once with a Hugging Face tokenizer and cached."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from disttrain.config import validate
from disttrain.data import TextConfig, build_datamodule
from disttrain.data.token_cache import META_FILE, TOKENS_FILE, _build, ensure_token_cache, load_tokenizer
from disttrain.errors import ConfigError
from disttrain.launch.job import train
from tests.test_run import step_losses

EOS = "<|endoftext|>"


def topic_texts() -> list[str]:
    """Python's documentation topics, sorted by key: real English and code, shipped with Python."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def make_tokenizer(folder: Path, vocab_size: int = 300, end_of_text: bool = True) -> Path:
    """A byte-level BPE tokenizer trained on a few KB of documentation, saved as ``folder/tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS] if end_of_text else [],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(topic_texts()[:20], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def write_corpus(folder: Path) -> tuple[list[Path], list[str]]:
    """Two .txt files and one .jsonl file of documentation topics; the paths and the documents, in order."""
    texts = topic_texts()[20:60]
    folder.mkdir(parents=True, exist_ok=True)
    first, second, lines = folder / "a.txt", folder / "b.txt", folder / "c.jsonl"
    first.write_text("\n\n".join(texts[:10]), encoding="utf-8")
    second.write_text("\n\n".join(texts[10:20]), encoding="utf-8")
    with open(lines, "w", encoding="utf-8") as handle:
        for number, text in enumerate(texts[20:]):
            handle.write(json.dumps({"id": number, "text": text}) + "\n")
    return [first, lines, second], ["\n\n".join(texts[:10]), *texts[20:], "\n\n".join(texts[10:20])]


def text_config(files: list[Path], tokenizer: Path, **options) -> TextConfig:
    """The typed config of ``data=text`` for these files."""
    return TextConfig(files=[str(path) for path in files], tokenizer=str(tokenizer), **options)


@pytest.mark.parametrize("end_of_text", [True, False], ids=["eos", "no-eos"])
def test_the_windows_cover_the_tokenised_files_each_token_once(tmp_path, end_of_text):
    """The cached stream is the documents' ids (the tokenizer's own, no special tokens of its own) joined by
    the end-of-text id where the tokenizer has one; train + val are that stream cut once, each token in
    exactly one; the consecutive val windows' inputs plus the last window's final target are the val stream up
    to a tail shorter than a window; every training window is a slice of the train stream with its targets
    one token on."""
    from tokenizers import Tokenizer

    tokenizer_dir = make_tokenizer(tmp_path / "tok", end_of_text=end_of_text)
    files, documents = write_corpus(tmp_path / "corpus")
    cfg = text_config(files, tokenizer_dir, block_size=32)
    datamodule = build_datamodule(cfg, micro_batch_size=4, seed=0)

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    separator = [tokenizer.token_to_id(EOS)] if end_of_text else []
    expected = [*tokenizer.encode(documents[0], add_special_tokens=False).ids]
    for document in documents[1:]:
        expected += separator + tokenizer.encode(document, add_special_tokens=False).ids
    assert datamodule.spec.vocab_size == tokenizer.get_vocab_size() and datamodule.spec.block_size == 32
    assert datamodule.cache.eos_id == (separator[0] if end_of_text else None)

    train, val = datamodule.datasets["train"], datamodule.datasets["val"]
    stream = np.concatenate([np.asarray(train.data[:]), np.asarray(val.data[:])]).astype(np.int64)
    assert stream.tolist() == expected
    assert len(val.data) == int(len(expected) * 0.1)

    windows = [val[k] for k in range(len(val))]
    covered = np.concatenate([*(inputs.numpy() for inputs, _ in windows), windows[-1][1].numpy()[-1:]])
    assert covered.tolist() == list(val.data[:len(covered)])
    assert len(val.data) - len(covered) < 32

    train_stream = np.asarray(train.data[:]).astype(np.int64)
    inputs, targets = train.get_batch(list(range(16)))
    assert inputs.is_contiguous() and targets.is_contiguous()
    assert str(inputs.dtype) == str(targets.dtype) == "torch.int64"
    for k in range(16):
        start = train.offset(k)
        assert inputs[k].tolist() == train_stream[start:start + 32].tolist()
        assert targets[k].tolist() == train_stream[start + 1:start + 33].tolist()


def test_the_cache_is_reused_until_a_file_or_the_tokenizer_changes(tmp_path):
    tokenizer_dir = make_tokenizer(tmp_path / "tok")
    files, _ = write_corpus(tmp_path / "corpus")
    cfg = text_config(files, tokenizer_dir)

    assert cfg.validate() and len(list((tmp_path / "corpus" / ".disttrain-tokens").iterdir())) == 1
    first, built = cfg.token_cache()
    stamp = os.stat(Path(first.folder) / TOKENS_FILE)
    assert not built and cfg.validate() == []  # nothing changed: reused, no notice
    again = os.stat(Path(first.folder) / TOKENS_FILE)
    assert (again.st_ino, again.st_mtime_ns) == (stamp.st_ino, stamp.st_mtime_ns)

    with open(files[1], "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"text": "one more line of text"}) + "\n")
    assert cfg.validate()  # rebuilt, with a notice
    second, built = cfg.token_cache()
    assert not built and second.folder != first.folder and second.num_documents == first.num_documents + 1

    make_tokenizer(tokenizer_dir, vocab_size=320)
    assert cfg.validate()
    third, _ = cfg.token_cache()
    assert third.folder not in (first.folder, second.folder) and third.vocab_size == 320


def test_a_build_that_loses_the_race_leaves_the_winners_cache_and_no_staging(tmp_path):
    """Two processes building the same key: each writes a private staging folder and renames it; the second
    rename finds the first's finished cache, keeps it and removes its own copy."""
    tokenizer_dir = make_tokenizer(tmp_path / "tok")
    files, _ = write_corpus(tmp_path / "corpus")
    sources = text_config(files, tokenizer_dir, cache_dir=str(tmp_path / "cache")).sources()
    cache, built = ensure_token_cache(sources)
    stamp = os.stat(Path(cache.folder) / TOKENS_FILE)
    tokenizer = load_tokenizer(sources.tokenizer)
    _build(sources, tokenizer, cache.eos_id, cache.folder)
    assert built and sorted(os.listdir(tmp_path / "cache")) == [os.path.basename(cache.folder)]
    assert os.stat(Path(cache.folder) / TOKENS_FILE).st_ino == stamp.st_ino
    assert json.loads((Path(cache.folder) / META_FILE).read_text())["num_tokens"] == cache.num_tokens


def test_a_model_with_a_smaller_vocabulary_than_the_tokenizer_is_refused(tmp_path, make_config):
    tokenizer_dir = make_tokenizer(tmp_path / "tok")
    files, _ = write_corpus(tmp_path / "corpus")
    listed = ",".join(map(str, files))
    overrides = ["model=gpt", "model.flavour=micro", "data=text", f"data.files=[{listed}]",
                 f"data.tokenizer={tokenizer_dir}", "data.block_size=32"]
    with pytest.raises(ConfigError) as err:
        validate(make_config([*overrides, "model.vocab_size=256"]))
    assert err.value.key == "model.vocab_size" and "300" in err.value.allowed
    assert validate(make_config([*overrides, "model.vocab_size=300"])).data.files == list(map(str, files))


def _no_tokenizer_file(tmp_path: Path, files: list[Path]) -> dict:
    (tmp_path / "empty").mkdir()
    return {"tokenizer": str(tmp_path / "empty")}


def _line_without_key(tmp_path: Path, files: list[Path]) -> dict:
    with open(files[1], "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"body": "no text key here"}) + "\n")
    return {}


def _line_not_json(tmp_path: Path, files: list[Path]) -> dict:
    with open(files[1], "a", encoding="utf-8") as handle:
        handle.write("{not json\n")
    return {}


def _unknown_extension(tmp_path: Path, files: list[Path]) -> dict:
    (tmp_path / "d.csv").write_text("a,b\n")
    return {"files": [*map(str, files), str(tmp_path / "d.csv")]}


BAD_INPUT = {
    "missing file": ("data.files", lambda tmp_path, files: {"files": [str(files[0]), str(tmp_path / "nope.txt")]}),
    "no files": ("data.files", lambda tmp_path, files: {"files": []}),
    "unknown extension": ("data.files", _unknown_extension),
    "jsonl line without the key": ("data.text_key", _line_without_key),
    "jsonl line not JSON": ("data.files", _line_not_json),
    "tokenizer folder without tokenizer.json": ("data.tokenizer", _no_tokenizer_file),
    "unknown eos token": ("data.eos_token", lambda tmp_path, files: {"eos_token": "<|nope|>"}),
    "too little text for a window per split": ("data.files", lambda tmp_path, files: {"block_size": 1_000_000}),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_config_error_naming_the_key(tmp_path, case):
    key, spoil = BAD_INPUT[case]
    tokenizer_dir = make_tokenizer(tmp_path / "tok")
    files, _ = write_corpus(tmp_path / "corpus")
    options = {"files": [str(path) for path in files], "tokenizer": str(tokenizer_dir), **spoil(tmp_path, files)}
    with pytest.raises(ConfigError) as err:
        TextConfig(**options).validate()
    assert err.value.key == key, err.value
    cache_dir = tmp_path / "corpus" / ".disttrain-tokens"
    assert not cache_dir.exists() or not [name for name in os.listdir(cache_dir) if name.startswith(".")]


def test_a_short_run_on_the_users_text_trains(tmp_path, make_config):
    tokenizer_dir = make_tokenizer(tmp_path / "tok")
    files, _ = write_corpus(tmp_path / "corpus")
    run_dir = tmp_path / "run"
    listed = ",".join(map(str, files))
    train(make_config(["model=gpt", "model.flavour=micro", "data=text", f"data.files=[{listed}]",
                       f"data.tokenizer={tokenizer_dir}", "data.block_size=32", "batch.global_size=8",
                       "trainer.max_steps=3", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=2",
                       "trainer.run_test=false", "logger=csv", "callbacks=none"], run_dir))
    losses = step_losses(run_dir)
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    assert losses[0] == pytest.approx(math.log(300), rel=0.1)  # a fresh model over the tokenizer's 300 ids
