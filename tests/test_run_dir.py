"""A run directory belongs to one job while it runs: a second job started there (the same ``hydra.run.dir``, a sweep
into the same ``hydra.sweep.dir``) is one ``Error:`` line and exit status 2 before it writes anything, Hydra's
``.hydra/`` record included; the lock goes with the job's process, however it ends, and the ranks of one job
share its directory. A directory that cannot be made or written is one line too, and default directories
started in the same second differ."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from disttrain.errors import ConfigError
from disttrain.launch.run_dir_lock import hold, release
from tests.conftest import ROOT, _captured_output, _run_train_py, train_cli_in_process

QUICK = ["trainer.max_steps=1", "trainer.limit_val_batches=1", "trainer.run_test=false", "logger=none", "plots=false"]


def holding(*folders: Path) -> subprocess.Popen:
    """Another job: a process that holds ``folders`` as a job holds its run directory, until it is killed."""
    code = ("import sys, time\nfrom disttrain.launch.run_dir_lock import hold\n"
            "for folder in sys.argv[1:]:\n    hold(folder, 'hydra.run.dir')\n"
            "print('held', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, folders)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_a_second_job_in_a_running_jobs_directory_is_refused_before_it_writes(tmp_path):
    run, sweep = tmp_path / "run", tmp_path / "sweep"
    first = holding(run, sweep)
    try:
        for folder in (run, sweep):  # what the first job wrote, Hydra's record among it
            (folder / ".hydra").mkdir()
            (folder / ".hydra" / "overrides.yaml").write_text("- optim.lr=0.1\n")
            (folder / "config.yaml").write_text("the first job's\n")
        before = {folder: snapshot(folder) for folder in (run, sweep)}
        for args, key, folder in ((["hydra.run.dir=run", "optim.lr=0.5", *QUICK], "hydra.run.dir", run),
                                  (["-m", "hydra.sweep.dir=sweep", "optim.lr=0.5,0.6", *QUICK], "hydra.sweep.dir",
                                   sweep)):
            proc = train_cli_in_process(args, tmp_path)
            assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"Error: {key}="), proc.stderr
            assert f"another job (process {first.pid} on " in lines[0], lines[0]
            assert snapshot(folder) == before[folder]  # nothing written, Hydra's .hydra/ left as the first job's
    finally:
        first.kill()  # SIGKILL: the process cannot let go itself; the kernel does
        first.wait()
    proc = train_cli_in_process(["hydra.run.dir=run", "resume=auto", *QUICK], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Run complete:" in proc.stdout
    assert hold(run, "hydra.run.dir") == run.resolve()  # the finished job let go of it in this process too
    release(run.resolve())


def test_a_fresh_job_over_an_ended_run_is_refused_and_a_resuming_one_continues_it(tmp_path):
    done = train_cli_in_process(["hydra.run.dir=run", *QUICK], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    before = snapshot(tmp_path / "run")
    again = train_cli_in_process(["hydra.run.dir=run", "optim.lr=0.5", *QUICK], tmp_path)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        "Error: hydra.run.dir='run' is invalid: a directory without a run, where resume is null; it holds an earlier "
        "run (its config.yaml): resume=auto continues that run, or choose another hydra.run.dir"]
    assert snapshot(tmp_path / "run") == before  # its config, Hydra's record, metrics and checkpoints untouched
    resumed = train_cli_in_process(["hydra.run.dir=run", "resume=auto", "trainer.max_steps=2",
                                    *QUICK[1:]], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]


@pytest.fixture(scope="module")
def held_elsewhere(tmp_path_factory):
    """A run directory that another process holds."""
    folder = tmp_path_factory.mktemp("held") / "run"
    first = holding(folder)
    yield folder
    first.kill()
    first.wait()


@pytest.mark.parametrize(("variables", "owner"), [
    ({}, True),
    ({"LOCAL_RANK": "0", "RANK": "0"}, True),
    ({"LOCAL_RANK": "1", "RANK": "1"}, False),  # torchrun: rank 1 shares rank 0's directory
    ({"LOCAL_RANK": "0", "RANK": "2"}, False),  # torchrun, a second node's first rank
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "1"}, False),
])
def test_only_the_jobs_owner_takes_the_directory(held_elsewhere, monkeypatch, variables, owner):
    for name in ("LOCAL_RANK", "RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    if owner:
        with pytest.raises(ConfigError, match="another job"):
            hold(held_elsewhere, "hydra.run.dir")
    else:
        assert hold(held_elsewhere, "hydra.run.dir") is None


@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir"])
def test_a_directory_that_cannot_be_made_is_one_line(tmp_path, key):
    (tmp_path / "a_file").write_text("")
    target = tmp_path / "a_file" / "run"
    args = [*(["-m", "optim.lr=0.5,0.6"] if key == "hydra.sweep.dir" else []), f"{key}={target}", *QUICK]
    proc = train_cli_in_process(args, tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"Error: {key}='{target}' is invalid: a directory this job can create and write; [Errno 20] Not a "
        f"directory: '{target}'"], proc.stderr


def test_a_directory_without_write_permission_is_one_line(tmp_path):
    (tmp_path / "closed").mkdir(mode=0o500)
    try:
        (tmp_path / "closed" / "probe").mkdir()
        pytest.skip("this process writes into a directory without write permission (root)")
    except PermissionError:
        pass
    proc = train_cli_in_process(["hydra.run.dir=closed/run", *QUICK], tmp_path)
    assert proc.returncode == 2 and "[Errno 13] Permission denied" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_default_directories_started_in_one_second_differ():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from disttrain.config import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        configs = [compose("train", return_hydra_config=True) for _ in range(2)]
    for key, prefix in (("hydra.run.dir", "outputs/runs/"), ("hydra.sweep.dir", "outputs/multirun/")):
        first, second = (str(OmegaConf.select(config, key)) for config in configs)
        assert first != second and first.startswith(prefix) and second.startswith(prefix)  # the README's <time>


def test_hydra_full_error_0_keeps_errors_one_line(tmp_path, monkeypatch):
    # only "1" asks Hydra for its traceback; "0" (or any other value) is the default, one line
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "optim.lr=abc"])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with _captured_output() as output:
        output.returncode = _run_train_py(())
    assert output.returncode == 2, output.stderr
    assert output.stderr.strip().splitlines() == ["Error: optim.lr='abc' is invalid: expected type float; Value 'abc' "
                                                  "of type 'str' could not be converted to Float"], output.stderr
    assert os.environ["HYDRA_FULL_ERROR"] == "0"  # the user's value, put back
