"""Ranks forked from the fork server start as ``python -m disttrain.rank.run`` started at that moment does: the
job's environment, working directory and import path of now (not the server's), the thread count it sets,
rank 0 on the job's output and the others in their logs, and no second run of the job's main script."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from disttrain.config.typed import schema_node
from disttrain.launch.cli import _may_start_ranks
from disttrain.launch.fork_server import warm_fork_server
from disttrain.launch.job import train
from tests.conftest import ROOT, compose_config
from tests.test_listening import listening_addresses

SHORT = ["parallel=ddp", "trainer.devices=2", "trainer.max_steps=2", "trainer.limit_val_batches=1",
         "trainer.limit_test_batches=1", "logger=none"]


class RecordProcess(pl.Callback):
    """Each rank writes what its process looks like to ``process-rank<N>.json`` in the run, and says hello."""

    def on_train_start(self, trainer: pl.Trainer, *_: Any) -> None:
        import importlib

        try:
            importlib.import_module("module_beside_the_job")
            imported = True
        except ImportError:
            imported = False
        record = {"mark": os.environ.get("DISTTRAIN_TEST_MARK"), "cwd": os.getcwd(), "imported": imported,
                  "threads": torch.get_num_threads(), "pid": os.getpid(), "frozen": gc.get_freeze_count(),
                  "collects": gc.isenabled(),
                  "schema_nodes": schema_node.cache_info().currsize,
                  "digits_read_before_start": "disttrain.launch.warm_data" in sys.modules,
                  "store_listens_on": sorted(listening_addresses(int(os.environ["MASTER_PORT"]))),
                  "watches_the_job": "disttrain-job-watch" in {thread.name for thread in threading.enumerate()}}
        (Path(trainer.default_root_dir) / f"process-rank{trainer.global_rank}.json").write_text(json.dumps(record))
        print(f"hello from rank {trainer.global_rank}", flush=True)


@pytest.mark.parametrize("rank_start", ["fork_server", "interpreter"])
def test_a_rank_has_the_jobs_environment_directory_and_threads_of_now(tmp_path, monkeypatch, capfd, rank_start):
    from disttrain.launch.schema_nodes import SCHEMAS  # here, not above: a new interpreter's rank imports this module

    warm_fork_server()  # started before the job changes anything below
    (tmp_path / "module_beside_the_job.py").write_text("VALUE = 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DISTTRAIN_TEST_MARK", "set after the server started")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # for this module's callback in a new interpreter
    run_dir = tmp_path / "run"
    train(compose_config([*SHORT, f"trainer.rank_start={rank_start}",
                          "+callbacks.record._target_=tests.test_worker_start.RecordProcess"], run_dir))
    records = [json.loads((run_dir / f"process-rank{rank}.json").read_text()) for rank in (0, 1)]
    for record in records:
        assert record["mark"] == "set after the server started"
        assert record["cwd"] == str(tmp_path) and record["imported"], record
        assert record["threads"] == 2 and record["pid"] != os.getpid()
        # a forked rank's collections leave the server's objects alone (fewer pages copied: a two-rank two-step
        # DDP run took 3.42 -> 2.81 s of CPU, mean of four runs each)
        assert record["frozen"] > 100_000 if rank_start == "fork_server" else record["frozen"] == 0, record
        # the server imports with the collector off; its ranks collect their own garbage
        assert record["collects"], record
        # every config schema's node built once in the server, not again in each rank (a two-rank four-step DDP run
        # of GPT micro: 1.43 -> 1.21 s of CPU); a new interpreter builds those its run names
        forked = rank_start == "fork_server"
        assert record["schema_nodes"] == len(SCHEMAS) if forked else record["schema_nodes"] < len(SCHEMAS), record
        # the digits read in the server, not again in each rank (27 ms of CPU in each)
        assert record["digits_read_before_start"] == forked, record
        # the job's rendezvous store: loopback, not every interface, as every rank runs on this machine
        assert record["store_listens_on"] == ["127.0.0.1"], record
        # a forked rank ends with its job (a killed job's ranks would train on until their watchdog saw it)
        assert record["watches_the_job"] == forked, record
    assert "hello from rank 0" in capfd.readouterr().out
    assert "hello from rank 1" in (run_dir / "logs" / "rank1.log").read_text()


def test_a_script_without_a_main_guard_runs_once(tmp_path):
    script = tmp_path / "my_training.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from tests.conftest import compose_config
from disttrain.launch.job import train

print("the script ran", flush=True)
train(compose_config({SHORT!r} + ["trainer.run_test=false"], {str(tmp_path / "run")!r}))
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("the script ran") == 1, proc.stdout[-2000:]
    assert "Run complete: 2 steps on 2 rank(s)" in proc.stdout


@pytest.mark.parametrize(("overrides", "warms"), [
    (["parallel=zero3", "trainer.devices=1"], False),
    (["parallel=single"], False),
    (["parallel=zero3", "trainer.devices=2"], True),
    (["parallel=ddp", "trainer.devices=2"], True),
    (["parallel=ddp", "trainer.devices=2", "mode=plan"], False),
])
def test_the_fork_server_is_warmed_only_for_runs_of_several_ranks(tmp_path, overrides, warms):
    """A one-rank run trains in the job's process: a fork server warmed beside it would import torch and
    Lightning through the run's first seconds (on 2 cores a one-rank ZeRO-3 run's first 60 steps took 3.5x as
    long) for nothing."""
    assert _may_start_ranks(compose_config(overrides, tmp_path / "run")) is warms


def test_the_job_sees_a_rank_end_when_it_ends_not_a_poll_interval_later():
    import time

    from disttrain.launch.supervisor import wait_for_an_exit

    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = time.monotonic()
        while quick.poll() is None:
            wait_for_an_exit([quick, slow], 20.0)
        assert time.monotonic() - started < 10  # woken by the exit, not by the 20 s timeout
        started = time.monotonic()
        wait_for_an_exit([quick, slow], 0.3)  # a rank that has ended does not wake it again
        assert 0.25 < time.monotonic() - started < 10
    finally:
        slow.kill()
        slow.wait()
    started = time.monotonic()
    wait_for_an_exit([quick, slow], 20.0)  # nothing runs any more: nothing to wait for
    assert time.monotonic() - started < 10


def test_a_forked_rank_ends_as_soon_as_its_job_is_killed():
    # what a forked rank runs first (its wiring: the record above), here in a process of its own
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    rank = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                             "from disttrain.launch.fork_server import _end_with_the_job\n"
                             "_end_with_the_job(int(sys.argv[1]))\nprint('started', flush=True)\ntime.sleep(120)",
                             str(job.pid)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert rank.stdout.readline().strip() == "started"
        job.kill()
        job.wait()
        assert rank.wait(timeout=30) == -9  # killed at once, not after its two minutes
    finally:
        for proc in (job, rank):
            proc.kill()
            proc.wait()
