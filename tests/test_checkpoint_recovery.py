"""Crash-consistent checkpoints: a save cut short or a damaged newest checkpoint is skipped, with a warning,
for the one before it, and the run continues exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from disttrain.checkpoint.folders import damage, newest_complete
from disttrain.checkpoint.io import load_index, load_metadata
from tests.fault_runs import STEPS, assert_no_orphans, logged_losses, run


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference")
    done = run(["parallel=ddp", "checkpoint.keep_last=2"], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def test_keep_last_keeps_the_newest_save_points(reference):
    kept = sorted(p.name for p in (reference / "checkpoints").iterdir() if p.name.startswith("last"))
    assert kept == ["last-step8.ckpt", "last.ckpt"]
    assert load_metadata(reference / "checkpoints" / "last.ckpt")["global_step"] == STEPS


def test_a_truncated_shard_sends_the_resume_to_the_checkpoint_before(reference, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    index = load_index(run_dir / "checkpoints" / "last.ckpt")
    shard = run_dir / "checkpoints" / "last.ckpt" / next(iter(index.storage_data.values())).relative_path
    shard.write_bytes(shard.read_bytes()[:-100])
    assert "holds" in damage(run_dir / "checkpoints" / "last.ckpt")
    newest, skipped = newest_complete(run_dir / "checkpoints")
    assert newest.name == "last-step8.ckpt" and len(skipped) == 1

    resumed = run(["parallel=ddp", "checkpoint.keep_last=2", "resume=auto"], run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"skipping checkpoint {run_dir / 'checkpoints' / 'last.ckpt'}: shard" in resumed.stderr
    # steps 9 to 12 trained again from step 8 give the same numbers
    assert logged_losses(run_dir) == logged_losses(reference)


def test_a_resume_that_finds_no_readable_checkpoint_saves_where_the_next_resume_looks(reference, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    checkpoints = run_dir / "checkpoints"
    for name in ("last.ckpt", "last-step8.ckpt"):
        (checkpoints / name / ".metadata").write_bytes(b"not an index")
    resumed = run(["parallel=ddp", "checkpoint.keep_last=2", "resume=auto"], run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"skipping checkpoint {checkpoints / 'last.ckpt'}: cannot be read" in resumed.stderr
    assert "moved aside to last.ckpt.damaged" in resumed.stderr
    assert "starting from step 0" in resumed.stderr
    # the new save points took the names resume reads (not last-v1.ckpt), and the damaged ones are kept aside
    assert not list(checkpoints.glob("last-v*"))
    assert {"last.ckpt.damaged", "last-step8.ckpt.damaged"} <= {p.name for p in checkpoints.iterdir()}
    newest, skipped = newest_complete(checkpoints)
    assert newest == checkpoints / "last.ckpt" and not skipped
    assert load_metadata(newest)["global_step"] == STEPS
    assert logged_losses(run_dir) == logged_losses(reference)  # from step 0 again, the same numbers


def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint_in_use(reference, tmp_path):
    run_dir = tmp_path / "run"
    done = run(["parallel=ddp", "checkpoint.keep_last=2", "fault_tolerance.max_restarts=1",
                "+callbacks.die._target_=tests.crash.KillDuringSave", "+callbacks.die.step=8",
                "+callbacks.die.rank=1"], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1 exited with code 1" in done.stderr
    assert logged_losses(run_dir) == logged_losses(reference)
    assert not list((run_dir / "checkpoints").glob("*.partial"))
    assert_no_orphans(run_dir)
