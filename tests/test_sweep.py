"""Sweeps from the command line: one job directory per job, workers never re-expand the sweep."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import train_cli_in_process

FAST = ["trainer.max_epochs=1", "trainer.run_test=false", "logger=csv", "callbacks=none"]


def run_cli(args: list[str], cwd: Path) -> SimpleNamespace:
    """``python train.py *args`` in ``cwd`` run in this process, which must succeed (Hydra's basic launcher runs the
    jobs here one after the other, their ranks forked from the warm fork server; submitit's launcher starts a
    process per job)."""
    proc = train_cli_in_process(args, cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_ddp_sweep_leaves_one_directory_per_job(tmp_path):
    sweep = tmp_path / "sweep"
    shown = run_cli(["-m", "optim.lr=1e-3,3e-3", "parallel=ddp", "trainer.devices=2", *FAST,
                     f"hydra.sweep.dir={sweep}"], cwd=tmp_path).stdout
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert jobs == ["0", "1"]
    for job in jobs:
        results = json.loads((sweep / job / "results.json").read_text())
        assert results["world_size"] == 2
    lrs = {json.loads((sweep / j / "results.json").read_text())["config_hash"] for j in jobs}
    assert len(lrs) == 2
    # nothing else was created: no second multirun folder from a worker re-running Hydra
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]
    # the summary: one row per job with its swept value and objective, and the objective drawn against it
    table = (sweep / "summary.csv").read_text().splitlines()
    objectives = [json.loads((sweep / j / "results.json").read_text())["objective"] for j in jobs]
    assert table[0] == "job,optim.lr,val/acc"
    assert [row.split(",")[:2] for row in table[1:]] == [["0", "0.001"], ["1", "0.003"]]
    assert [float(row.split(",")[2]) for row in table[1:]] == objectives
    assert (sweep / "objective.png").read_bytes()[:4] == b"\x89PNG"
    assert f"Sweep of 2 job(s) in {sweep}:\n| job | optim.lr | val/acc |" in shown


def test_optuna_sweeper_runs_trials(tmp_path):
    sweep = tmp_path / "optuna"
    run_cli(["hparams_search=digits_optuna", "hydra.sweeper.n_trials=2", *FAST,
             f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    summary = (sweep / "optimization_results.yaml").read_text()
    assert "best_value" in summary
    assert len([p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()]) == 2


@pytest.mark.slow  # the ddp sweep keeps Hydra's multirun in the default suite; this adds the submitit launcher
def test_submitit_local_sweep_leaves_one_directory_per_job(tmp_path):
    # the launcher a cluster sweep uses (hydra/launcher=submitit_slurm), run locally: each job supervises its ranks
    sweep = tmp_path / "submitit"
    run_cli(["-m", "hydra/launcher=submitit_local", "optim.lr=1e-3,3e-3", "parallel=ddp", "trainer.devices=2",
             "model=gpt", "model.flavour=micro", "data=pydocs", "data.block_size=32", "batch.global_size=8",
             "trainer.max_steps=4", "trainer.limit_val_batches=1", "trainer.run_test=false", "logger=csv",
             "callbacks=none", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert jobs == ["0", "1"]
    hashes = set()
    for job in jobs:
        results = json.loads((sweep / job / "results.json").read_text())
        assert results["world_size"] == 2 and results["global_steps"] == 4
        hashes.add(results["config_hash"])
    assert len(hashes) == 2
