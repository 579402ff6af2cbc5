"""A non-finite loss on one rank is seen by every rank: ``stop`` ends the run keeping the last good
checkpoint, ``skip`` drops that step's update everywhere and counts it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from disttrain.checkpoint.export import consolidated_weights
from disttrain.checkpoint.folders import damage
from disttrain.checkpoint.io import load_metadata
from disttrain.fault.config import NON_FINITE_EXIT
from tests.fault_runs import assert_no_orphans, logged_losses, run

BAD_STEP = 6  # the 6th step: after the save point at step 4
NAN = ["+callbacks.nan._target_=tests.crash.NonFiniteAtStep", f"+callbacks.nan.step={BAD_STEP - 1}",
       "+callbacks.nan.rank=1"]
NEXT_STEP = "fault_tolerance.nan_check=next_step"  # a GPU's default; a CPU's (auto) checks the norm in its step


@pytest.mark.parametrize("preset", ["ddp", "zero2"])
def test_stop_keeps_the_last_good_checkpoint_and_exits_with_its_code(tmp_path, preset):
    run_dir = tmp_path / "run"
    done = run([f"parallel={preset}", "fault_tolerance.nan_policy=stop", *NAN], run_dir)
    assert done.returncode == NON_FINITE_EXIT, done.stderr[-3000:]
    assert f"the training loss is nan at step {BAD_STEP}" in done.stderr
    last = run_dir / "checkpoints" / "last.ckpt"
    assert f"keeping its last good checkpoint (step 4, {last})" in done.stderr
    assert load_metadata(last)["global_step"] == 4 and damage(last) is None
    weights = consolidated_weights(last)
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert_no_orphans(run_dir)


@pytest.mark.parametrize("preset,clip", [("ddp", "1.0"), ("zero2", "null")])
def test_a_step_that_is_not_logged_is_guarded_by_the_gradient_norm(tmp_path, preset, clip):
    # rows every 4 steps: the loss is reduced on steps 4, 8, ... only, so the NaN of step 6 reaches every rank
    # through the all-reduced gradients' norm (computed also without clipping)
    run_dir = tmp_path / "run"
    done = run([f"parallel={preset}", "trainer.log_every_n_steps=4", f"trainer.gradient_clip_val={clip}", *NAN],
               run_dir)
    assert done.returncode == NON_FINITE_EXIT, done.stderr[-3000:]
    assert f"the gradient norm is nan at step {BAD_STEP}" in done.stderr
    last = run_dir / "checkpoints" / "last.ckpt"
    assert load_metadata(last)["global_step"] == 4
    assert all(torch.isfinite(w).all() for w in consolidated_weights(last).values())
    assert_no_orphans(run_dir)


def test_a_stop_found_a_step_late_writes_no_checkpoint_of_the_step_it_stops_at(tmp_path):
    # the gradient norm's check waits a step (the fused optimiser dropped the step on the device): with a save
    # point every step, the save at the bad step settles the check first and is never written
    run_dir = tmp_path / "run"
    done = run(["parallel=ddp", "trainer.log_every_n_steps=4", "checkpoint.every_n_train_steps=1", NEXT_STEP,
                "checkpoint.keep_last=20", *NAN], run_dir)
    assert done.returncode == NON_FINITE_EXIT, done.stderr[-3000:]
    assert f"the gradient norm is nan at step {BAD_STEP}" in done.stderr
    last = run_dir / "checkpoints" / f"last-step{BAD_STEP - 1}.ckpt"
    assert f"keeping its last good checkpoint (step {BAD_STEP - 1}, {last})" in done.stderr
    assert load_metadata(last)["global_step"] == BAD_STEP - 1
    assert not (run_dir / "checkpoints" / f"last-step{BAD_STEP}.ckpt").exists()
    assert all(torch.isfinite(w).all() for w in consolidated_weights(last).values())


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_a_non_finite_gradient_in_the_last_step_is_acted_on_after_the_loop(tmp_path, policy):
    # the loss is finite: only the gradient norm's check, deferred a step, can tell; no step and no checkpoint
    # follows
    run_dir = tmp_path / "run"
    done = run(["parallel=ddp", f"fault_tolerance.nan_policy={policy}", "checkpoint.save_last=false", NEXT_STEP,
                "checkpoint.save_top_k=0", "+callbacks.nan._target_="
                "tests.crash.NonFiniteGradientAtStep", "+callbacks.nan.step=11"], run_dir)
    if policy == "skip":
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads((run_dir / "results.json").read_text())["fault_tolerance"]["skipped_steps"] == 1
    else:
        assert done.returncode == NON_FINITE_EXIT, done.stderr[-3000:]
        assert "the gradient norm is nan at step 12" in done.stderr


def test_skip_drops_the_update_on_every_rank_and_counts_it(tmp_path):
    run_dir = tmp_path / "run"
    done = run(["parallel=ddp", "fault_tolerance.nan_policy=skip", "checkpoint.keep_last=20",
                "checkpoint.every_n_train_steps=1", *NAN], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["fault_tolerance"]["skipped_steps"] == 1
    assert "warning: 1 of 12 optimiser steps were skipped for non-finite numbers" in done.stderr
    losses = logged_losses(run_dir)
    assert math.isnan(float(losses[BAD_STEP]))
    assert all(math.isfinite(float(value)) for step, value in losses.items() if step != BAD_STEP)
    # the skipped step left the weights as they were after the step before it
    before = consolidated_weights(run_dir / "checkpoints" / f"last-step{BAD_STEP - 1}.ckpt")
    after = consolidated_weights(run_dir / "checkpoints" / f"last-step{BAD_STEP}.ckpt")
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("preset", ["ddp", "zero2"])
def test_a_step_dropped_on_the_device_leaves_weights_and_moments_as_they_were(tmp_path, preset):
    # a NaN gradient with a finite loss on a step that logs nothing: the fused optimiser drops the step on the
    # device (its found_inf flag), and the host counts it a step later
    run_dir = tmp_path / "run"
    done = run([f"parallel={preset}", "fault_tolerance.nan_policy=skip", "trainer.log_every_n_steps=4", NEXT_STEP,
                "checkpoint.keep_last=20", "checkpoint.every_n_train_steps=1",
                "+callbacks.nan._target_=tests.crash.NonFiniteGradientAtStep", f"+callbacks.nan.step={BAD_STEP - 1}"],
               run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run_dir / "results.json").read_text())["fault_tolerance"]["skipped_steps"] == 1
    steps = [consolidated_weights(run_dir / "checkpoints" / f"last-step{step}.ckpt")
             for step in (BAD_STEP - 1, BAD_STEP, BAD_STEP + 1)]
    assert all(torch.equal(steps[0][name], steps[1][name]) for name in steps[0])
    # the next step trains on: the moments were left finite
    assert not all(torch.equal(steps[1][name], steps[2][name]) for name in steps[1])
    assert all(torch.isfinite(w).all() for w in steps[2].values())


def test_a_skipped_steps_loss_counts_nowhere_in_the_epochs_mean():
    from disttrain.data.spec import DataSpec
    from disttrain.optim import AdamWConfig, SchedulerConfig
    from disttrain.rank.task import TrainTask

    task = TrainTask(torch.nn.Linear(4, 2), DataSpec("image", num_classes=2, in_channels=1, image_size=2),
                     AdamWConfig(), SchedulerConfig(), total_steps=3)
    logged = {}
    task.log = lambda name, value, **_: logged.__setitem__(name, float(value))
    task._log_position = lambda *_args, **_kwargs: None
    # steps as (this rank's batch losses, whether every rank applied the step): a step skipped for another rank's
    # NaN counts nowhere, its finite losses on this rank neither; an epoch without an applied step has no mean
    epochs = (([([1.0], True), ([float("nan")], False), ([3.0, 1e12], False), ([2.0, 4.0], True)], 7 / 3),
              ([([5.0], True)], 5.0), ([([1e12], False)], float("nan")))
    for steps, mean in epochs:
        for losses, applied in steps:
            for loss in losses:
                task._record_train_loss(torch.tensor(loss))
            task._count_applied_step(applied)
        task.on_train_epoch_end()
        assert logged["train/loss_epoch"] == pytest.approx(mean, nan_ok=True)


def test_a_steps_losses_are_released_with_it_and_still_counted(monkeypatch):
    """The epoch's mean keeps each applied loss's value, not the tensor: a kept tensor per step pinned glibc's heap
    between the steps' activations (on a CPU it grew 2 MB a step, a page fault per fresh page). Losses of a step
    the optimiser dropped on the device (its flag) count nowhere; the kept values fold over several rounds."""
    import weakref

    import disttrain.rank.task as task_module
    from disttrain.data.spec import DataSpec
    from disttrain.optim import AdamWConfig, SchedulerConfig

    monkeypatch.setattr(task_module, "FOLD_EVERY", 4)
    task = task_module.TrainTask(torch.nn.Linear(4, 2), DataSpec("image", num_classes=2, in_channels=1,
                                                                 image_size=2), AdamWConfig(), SchedulerConfig(),
                                 total_steps=11)
    logged = {}
    task.log = lambda name, value, **_: logged.__setitem__(name, float(value))
    task._log_position = lambda *_args, **_kwargs: None
    counted = []
    for step in range(11):
        losses = [torch.tensor(float(step)), torch.tensor(step + 0.5)]
        released = [weakref.ref(loss) for loss in losses]
        for loss in losses:
            task._record_train_loss(loss)
        dropped = torch.tensor(1.0) if step == 6 else torch.tensor(0.0) if step == 3 else None
        task._step_loss.clear()
        task._count_applied_step(True, dropped)
        counted += [] if step == 6 else [float(step), step + 0.5]
        del losses, loss
        assert all(ref() is None for ref in released), f"step {step}'s losses are still held"
    task.on_train_epoch_end()
    assert logged["train/loss_epoch"] == pytest.approx(sum(counted) / len(counted), rel=1e-6)


def test_a_stop_before_any_save_point_does_not_promise_a_checkpoint(tmp_path):
    from disttrain.fault.steps import StepAgreement
    from disttrain.fault.stops import NonFiniteStep

    with pytest.raises(NonFiniteStep, match="at step 2: the run stops, before any checkpoint was saved"):
        StepAgreement("stop", tmp_path / "checkpoints").check_finite("the training loss", torch.tensor(math.nan), 2)


@pytest.mark.parametrize("check,deferred", [("next_step", True), ("now", False)])
def test_nan_check_decides_whether_the_norm_is_read_in_its_step(make_config, tmp_path, monkeypatch, check, deferred):
    from disttrain.fault.steps import StepAgreement
    from disttrain.launch.job import train

    calls = []
    for name in ("check_finite", "check_finite_later"):
        original = getattr(StepAgreement, name)
        monkeypatch.setattr(StepAgreement, name, lambda self, what, *args, _name=name, _original=original:
                            calls.append((_name, what)) or _original(self, what, *args))
    train(make_config([f"fault_tolerance.nan_check={check}", "trainer.max_steps=4", "trainer.log_every_n_steps=2",
                       "trainer.limit_val_batches=0", "trainer.run_test=false"], tmp_path / "run"))
    norm_checks = [name for name, what in calls if what == "the gradient norm"]
    assert norm_checks == ["check_finite_later" if deferred else "check_finite"] * 4
