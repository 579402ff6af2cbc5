"""Save points and the best checkpoint keep the README's promises: every save point saves, whatever is
monitored, and a checkpoint is ranked only by a score measured on its own weights."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from disttrain.checkpoint.folders import damage
from disttrain.checkpoint.io import INDEX_FILE, METADATA_FILE, load_metadata
from disttrain.checkpoint.optimizer_state import optimizer_state
from disttrain.launch.job import train
from tests.conftest import ROOT, compose_config, train_cli_in_process
from tests.test_run import GPT_FAST, step_losses


def _validation_losses(run_dir: Path) -> dict[int, float]:
    """val/loss of each validation, by the global step it scored."""
    with open(run_dir / "csv" / "metrics.csv") as handle:
        return {int(row["step"]): float(row["val/loss"]) for row in csv.DictReader(handle) if row.get("val/loss")}


def test_step_save_points_save_before_the_first_validation(tmp_path):
    # pydocs at this batch has an epoch of hundreds of steps: no validation happens before the crash; two ranks, so
    # that the crash (os._exit on every rank) ends forked ranks and not this process
    run_dir = tmp_path / "run"
    crashed = train_cli_in_process([*GPT_FAST, "parallel=ddp", "trainer.devices=2", "trainer.max_steps=40",
                                    "checkpoint.every_n_train_steps=4", "checkpoint.keep_last=2",
                                    "+callbacks.crash._target_=tests.crash.CrashAtStep", "+callbacks.crash.step=10",
                                    f"hydra.run.dir={run_dir}"], ROOT)
    assert crashed.returncode != 0 and "exited with code 1" in crashed.stderr, crashed.stderr[-2000:]
    checkpoints = run_dir / "checkpoints"
    # the crash lost only the steps since the last save point (8), and the one before it is kept
    assert load_metadata(checkpoints / "last.ckpt")["global_step"] == 8
    assert load_metadata(checkpoints / "last-step4.ckpt")["global_step"] == 4
    assert not list(checkpoints.glob("step*.ckpt"))  # nothing was scored, so nothing is ranked


def _checkpoint_state(folder: Path) -> dict:
    """The checkpoint callback's own state as saved in ``folder``."""
    return next(v for k, v in load_metadata(folder)["callbacks"].items() if k.startswith("NewestAndBestCheckpoint"))


def test_a_ranked_save_point_writes_its_state_once_and_each_folder_stands_alone(tmp_path, monkeypatch):
    import disttrain.parallel.strategy as strategy

    # a constant rate, so that the schedule does not depend on max_steps and the runs compare step by step
    constant = [*GPT_FAST, "scheduler=constant", "scheduler.warmup_fraction=null", "scheduler.warmup_steps=0",
                "trainer.val_check_interval=6", "trainer.check_val_every_n_epoch=null"]
    train(compose_config([*constant, "trainer.max_steps=10"], tmp_path / "straight"))
    gathered = []  # a one-rank run trains in this process: the optimiser state it gathers for its saves
    monkeypatch.setattr(strategy, "optimizer_state", lambda *args: gathered.append(1) or optimizer_state(*args))
    train(compose_config([*constant, "trainer.max_steps=6"], tmp_path / "first"))
    assert len(gathered) == 1  # for step6.ckpt; last.ckpt links its shards and gathers nothing again
    checkpoints = tmp_path / "first" / "checkpoints"
    ranked, last = checkpoints / "step6.ckpt", checkpoints / "last.ckpt"
    shards = sorted(p.name for p in ranked.iterdir() if p.name != METADATA_FILE)
    assert INDEX_FILE in shards and len(shards) > 1
    assert sorted(p.name for p in last.iterdir() if p.name != METADATA_FILE) == shards
    assert all((last / name).samefile(ranked / name) for name in shards)  # linked, not written a second time
    # each has its own metadata: the newest save point's records itself as the newest
    assert _checkpoint_state(last)["last_model_path"] == str(last)
    assert _checkpoint_state(ranked)["last_model_path"] != str(last)
    assert json.loads((tmp_path / "first" / "results.json").read_text())["checkpoints"]["saves"] == 2
    shutil.rmtree(ranked)  # as when a better score pushes it out of the top k: the newest save point stays whole
    assert damage(last) is None
    train(compose_config([*constant, "trainer.max_steps=10", f"resume={tmp_path / 'first'}"], tmp_path / "more"))
    assert step_losses(tmp_path / "more") == pytest.approx(step_losses(tmp_path / "straight")[6:], rel=1e-6)


def test_only_validated_steps_are_ranked_and_by_their_own_score(tmp_path):
    run_dir = tmp_path / "run"
    train(compose_config([*GPT_FAST, "trainer.max_steps=12", "trainer.val_check_interval=6",
                          "trainer.check_val_every_n_epoch=null", "checkpoint.every_n_train_steps=4",
                          "checkpoint.save_top_k=-1"], run_dir))
    checkpoints = run_dir / "checkpoints"
    validated = _validation_losses(run_dir)
    assert sorted(validated) == [6, 12]
    # step 4 and step 8 were save points between validations: last.ckpt, not ranked by an older score
    assert sorted(p.name for p in checkpoints.glob("step*.ckpt")) == ["step12.ckpt", "step6.ckpt"]
    state = _checkpoint_state(checkpoints / "last.ckpt")
    scores = {int(Path(path).stem.removeprefix("step")): float(score) for path, score in state["best_k_models"].items()}
    assert scores == pytest.approx(validated, rel=1e-6)
    results = json.loads((run_dir / "results.json").read_text())
    best_step = min(validated, key=validated.get)
    assert results["best"]["value"] == pytest.approx(validated[best_step], rel=1e-6)
    assert Path(results["best_checkpoint"]).name == f"step{best_step}.ckpt"
