"""Under torchrun: ``--max-restarts`` restarts resume from the newest checkpoint and write nothing outside the run
directory, and two launchers acting as two nodes train together into one run directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from disttrain.parallel.process_group import free_port
from tests.conftest import ROOT
from tests.fault_runs import (
    KILL_AT,
    RUN,
    assert_no_orphans,
    assert_same_weights,
    logged_losses,
    signal_at,
    uninterrupted,
)


def torchrun(launcher: list[str], args: list[str], run_dir: Path, background: bool = False):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", *launcher, str(ROOT / "train.py"), *RUN, *args,
               f"hydra.run.dir={run_dir}"]
    cwd = run_dir.parent  # where nothing but the run directory may appear
    if background:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return uninterrupted("ddp", tmp_path_factory)


# 45-50 s of fresh interpreters (agent, two ranks, two restarted ranks). What it joins is guarded by fast tests:
# the ranks read the same restart count and agent store from the job's own supervisor, whose SIGKILL at the same
# step restarts bitwise (test_restart.py), and train.py under torchrun's agent trains the same run (below)
@pytest.mark.slow
def test_torchrun_max_restarts_resumes_bitwise(reference, tmp_path):
    run_dir = tmp_path / "run"
    done = torchrun(["--standalone", "--nproc-per-node=2", "--max-restarts=1"],
                    ["parallel=ddp", *signal_at(KILL_AT, 1, signal.SIGKILL)], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run_dir / "results.json").read_text())["fault_tolerance"]["restarts"] == 1
    assert logged_losses(run_dir) == logged_losses(reference)
    assert_same_weights(run_dir, reference)
    assert_no_orphans(run_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # the workers wrote nothing outside it


def test_two_launchers_as_two_nodes_train_one_run(reference, tmp_path):
    port = free_port()
    nodes = [torchrun(["--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes"],
                      ["parallel=ddp"], tmp_path / f"node{node}", background=True) for node in (0, 1)]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    run_dirs = [d for d in (tmp_path / "node0", tmp_path / "node1") if (d / "results.json").exists()]
    assert len(run_dirs) == 1  # one run directory, the first rank's
    results = json.loads((run_dirs[0] / "results.json").read_text())
    assert results["world_size"] == 2
    assert logged_losses(run_dirs[0]) == logged_losses(reference)
