"""Lost work is bounded: ``last.ckpt`` is the newest save point, and a killed run resumed with ``resume=auto``
continues the uninterrupted run's curve, its CSV history and its wall time."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest

from disttrain.checkpoint.io import load_metadata
from disttrain.launch.job import train
from tests.conftest import ROOT, compose_config, train_cli_in_process
from tests.test_run import GPT_FAST, step_losses

EVERY, STEPS = 4, 16
RUN = [*GPT_FAST, f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={EVERY}",
       "trainer.check_val_every_n_epoch=null"]


def ascend_after(step: int) -> list[str]:
    """Overrides that turn a run's training into gradient ascent after ``step`` (tests.ascend)."""
    return ["+callbacks.ascend._target_=tests.ascend.AscendAfterStep", f"+callbacks.ascend.step={step}"]


# a step drawn at random (fixed seed) that is not itself a save point
CRASH_AT = random.Random(11).choice([s for s in range(EVERY + 1, STEPS) if s % EVERY])


def run_cli(args: list[str], run_dir: Path):
    """``train.py *args`` into ``run_dir``, in this process (its ranks, never this process, crash)."""
    return train_cli_in_process([*args, f"hydra.run.dir={run_dir}"], ROOT)


def epoch_losses(run_dir: Path) -> dict[int, float]:
    """The train/loss_epoch column of the CSV log, by step."""
    with open(run_dir / "csv" / "metrics.csv") as handle:
        return {int(row["step"]): float(row["train/loss_epoch"]) for row in csv.DictReader(handle)
                if row.get("train/loss_epoch")}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> Path:
    """The uninterrupted run, in one process (every layout matches it, see test_parity.py)."""
    run_dir = tmp_path_factory.mktemp("straight")
    train(compose_config(RUN, run_dir))
    return run_dir


@pytest.fixture(scope="module")
def straight(straight_run) -> list[float]:
    """The uninterrupted curve."""
    losses = step_losses(straight_run)
    assert len(losses) == STEPS
    return losses


@pytest.mark.parametrize(("preset", "ranks"), [("ddp", 2), ("hsdp", 4)])
def test_killed_run_resumes_from_its_newest_save_point(tmp_path, straight, straight_run, preset, ranks):
    layout = [*RUN, f"parallel={preset}", f"trainer.devices={ranks}"]

    run_dir = tmp_path / "killed"
    crashed = run_cli([*layout, "+callbacks.crash._target_=tests.crash.CrashAtStep",
                       f"+callbacks.crash.step={CRASH_AT}"], run_dir)
    assert crashed.returncode != 0
    saved = load_metadata(run_dir / "checkpoints" / "last.ckpt")
    assert saved["global_step"] == CRASH_AT // EVERY * EVERY, CRASH_AT  # only the steps since the last save point

    resumed = run_cli([*layout, "resume=auto"], run_dir)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    # the CSV holds the whole run: the steps before the checkpoint from the first process, the rest after
    assert step_losses(run_dir) == pytest.approx(straight, rel=1e-6)
    # the epoch's mean counts the steps before the crash too: their sums went with the checkpoint
    assert epoch_losses(straight_run)
    assert epoch_losses(run_dir) == pytest.approx(epoch_losses(straight_run), rel=1e-6)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["global_steps"] == STEPS
    assert load_metadata(run_dir / "checkpoints" / "last.ckpt")["global_step"] == STEPS
    assert results["wall_time_s"] > saved["callbacks"]["ThroughputMeter"]["wall_time_s"] > 0


def test_last_checkpoint_is_the_final_state_when_the_metric_stops_improving(tmp_path):
    # the default run, turned to gradient ascent after its first epoch's validation (step 10 of 190): every later
    # validation scores worse, so the best checkpoint is not the last by construction, on any CPU
    run_dir = tmp_path / "run"
    train(compose_config(["logger=csv", "callbacks=none", "trainer.run_test=false",
                          *ascend_after(10)], run_dir))
    checkpoints = run_dir / "checkpoints"
    best = json.loads((run_dir / "results.json").read_text())["best_checkpoint"]
    assert load_metadata(checkpoints / "last.ckpt")["global_step"] == 190
    assert load_metadata(Path(best))["global_step"] < 190  # otherwise this run would not test anything


def test_the_end_of_run_test_scores_the_best_checkpoints_weights(tmp_path):
    # digits at a constant rate, validated every 8 steps and turned to gradient ascent after step 16: the best
    # validation loss is at or before step 16 whatever the CPU's rounding; a run stopped at that step ranks nothing
    # (save_top_k=0) and tests the weights it holds, the same weights
    run = ["logger=csv", "callbacks=none", "optim.lr=0.1", "scheduler=constant", "scheduler.warmup_fraction=null",
           "scheduler.warmup_steps=0", "trainer.val_check_interval=8", "trainer.check_val_every_n_epoch=null",
           "checkpoint.monitor=val/loss"]
    train(compose_config([*run, *ascend_after(16), "trainer.max_steps=40"], tmp_path / "ranked"))
    ranked = json.loads((tmp_path / "ranked" / "results.json").read_text())
    best_step = load_metadata(Path(ranked["best_checkpoint"]))["global_step"]
    assert best_step <= 16  # otherwise the best weights are those in memory, and this would test nothing
    train(compose_config([*run, f"trainer.max_steps={best_step}", "checkpoint.save_top_k=0"], tmp_path / "held"))
    held = json.loads((tmp_path / "held" / "results.json").read_text())
    assert held["best_checkpoint"] is None and held["global_steps"] == best_step
    assert ranked["metrics"]["test/acc"] == held["metrics"]["test/acc"]
    assert ranked["metrics"]["test/loss"] == pytest.approx(held["metrics"]["test/loss"], rel=1e-6)


def test_a_run_ending_between_save_points_saves_its_last_step(tmp_path):
    run_dir = tmp_path / "run"
    train(compose_config([*RUN, f"trainer.max_steps={STEPS + 2}"], run_dir))
    saved = load_metadata(run_dir / "checkpoints" / "last.ckpt")
    assert saved["global_step"] == STEPS + 2
    # the data's position is filed under the data module's own class name, as in checkpoints written before the
    # Trainer was handed a view of the module (disttrain.rank.lightning_data): those resume mid-epoch too
    assert {key: saved["PyDocsDataModule"][key] for key in ("micro_size", "accumulation", "dp")} == \
        {"micro_size": 8, "accumulation": 1, "dp": 1}


def test_resume_auto_without_a_checkpoint_says_it_starts_from_step_0(tmp_path, capsys):
    from disttrain.checkpoint.folders import resume_path

    assert resume_path("auto", tmp_path) is None
    assert capsys.readouterr().err == (f"disttrain: resume=auto found no complete checkpoint in "
                                       f"{tmp_path / 'checkpoints'}: starting from step 0\n")


def test_a_run_that_max_steps_ended_inside_an_epoch_goes_on_from_there_with_more_steps(tmp_path):
    # a constant rate, so the schedule does not depend on max_steps and the two runs can be compared step by step
    constant = [*RUN, "scheduler=constant", "scheduler.warmup_fraction=null", "scheduler.warmup_steps=0"]
    train(compose_config([*constant, "trainer.max_steps=18"], tmp_path / "straight"))
    train(compose_config([*constant, "trainer.max_steps=10"], tmp_path / "first"))
    # the first run's last save is the end of its fit, in the middle of the epoch: Lightning's loop records the
    # epoch as processed there, and took it as finished (it trained nothing more and the summary failed)
    train(compose_config([*constant, "trainer.max_steps=18", f"resume={tmp_path / 'first'}"], tmp_path / "more"))
    straight = step_losses(tmp_path / "straight")
    assert step_losses(tmp_path / "more") == pytest.approx(straight[10:], rel=1e-6)
    assert json.loads((tmp_path / "more" / "results.json").read_text())["global_steps"] == 18


def test_optimiser_hyper_parameters_are_one_item_per_parameter_and_older_checkpoints_still_resume(
        tmp_path, monkeypatch):
    import disttrain.checkpoint.sharded as sharded
    from disttrain.checkpoint.io import load_index

    constant = [*RUN, "scheduler=constant", "scheduler.warmup_fraction=null", "scheduler.warmup_steps=0"]
    train(compose_config([*constant, "trainer.max_steps=18"], tmp_path / "straight"))

    def items(run: str) -> tuple[int, int]:
        """Non-tensor items of the optimiser's state in the run's last.ckpt, and its parameters."""
        index = load_index(tmp_path / run / "checkpoints" / "last.ckpt").state_dict_metadata
        groups = [key for key in index if key.startswith("optimizer_0.param_groups.")]
        return len(groups), len({key.rsplit(".", 1)[0] for key in index if key.startswith("optimizer_0.state.")})

    # written as before: every hyper-parameter an item of its own, and no mark in the metadata
    with monkeypatch.context() as before:
        before.setattr(sharded, "pack_param_groups", lambda state: state)
        before.setattr(sharded, "PACKED_GROUPS", "not_the_mark")
        train(compose_config([*constant, "trainer.max_steps=10"], tmp_path / "first"))
    groups, params = items("first")
    assert groups >= 10 * params  # AdamW: a dozen each
    train(compose_config([*constant, "trainer.max_steps=18", f"resume={tmp_path / 'first'}"], tmp_path / "more"))
    assert step_losses(tmp_path / "more") == pytest.approx(step_losses(tmp_path / "straight")[10:], rel=1e-6)
    assert items("more") == (params, params) and params > 10  # the resumed run's own checkpoint: one each


def test_a_run_resumed_with_more_steps_follows_the_longer_schedule_from_its_first_step(tmp_path):
    from tests.conftest import logged_metric

    # the cosine schedule of RUN (warm-up, then decay to its floor at max_steps) depends on max_steps
    train(compose_config([*RUN, "trainer.max_steps=18", "trainer.val_check_interval=null",
                          "trainer.check_val_every_n_epoch=1"], tmp_path / "straight"))
    train(compose_config([*RUN, "trainer.max_steps=10"], tmp_path / "first"))
    train(compose_config([*RUN, "trainer.max_steps=18", f"resume={tmp_path / 'first'}"], tmp_path / "more"))
    straight = dict(logged_metric(tmp_path / "straight", "train/lr"))
    resumed = dict(logged_metric(tmp_path / "more", "train/lr"))
    assert sorted(resumed) == list(range(11, 19)), resumed
    # step 11 took the first run's last rate (its schedule ended at step 10) before the longer schedule applied
    assert [resumed[step] for step in range(11, 19)] == pytest.approx([straight[step] for step in range(11, 19)],
                                                                       rel=1e-9)


def test_resuming_a_run_of_another_model_size_is_one_line_before_any_rank_starts(tmp_path):
    from disttrain.config import validate
    from disttrain.errors import ConfigError

    micro = [*GPT_FAST, "trainer.max_steps=2", "trainer.limit_val_batches=0"]
    train(compose_config(micro, tmp_path / "micro"))
    validate(compose_config([*micro, f"resume={tmp_path / 'micro'}"], tmp_path / "same"))  # the same model fits
    with pytest.raises(ConfigError) as info:
        validate(compose_config([*micro, "model.n_embd=64", f"resume={tmp_path / 'micro'}"], tmp_path / "wider"))
    message = str(info.value)
    assert info.value.key == "resume" and "\n" not in message, message
    assert "its embed.wte.weight is [256, 32] where this model's is [256, 64]" in message, message
