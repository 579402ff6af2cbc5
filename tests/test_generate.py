"""``python -m disttrain.generate``: a trained run's model continues a prompt, greedily exactly as a step-by-step
argmax over its logits, reproducibly under a seed, and bad input is one line with exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from disttrain.errors import ConfigError
from disttrain.generate import ByteCodec, choose_checkpoint, codec_for, load_run, next_token, sample
from disttrain.generate.__main__ import generate, main, parse
from tests.conftest import ROOT, compose_config
from tests.test_run import GPT_FAST

TINY_GPT = [*GPT_FAST, "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.check_val_every_n_epoch=null"]
"""Three steps of the micro GPT on Python's docs (block size 32), validated and so ranked at step 3."""
TINY_HF_LLAMA = [
    "model=hf", "model.arch=llama", "+model.hidden_size=64", "+model.intermediate_size=128",
    "+model.num_hidden_layers=2", "+model.num_attention_heads=4", "+model.num_key_value_heads=2",
    "+model.max_position_embeddings=64", "data=pydocs", "data.block_size=32", "batch.global_size=8",
    "trainer.max_steps=3", "trainer.limit_val_batches=2", "trainer.run_test=false", "logger=csv", "callbacks=none",
    "optim.lr=1e-4",
]
"""Three steps of a small Llama built by ``transformers``, at a rate that leaves its greedy choices depending on the
whole context (a few steps at the usual rate teach a model only the commonest byte, the space)."""
LONG_PROMPT = "The with statement is used to wrap the execution of a block with methods"
"""Longer than the block size of 32 bytes: the context is cropped to its last 32."""


def trained(tmp_path_factory: pytest.TempPathFactory, overrides: list[str]) -> Path:
    """A run directory of ``overrides`` trained in this process."""
    from disttrain.launch.job import train

    run_dir = tmp_path_factory.mktemp("run")
    train(compose_config(overrides, run_dir))
    return run_dir


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> Path:
    return trained(tmp_path_factory, TINY_GPT)


def hand_rolled_greedy(run_dir: Path, checkpoint: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """The model rebuilt from ``config.yaml`` with the checkpoint's weights, extended by the argmax of its last
    position's logits over the data's vocabulary, from at most the block size's last tokens."""
    from omegaconf import OmegaConf

    from disttrain.checkpoint.export import consolidated_weights
    from disttrain.config import validate
    from disttrain.data import build_datamodule
    from disttrain.models import build_model

    cfg = OmegaConf.load(run_dir / "config.yaml")
    if cfg.model.get("pretrained"):  # built with real tensors here: every weight comes from the checkpoint
        OmegaConf.update(cfg, "model.pretrained", False)
    run = validate(cfg, world_size=cfg.trainer.devices)
    spec = build_datamodule(run.data, run.batch.micro_size, run.train.seed).spec
    model = build_model(run.model, spec)
    model.load_state_dict(consolidated_weights(checkpoint), strict=True)
    model.eval()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([tokens[-spec.block_size:]]))
            tokens.append(int(logits[0, -1, : spec.vocab_size].argmax()))
    return tokens


def cli(run_dir: Path, *options: str) -> list[str]:
    return [str(run_dir), *options]


@pytest.mark.parametrize("prompt", ["def ", LONG_PROMPT])
def test_greedy_is_the_argmax_loop_and_repeats(gpt_run, prompt):
    loaded = load_run(gpt_run, "last")
    ids = ByteCodec().encode(prompt)
    first = sample(loaded.model, ids, 40, loaded.spec.block_size, temperature=0, vocab_size=loaded.spec.vocab_size)
    again = sample(loaded.model, ids, 40, loaded.spec.block_size, temperature=0, vocab_size=loaded.spec.vocab_size)
    assert first == again == hand_rolled_greedy(gpt_run, gpt_run / "checkpoints" / "last.ckpt", ids, 40)
    assert len(first) == len(ids) + 40


def test_a_seed_repeats_a_sample_and_another_seed_differs(gpt_run):
    options = ("--prompt", "def ", "--temperature", "0.8", "--max-new-tokens", "100")
    one = generate(parse(cli(gpt_run, *options, "--seed", "1")))
    assert one == generate(parse(cli(gpt_run, *options, "--seed", "1")))
    assert one != generate(parse(cli(gpt_run, *options, "--seed", "2")))
    assert one.startswith("def ")


def test_top_k_one_is_greedy(gpt_run):
    options = ("--prompt", "def ", "--max-new-tokens", "60")
    greedy = generate(parse(cli(gpt_run, *options, "--temperature", "0")))
    assert generate(parse(cli(gpt_run, *options, "--temperature", "0.8", "--top-k", "1", "--seed", "3"))) == greedy


def test_top_k_draws_only_among_the_k_likeliest():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0]])
    generator = torch.Generator().manual_seed(0)
    drawn = {int(next_token(logits, 1.0, 2, generator)) for _ in range(200)}
    assert drawn == {1, 3}
    everything = {int(next_token(logits, 5.0, 0, generator)) for _ in range(400)}
    assert everything == {0, 1, 2, 3, 4}


def test_the_default_checkpoint_is_the_ranked_best_else_last(gpt_run, tmp_path):
    best = json.loads((gpt_run / "results.json").read_text())["best_checkpoint"]
    assert best and choose_checkpoint(gpt_run, None) == gpt_run / "checkpoints" / Path(best).name
    assert choose_checkpoint(gpt_run, "last") == gpt_run / "checkpoints" / "last.ckpt"
    unranked = tmp_path / "unranked"
    (unranked / "checkpoints").mkdir(parents=True)
    os.symlink(gpt_run / "checkpoints" / "last.ckpt", unranked / "checkpoints" / "last.ckpt")
    assert choose_checkpoint(unranked, None) == unranked / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match="names no best checkpoint"):
        choose_checkpoint(unranked, "best")


def run_command(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "disttrain.generate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_command_prints_the_prompt_and_what_follows(gpt_run):
    done = run_command(str(gpt_run), "--prompt", "def ", "--max-new-tokens", "20", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    best = choose_checkpoint(gpt_run, None)
    expected = hand_rolled_greedy(gpt_run, best, list(b"def "), 20)
    assert done.stdout == ByteCodec().decode(expected) + "\n"
    assert done.stdout.startswith("def ") and len(expected) == 24


def test_a_missing_run_directory_is_one_line(tmp_path):
    done = run_command(str(tmp_path / "nowhere"), "--prompt", "def ")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [f"Error: RUN_DIR='{tmp_path / 'nowhere'}' is invalid: a run directory "
                                        "(there is no such directory)"]


def error_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ")
    return lines[0]


def resolved_run(tmp_path: Path, overrides: list[str]) -> Path:
    """A run directory holding only the resolved ``config.yaml`` of ``overrides`` (nothing trained)."""
    from disttrain.config import validate

    run_dir = tmp_path / "resolved"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(validate(compose_config(overrides, run_dir)).yaml)
    return run_dir


def test_bad_input_is_one_line(gpt_run, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert "config.yaml" in error_line(capsys, cli(tmp_path / "empty", "--prompt", "x"))
    assert "--checkpoint=" in error_line(capsys, cli(gpt_run, "--prompt", "x", "--checkpoint", str(tmp_path)))
    assert "--temperature=-1.0" in error_line(capsys, cli(gpt_run, "--prompt", "x", "--temperature", "-1"))
    assert "--prompt=''" in error_line(capsys, cli(gpt_run, "--prompt", ""))


@pytest.mark.parametrize(("overrides", "name", "why"),
                         [(["model=cnn", "data=digits"], "digits", "this run's data is image"),
                          (["model=gpt", "data=synthetic_tokens"], "synthetic_tokens", "no text to turn into")])
def test_data_without_text_is_refused_by_name(tmp_path, capsys, overrides, name, why):
    line = error_line(capsys, cli(resolved_run(tmp_path, overrides), "--prompt", "x"))
    assert line.startswith(f"Error: data.name='{name}' is invalid:") and why in line


def test_a_data_tokenizer_encodes_and_decodes(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = ["def main():\n    return value", "class Point:\n    x: int", "for item in items: print(item)"]
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    data = SimpleNamespace(name="text", tokenizer=str(tmp_path))
    codec = codec_for(data, SimpleNamespace(kind="text", vocab_size=tokenizer.get_vocab_size()))
    ids = codec.encode("def main():")
    assert ids == tokenizer.encode("def main():").ids and len(ids) < len("def main():")
    assert codec.decode(ids) == "def main():"
    with pytest.raises(ConfigError, match="data.tokenizer="):
        codec_for(SimpleNamespace(name="text", tokenizer=str(tmp_path / "none")), SimpleNamespace(kind="text"))


def test_a_model_fine_tuned_from_its_weights_generates_greedily_as_the_argmax_loop(tmp_path_factory):
    """A run that started from a folder's weights (``model.pretrained=true``, its model first built on the meta
    device) generates from its checkpoint as the model rebuilt with real tensors and loaded from it does."""
    pytest.importorskip("transformers")
    from tests.test_hf_models import saved_folder

    folder = saved_folder(tmp_path_factory.mktemp("weights") / "llama")
    run_dir = trained(tmp_path_factory, [
        "model=hf", f"model.path={folder}", "model.pretrained=true", "data=pydocs", "data.block_size=32",
        "batch.global_size=8", "trainer.max_steps=3", "trainer.limit_val_batches=2", "trainer.run_test=false",
        "logger=csv", "callbacks=none", "optim.lr=1e-4"])
    text = generate(parse(cli(run_dir, "--prompt", LONG_PROMPT, "--max-new-tokens", "24", "--temperature", "0")))
    expected = hand_rolled_greedy(run_dir, run_dir / "checkpoints" / "last.ckpt", list(LONG_PROMPT.encode()), 24)
    assert text == ByteCodec().decode(expected)


def test_a_hugging_face_model_generates_greedily_as_the_argmax_loop(tmp_path_factory):
    pytest.importorskip("transformers")
    run_dir = trained(tmp_path_factory, TINY_HF_LLAMA)
    text = generate(parse(cli(run_dir, "--prompt", LONG_PROMPT, "--max-new-tokens", "24", "--temperature", "0")))
    expected = hand_rolled_greedy(run_dir, run_dir / "checkpoints" / "last.ckpt", list(LONG_PROMPT.encode()), 24)
    assert text == ByteCodec().decode(expected)
