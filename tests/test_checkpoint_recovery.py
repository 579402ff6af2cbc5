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
    assert f"skipping checkpoint {run_dir / 'checkpoints' / 'last.ckpt'}: its shard" in resumed.stderr
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
    assert (f"skipping checkpoint {checkpoints / 'last.ckpt'}: its index .metadata is not a torch.distributed."
            "checkpoint index" in resumed.stderr)
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


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB file system of its own (tmpfs), which a test may fill without filling the machine's."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("this machine does not let the tests mount a tmpfs")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_stops_the_run_in_one_line_and_keeps_the_last_good_checkpoint(small_disk):
    run_dir = small_disk / "run"
    # rank 0 fills the disk after step 6; the save point of step 8 finds it full, with a restart left
    done = run(["parallel=ddp", "fault_tolerance.max_restarts=1", "+callbacks.fill._target_=tests.crash.FillDiskAtStep",
                "+callbacks.fill.step=6"], run_dir)
    checkpoints = run_dir / "checkpoints"
    assert done.returncode == 74, done.stderr[-3000:]
    assert ("checkpoint step8.ckpt at step 8 could not be written: the disk is full (" in done.stderr
            and f"the last good checkpoint is {checkpoints / 'last.ckpt'} (step 4)" in done.stderr)
    # the supervisor's own record could not be written either: a warning, not the job's end
    assert f"could not write {run_dir / 'logs' / 'restarts.json'}" in done.stderr
    assert "Traceback" not in done.stderr and "restarting" not in done.stderr
    assert not list(checkpoints.glob("*.partial"))  # nothing left filling the disk
    assert damage(checkpoints / "last.ckpt") is None and load_metadata(checkpoints / "last.ckpt")["global_step"] == 4


def test_a_save_that_fails_names_a_full_disk_from_what_the_ranks_report(tmp_path):
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from disttrain.checkpoint.sharded import disk_full, save_failed

    full = OSError(errno.ENOSPC, "No space left on device")
    gathered = CheckpointException("save failed", {1: (full, None)})
    assert disk_full(gathered, tmp_path).startswith("the disk is full (")
    assert disk_full(RuntimeError("unexpected pos 64 vs 0"), tmp_path) is None  # this disk has room
    staging = tmp_path / "checkpoints" / "last.ckpt.partial"
    staging.mkdir(parents=True)
    (staging / "shard").write_bytes(b"x")
    stop = save_failed(OSError(errno.EIO, "Input/output error"), staging, 3)
    assert str(stop) == ("checkpoint last.ckpt at step 3 could not be written: [Errno 5] Input/output error; its "
                         "partial folder was removed and no complete checkpoint was saved before it")
    assert not staging.exists() and stop.exit_code == 74


def test_a_record_the_disk_refuses_costs_one_line(tmp_path, capsys):
    from disttrain.records import keep_record

    assert keep_record(tmp_path / "restarts.json", "[]")
    assert not keep_record(tmp_path / "missing" / "restarts.json", "[]")
    assert capsys.readouterr().err == (f"disttrain: could not write {tmp_path / 'missing' / 'restarts.json'} (No such "
                                       "file or directory); the job goes on without it\n")
