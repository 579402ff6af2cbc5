"""What a batch setting means through the real runner: accumulation changes nothing but memory, an int
batch limit is a count, and exported weights reproduce the logged validation loss (BatchNorm included)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from disttrain.checkpoint.io import load_weights_file
from disttrain.launch.job import train
from disttrain.parallel.buffers import step_broadcast_needed
from tests.conftest import compose_config, exported_val_loss, logged_metric
from tests.test_run import GPT_FAST, step_losses

# 100 training windows a epoch at a global batch of 8: 12 whole steps and 4 windows dropped per epoch
EPOCHS = [*GPT_FAST, "trainer.max_steps=-1", "trainer.max_epochs=2", "data.samples_per_epoch=100",
          "trainer.log_every_n_steps=1"]


def test_accumulation_gives_the_same_steps_and_curve(tmp_path, capsys):
    train(compose_config(EPOCHS, tmp_path / "one"))
    train(compose_config([*EPOCHS, "batch.accumulation=4"], tmp_path / "four"))
    one, four = step_losses(tmp_path / "one"), step_losses(tmp_path / "four")
    assert len(one) == len(four) == 24
    assert four == pytest.approx(one, rel=1e-6)
    # each epoch's logged mean is the mean of its 12 steps' losses (a step's loss: the mean of its micro-batches)
    for run, losses in (("one", one), ("four", four)):
        epochs = [value for _, value in logged_metric(tmp_path / run, "train/loss_epoch")]
        assert epochs == pytest.approx([sum(losses[:12]) / 12, sum(losses[12:]) / 12], rel=1e-6)
    printed = capsys.readouterr().out.splitlines()
    assert not [line for line in printed if line.startswith("step 0/")]
    assert any(line.startswith("step 24/24") for line in printed)


CNN = ["logger=csv", "callbacks=none", "trainer.run_test=false", "trainer.max_steps=20",
       "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1"]


@pytest.fixture(scope="module")
def cnn_runs(tmp_path_factory) -> dict[str, dict]:
    """The CNN (BatchNorm) for 20 steps, validated on one batch per rank at the end of its first epoch."""
    runs = {}
    for name, overrides in {"single": [], "ddp": ["parallel=ddp", "trainer.devices=2"],
                            "ddp_every_step": ["parallel=ddp", "trainer.devices=2",
                                               "parallel.ddp.forward_sync_buffers=true"],
                            "zero3": ["parallel=zero3", "trainer.devices=2"]}.items():
        run_dir = tmp_path_factory.mktemp(name)
        train(compose_config([*CNN, *overrides], run_dir))
        (step, logged), = logged_metric(run_dir, "val/loss")
        runs[name] = {"logged": logged, "exported": exported_val_loss(
            run_dir, run_dir / "checkpoints" / f"step{step}.ckpt", run_dir / "model.pt"),
            "state": load_weights_file(run_dir / "model.pt"), "step_losses": step_losses(run_dir),
            "epoch_losses": logged_metric(run_dir, "train/loss_epoch")}
    return runs


@pytest.mark.parametrize("name", ["single", "ddp", "zero3"])
def test_exported_weights_reproduce_the_logged_validation_loss(cnn_runs, name):
    # one batch per rank (64 images in all), with every rank's BatchNorm statistics equal to the first's
    assert cnn_runs[name]["exported"] == pytest.approx(cnn_runs[name]["logged"], rel=1e-6)


@pytest.mark.parametrize("name", ["single", "ddp"])
def test_the_epochs_mean_loss_counts_every_ranks_batches(cnn_runs, name):
    # a step's logged loss is the mean over both ranks' halves of its batch; the epoch's, the mean of its steps'
    # (19 steps an epoch; the second ends with the run after one)
    epochs, losses = cnn_runs[name]["epoch_losses"], cnn_runs[name]["step_losses"]
    assert [end for end, _ in epochs] == [19, 20] and len(losses) == 20
    starts = [0, *(end for end, _ in epochs[:-1])]
    for start, (end, mean) in zip(starts, epochs, strict=True):
        assert mean == pytest.approx(sum(losses[start:end]) / (end - start), rel=1e-6)


def test_sharding_keeps_buffers_as_ddp_does(cnn_runs):
    assert cnn_runs["zero3"]["logged"] == pytest.approx(cnn_runs["ddp"]["logged"], rel=1e-6)


def test_buffers_broadcast_before_evaluation_only_change_nothing(cnn_runs):
    # BatchNorm's running statistics are not read by a training forward: broadcasting them before every step
    # (torch DDP's default) or only before evaluation and checkpoints gives the same weights, statistics and
    # validation loss, to the bit
    every_step, default = cnn_runs["ddp_every_step"], cnn_runs["ddp"]
    assert default["logged"] == every_step["logged"]
    assert default["state"].keys() == every_step["state"].keys()
    assert any(name.endswith("running_var") for name in default["state"])
    for name, tensor in default["state"].items():
        assert torch.equal(tensor, every_step["state"][name]), name


def test_step_broadcast_only_for_buffers_a_forward_may_read():
    norm_only = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.InstanceNorm1d(4, track_running_stats=True))
    assert not step_broadcast_needed(norm_only)
    assert step_broadcast_needed(norm_only, setting=True)
    counted = nn.Sequential(nn.BatchNorm1d(4))
    counted.register_buffer("calls", torch.zeros(()))
    assert step_broadcast_needed(counted)
    assert not step_broadcast_needed(counted, setting=False)
