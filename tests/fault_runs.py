"""Runs of the fault-tolerance tests: a short GPT run on 2 ranks, and what the tests compare in them."""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from disttrain.checkpoint.export import consolidated_weights
from disttrain.config.resolved import RESOLVED_FILE
from tests.conftest import ROOT, train_cli, train_cli_in_process

STEPS, EVERY = 12, 4
# dropout on, so the generator states in the checkpoint matter; validation is the save point
RUN = ["model=gpt", "model.flavour=micro", "model.dropout=0.1", "data=pydocs", "data.block_size=32",
       "batch.global_size=8", f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=1",
       "trainer.limit_val_batches=2", "trainer.run_test=false", f"trainer.val_check_interval={EVERY}",
       "trainer.check_val_every_n_epoch=null", "logger=csv", "callbacks=none", "trainer.devices=2"]
KILL_AT = 6  # not a save point: steps 5 and 6 are trained twice


def logged_losses(run_dir: Path) -> dict[int, str]:
    """train/loss per step exactly as written (text, so equality is bitwise)."""
    with open(run_dir / "csv" / "metrics.csv") as handle:
        return {int(row["step"]): row["train/loss"] for row in csv.DictReader(handle) if row.get("train/loss")}


def signal_at(step: int, rank: int, signum: int) -> list[str]:
    """Overrides adding a callback that sends ``signum`` to ``rank`` after ``step`` steps (first attempt only)."""
    return ["+callbacks.signal._target_=tests.crash.SignalAtStep", f"+callbacks.signal.step={step}",
            f"+callbacks.signal.rank={rank}", f"+callbacks.signal.signum={int(signum)}"]


def run(args: list[str], run_dir: Path, in_process: bool = True):
    """``train.py`` with ``RUN`` and ``args`` into ``run_dir``: its exit status and output. The command runs in
    this process, its ranks forked from the warm fork server, unless ``in_process`` is False: a run whose one
    rank is the job process itself (``trainer.devices=1``) cannot be signalled or crash without ending the
    tests, so it gets an interpreter of its own."""
    command = [*RUN, *args, f"hydra.run.dir={run_dir}"]
    return train_cli_in_process(command, ROOT) if in_process else train_cli(command, ROOT)


def assert_same_weights(run_dir: Path, reference: Path) -> None:
    """The final weights of the two runs are bitwise equal."""
    ours = consolidated_weights(run_dir / "checkpoints" / "last.ckpt")
    theirs = consolidated_weights(reference / "checkpoints" / "last.ckpt")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def assert_no_orphans(run_dir: Path) -> None:
    """No process of this run is left (every rank's command line names the run's ``resolved.yaml``). With the
    job process gone too, nothing is left to hold the run's ports."""
    marker = str(run_dir / RESOLVED_FILE).encode()
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes():
                left.append(proc.name)
        except OSError:  # the process ended while we looked
            continue
    assert not left, left


_REFERENCES: dict[str, Path] = {}


def uninterrupted(preset: str, tmp_path_factory) -> Path:
    """The run directory of the uninterrupted run under ``preset`` (run once per test session)."""
    if preset not in _REFERENCES:
        run_dir = tmp_path_factory.mktemp(f"straight-{preset}")
        done = run([f"parallel={preset}"], run_dir)
        assert done.returncode == 0, done.stderr[-3000:]
        _REFERENCES[preset] = run_dir
    return _REFERENCES[preset]




def assert_killed_run_restarts_bitwise(args: list[str], rank: int, tmp_path: Path) -> None:
    """A run with ``args`` whose ``rank`` is killed by SIGKILL after step ``KILL_AT`` and restarted once logs the
    same losses and ends on the same weights, bitwise, as the uninterrupted run."""
    import signal

    done = run(args, tmp_path / "straight")
    assert done.returncode == 0, done.stderr[-3000:]
    done = run([*args, "fault_tolerance.max_restarts=1", *signal_at(KILL_AT, rank, signal.SIGKILL)],
               tmp_path / "killed")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restarting all 2 ranks" in done.stderr
    assert logged_losses(tmp_path / "killed") == logged_losses(tmp_path / "straight")
    assert_same_weights(tmp_path / "killed", tmp_path / "straight")
