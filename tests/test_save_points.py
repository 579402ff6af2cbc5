"""Save points and the best checkpoint keep the README's promises: every save point saves, whatever is
monitored, and a checkpoint is ranked only by a score measured on its own weights."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from disttrain.checkpoint.io import load_metadata
from disttrain.launch.job import train
from tests.conftest import ROOT, compose_config, train_cli
from tests.test_run import GPT_FAST


def _validation_losses(run_dir: Path) -> dict[int, float]:
    """val/loss of each validation, by the global step it scored."""
    with open(run_dir / "csv" / "metrics.csv") as handle:
        return {int(row["step"]): float(row["val/loss"]) for row in csv.DictReader(handle) if row.get("val/loss")}


def test_step_save_points_save_before_the_first_validation(tmp_path):
    # pydocs at this batch has an epoch of hundreds of steps: no validation happens before the crash
    run_dir = tmp_path / "run"
    crashed = train_cli([*GPT_FAST, "trainer.max_steps=40", "checkpoint.every_n_train_steps=4",
                         "checkpoint.keep_last=2", "+callbacks.crash._target_=tests.crash.CrashAtStep",
                         "+callbacks.crash.step=10", f"hydra.run.dir={run_dir}"], ROOT)
    assert crashed.returncode != 0
    checkpoints = run_dir / "checkpoints"
    # the crash lost only the steps since the last save point (8), and the one before it is kept
    assert load_metadata(checkpoints / "last.ckpt")["global_step"] == 8
    assert load_metadata(checkpoints / "last-step4.ckpt")["global_step"] == 4
    assert not list(checkpoints.glob("step*.ckpt"))  # nothing was scored, so nothing is ranked


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
    meta = load_metadata(checkpoints / "last.ckpt")
    state = next(v for k, v in meta["callbacks"].items() if k.startswith("NewestAndBestCheckpoint"))
    scores = {int(Path(path).stem.removeprefix("step")): float(score) for path, score in state["best_k_models"].items()}
    assert scores == pytest.approx(validated, rel=1e-6)
    results = json.loads((run_dir / "results.json").read_text())
    best_step = min(validated, key=validated.get)
    assert results["best"]["value"] == pytest.approx(validated[best_step], rel=1e-6)
    assert Path(results["best_checkpoint"]).name == f"step{best_step}.ckpt"
