"""End-to-end runs through the real runner: run directory contents, determinism, DDP parity, resume."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from disttrain.checkpoint.export import export
from disttrain.checkpoint.io import load_weights_file
from disttrain.config import validate
from disttrain.data import build_datamodule
from disttrain.launch.job import train
from disttrain.models import build_model

GPT_FAST = [
    "model=gpt", "model.flavour=micro", "data=pydocs", "data.block_size=32",
    "batch.global_size=8", "trainer.max_steps=20", "trainer.log_every_n_steps=1",
    "trainer.limit_val_batches=2", "trainer.limit_test_batches=2", "trainer.run_test=false",
    "scheduler.warmup_fraction=0.1", "logger=csv", "callbacks=none",
]


def step_losses(run_dir: Path) -> list[float]:
    """The train/loss column of the CSV log, one value per optimiser step."""
    with open(run_dir / "csv" / "metrics.csv") as handle:
        by_step = {}  # a step's loss may be written again on later rows of the same step
        for row in csv.DictReader(handle):
            if row.get("train/loss"):
                by_step.setdefault(int(row["step"]), float(row["train/loss"]))
    return [by_step[step] for step in sorted(by_step)]


def test_default_run_leaves_a_complete_run_directory(make_config, tmp_path):
    run_dir = tmp_path / "run"
    cfg = make_config(["trainer.max_epochs=2", "logger=default"], run_dir)
    objective = train(cfg)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["world_size"] == 1 and results["config_hash"]
    assert results["objective_metric"] == "val/acc" and objective == results["objective"] > 0.5
    assert "val/acc" in results["metrics"] and "train/loss" in results["metrics"]
    assert 0.0 <= results["metrics"]["test/acc"] <= 1.0
    assert results["samples_per_sec"] > 0 and results["wall_time_s"] > 0
    assert (run_dir / "config.yaml").exists()
    assert (run_dir / "csv" / "metrics.csv").exists()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "last.ckpt" / "meta.pt").exists()
    assert list(ckpts.glob("step*.ckpt"))
    # one consolidated weights file for inference, loadable with weights_only=True into the bare model
    weights = load_weights_file(export(ckpts / "last.ckpt", tmp_path / "model.pt"))
    run = validate(OmegaConf.load(run_dir / "config.yaml"))
    model = build_model(run.model, build_datamodule(run.data, 1, 0).spec)
    model.load_state_dict(weights, strict=True)


def test_same_seed_same_config_gives_bitwise_identical_losses(make_config, tmp_path):
    train(make_config(GPT_FAST, tmp_path / "a"))
    train(make_config(GPT_FAST, tmp_path / "b"))
    a, b = step_losses(tmp_path / "a"), step_losses(tmp_path / "b")
    assert len(a) == 20 and a == b


@pytest.mark.parametrize("accumulation", [1, 2])
def test_ddp_two_ranks_matches_single_process(make_config, tmp_path, accumulation):
    train(make_config(GPT_FAST, tmp_path / "single"))
    ddp = [*GPT_FAST, "parallel=ddp", "trainer.devices=2", f"batch.accumulation={accumulation}"]
    train(make_config(ddp, tmp_path / "ddp"))
    single, two = step_losses(tmp_path / "single"), step_losses(tmp_path / "ddp")
    assert len(single) == len(two) == 20
    for step, (x, y) in enumerate(zip(single, two, strict=True)):
        assert abs(x - y) <= 1e-5 * abs(x), f"step {step}: single {x} vs ddp {y}"
    results = json.loads((tmp_path / "ddp" / "results.json").read_text())
    assert results["world_size"] == 2 and results["batch"]["accumulation"] == accumulation
    assert not list(tmp_path.glob("ddp/**/multirun"))


def test_resume_auto_continues_the_same_curve(make_config, tmp_path):
    # A constant schedule, so a 1-epoch run and a 2-epoch run share their first epoch exactly.
    base = ["scheduler=constant", "logger=csv", "callbacks=none", "trainer.log_every_n_steps=1",
            "trainer.run_test=false"]
    train(make_config([*base, "trainer.max_epochs=2"], tmp_path / "straight"))
    train(make_config([*base, "trainer.max_epochs=1"], tmp_path / "resumed"))
    first_half = step_losses(tmp_path / "resumed")
    train(make_config([*base, "trainer.max_epochs=2", "resume=auto"], tmp_path / "resumed"))
    straight, resumed = step_losses(tmp_path / "straight"), step_losses(tmp_path / "resumed")
    # the resumed process continues the CSV log of the first: it holds the whole run
    assert len(straight) == 2 * len(first_half) == 38
    assert first_half == straight[: len(first_half)]
    assert resumed == straight


def test_wandb_logger_writes_an_offline_run(make_config, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    train(make_config(["logger=wandb", "trainer.max_epochs=1", "trainer.run_test=false"], run_dir))
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb"))


def test_resume_mid_epoch_continues_bitwise(make_config, tmp_path):
    # validation (and a kept checkpoint) every 6 steps, well inside pydocs' first epoch
    every6 = [*GPT_FAST, "trainer.max_steps=12", "trainer.val_check_interval=6",
              "trainer.check_val_every_n_epoch=null", "checkpoint.save_top_k=-1"]
    train(make_config(every6, tmp_path / "straight"))
    step6 = tmp_path / "straight" / "checkpoints" / "step6.ckpt"
    assert step6.is_dir()
    train(make_config([*every6, f"resume={step6}"], tmp_path / "resumed"))
    straight, resumed = step_losses(tmp_path / "straight"), step_losses(tmp_path / "resumed")
    assert len(straight) == 12 and resumed == straight[6:]


def test_training_throughput_leaves_out_checkpoint_saves_and_the_wall_time_is_accounted_for(make_config, tmp_path):
    run_dir = tmp_path / "run"
    train(make_config(["trainer.max_epochs=2", "logger=csv", "callbacks=none",
                       "+callbacks.slow._target_=tests.crash.SlowCheckpointState", "+callbacks.slow.seconds=0.4"],
                      run_dir))
    results = json.loads((run_dir / "results.json").read_text())
    timing = results["throughput"]
    seconds, saves = timing["seconds"], len(list((run_dir / "checkpoints").glob("*.ckpt")))
    assert saves >= 2 and seconds["checkpoints"] >= 0.4 * saves  # two epochs: a best and a last save each
    # the sleeping saves are not training: throughput is steps x batch over the training seconds alone
    trained = (results["global_steps"] - 1) * results["batch"]["global"]
    assert results["samples_per_sec"] == pytest.approx(trained / seconds["training"], rel=0.2)
    assert sum(seconds.values()) == pytest.approx(timing["wall_time_s"], rel=0.02)
    assert 0 < timing["time_to_first_step_s"] <= seconds["startup"] + seconds["validation"] + 1.0
    assert timing["end_to_end_samples_per_sec"] < results["samples_per_sec"]


def test_a_rank_multiplies_fp32_matrices_at_the_precision_asked(make_config, tmp_path):
    before = torch.get_float32_matmul_precision()
    try:
        train(make_config(["trainer.matmul_precision=medium", "trainer.max_steps=2", "trainer.limit_val_batches=0",
                           "trainer.run_test=false"], tmp_path / "run"))
        assert torch.get_float32_matmul_precision() == "medium"  # the rank ran in this process
    finally:
        torch.set_float32_matmul_precision(before)
    assert OmegaConf.load(tmp_path / "run" / "config.yaml").trainer.matmul_precision == "medium"
    train(make_config(["trainer.max_steps=2", "trainer.limit_val_batches=0", "trainer.run_test=false"],
                      tmp_path / "auto"))
    assert OmegaConf.load(tmp_path / "auto" / "config.yaml").trainer.matmul_precision == "highest"  # a CPU's auto
    assert torch.get_float32_matmul_precision() == "highest"


@pytest.mark.parametrize("accumulation", [1, 2], ids=["one_batch_a_step", "accumulation"])
def test_gradients_are_freed_once_the_optimiser_has_stepped(make_config, tmp_path, monkeypatch, accumulation):
    # Lightning zeroes them in the next step's closure after its forward (under accumulation, after the next
    # window's first forward): that forward would run beside a model's worth of stale gradients (on one H200, a
    # 1.2B Llama under full checkpointing peaked at 23.6 GB with them, 19.8 GB without)
    from disttrain.rank.task import TrainTask

    held = []  # parameters holding a gradient as each micro-batch starts, before its forward
    monkeypatch.setattr(TrainTask, "on_train_batch_start", lambda self, batch, batch_idx: held.append(
        sum(p.grad is not None for p in self.parameters())), raising=False)
    train(make_config([*GPT_FAST, "trainer.max_steps=4", "trainer.limit_val_batches=0",
                       f"batch.accumulation={accumulation}"], tmp_path / "run"))
    # the first micro-batch of each step starts with none; the second of a window with the first one's
    expected = [0] * 4 if accumulation == 1 else [0, max(held)] * 4
    assert held == expected and (accumulation == 1 or max(held) > 0), held
