"""A killed, hung or preempted rank costs a restart, never the run: the restarted run is bitwise the
uninterrupted one (fp32, CPU, same world size), and nothing is left running."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disttrain.checkpoint.io import load_metadata
from disttrain.fault.config import HUNG_EXIT, PREEMPTED_EXIT
from tests.conftest import ROOT
from tests.fault_runs import (
    KILL_AT,
    RUN,
    STEPS,
    assert_killed_run_restarts_bitwise,
    assert_no_orphans,
    assert_same_weights,
    logged_losses,
    run,
    signal_at,
    uninterrupted,
)


# zero3 under a kill: test_resume.py resumes a sharded (HSDP) layout and test_async_save.py a zero3 one
@pytest.fixture(scope="module", params=["ddp", pytest.param("zero3", marks=pytest.mark.slow)])
def straight(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, uninterrupted(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted DDP run (one layout is enough for the tests that use it)."""
    return uninterrupted("ddp", tmp_path_factory)


def test_a_killed_rank_is_restarted_and_the_run_is_bitwise_the_uninterrupted_one(straight, tmp_path):
    preset, reference = straight
    run_dir = tmp_path / "killed"
    done = run([f"parallel={preset}", "fault_tolerance.max_restarts=1", *signal_at(KILL_AT, 1, signal.SIGKILL)],
               run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1 was killed by SIGKILL" in done.stderr
    assert "restarting all 2 ranks (1 of 1)" in done.stderr
    assert "Traceback" not in done.stderr  # the survivor's view of the death is one line, not a traceback
    assert "1 restart(s) (causes in logs/restarts.json)" in done.stdout
    results = json.loads((run_dir / "results.json").read_text())["fault_tolerance"]
    assert results["restarts"] == 1
    assert results["restart_causes"][0]["rank"] == 1 and results["restart_causes"][0]["exit"] == "was killed by SIGKILL"
    assert logged_losses(run_dir) == logged_losses(reference)
    assert len(logged_losses(run_dir)) == STEPS
    assert_same_weights(run_dir, reference)
    assert_no_orphans(run_dir)


def test_a_stopped_rank_is_named_and_the_job_ends(tmp_path):
    run_dir = tmp_path / "stopped"
    timeout = 6
    done = run(["parallel=ddp", f"fault_tolerance.hang_timeout_s={timeout}", *signal_at(3, 1, signal.SIGSTOP)], run_dir)
    assert done.returncode == HUNG_EXIT, done.stderr[-3000:]
    detected = re.search(r"hang: rank 1 has not answered for (\d+) s", done.stderr)
    assert detected is not None, done.stderr[-3000:]
    assert int(detected.group(1)) <= timeout + 5
    # the record names the hung rank, not the rank whose watchdog found it
    cause = json.loads((run_dir / "logs" / "restarts.json").read_text())[0]
    assert (cause["rank"], cause["found_by"], cause["code"]) == (1, 0, HUNG_EXIT), cause
    assert_no_orphans(run_dir)


def test_a_deadlocked_rank_is_found_by_the_missing_progress_and_restarted(reference, tmp_path):
    run_dir = tmp_path / "deadlocked"
    timeout = 6
    done = run(["parallel=ddp", f"fault_tolerance.hang_timeout_s={timeout}", "fault_tolerance.max_restarts=1",
                "+callbacks.sleep._target_=tests.crash.SleepAtStep", "+callbacks.sleep.step=7",
                "+callbacks.sleep.rank=1"], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    detected = re.search(r"hang: no rank made progress for (\d+) s", done.stderr)
    assert detected is not None and int(detected.group(1)) <= timeout + 5, done.stderr[-3000:]
    assert json.loads((run_dir / "results.json").read_text())["fault_tolerance"]["restarts"] == 1
    assert logged_losses(run_dir) == logged_losses(reference)
    assert_no_orphans(run_dir)


def test_sigterm_to_the_job_is_forwarded_and_every_rank_saves(reference, tmp_path):
    run_dir = tmp_path / "job-preempted"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    job = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *RUN, "parallel=ddp", "trainer.max_steps=400",
                            "+callbacks.clock._target_=tests.crash.StepClock", f"hydra.run.dir={run_dir}"],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    clock = run_dir / "steps.txt"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not clock.exists() or len(clock.read_text().splitlines()) < 3):
        time.sleep(0.1)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=120)
    assert job.returncode == PREEMPTED_EXIT, err[-3000:]
    saved = load_metadata(run_dir / "checkpoints" / "last.ckpt")["global_step"]
    assert 3 <= saved < 400
    assert_preempted_line(err, saved)
    assert_no_orphans(run_dir)


def test_sigterm_to_one_rank_saves_the_current_step_and_resume_is_bitwise(reference, tmp_path):
    run_dir = tmp_path / "preempted"
    done = run(["parallel=ddp", *signal_at(5, 1, signal.SIGTERM)], run_dir)
    assert done.returncode == PREEMPTED_EXIT, done.stderr[-3000:]
    # the signal came after step 5's reduce: all ranks agree at step 6 and save it (not a save point)
    assert load_metadata(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 6
    assert_preempted_line(done.stderr, 6)
    resumed = run(["parallel=ddp", "resume=auto"], run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert logged_losses(run_dir) == logged_losses(reference)
    assert_same_weights(run_dir, reference)
    assert_no_orphans(run_dir)


def test_one_rank_preempted_says_the_same_line(tmp_path):
    run_dir = tmp_path / "preempted"
    done = run(["trainer.devices=1", *signal_at(5, 0, signal.SIGTERM)], run_dir, in_process=False)
    assert done.returncode == PREEMPTED_EXIT, done.stderr[-3000:]
    assert load_metadata(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 6
    assert_preempted_line(done.stderr, 6)


def assert_preempted_line(stderr: str, step: int) -> None:
    """A preemption ends with one line, the same for one rank and many, and it is no error."""
    line = (f"Preempted at step {step}: every rank saved a checkpoint and stopped; run the same command with "
            "resume=auto to continue")
    assert stderr.rstrip().splitlines()[-1] == line, stderr[-3000:]
    assert "Error" not in stderr, stderr[-3000:]


def test_with_sparse_rows_ranks_agree_on_logged_steps_only_and_still_stop_together(reference, tmp_path):
    # rows every 4 steps: no collective of ours on other steps; the signal after step 5 is acted on at step 8
    run_dir = tmp_path / "preempted"
    sparse = ["parallel=ddp", "trainer.log_every_n_steps=4", "+callbacks.count._target_=tests.crash.CountCollectives"]
    done = run([*sparse, *signal_at(5, 1, signal.SIGTERM)], run_dir)
    assert done.returncode == PREEMPTED_EXIT, done.stderr[-3000:]
    assert load_metadata(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 8
    resumed = run([*sparse, "resume=auto"], run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    counts = json.loads((run_dir / "collectives-rank1.json").read_text())  # the resumed steps 9..12
    assert counts == [0, 0, 0, 1], counts
    assert_same_weights(run_dir, reference)
    assert_no_orphans(run_dir)


@pytest.mark.slow  # 45 s of repeated preemptions; one preemption at a step, a SIGKILL mid-step and one mid-save
# (test_checkpoint_recovery.py) are the fast tests of the same path
def test_sigterm_at_ten_random_moments_restarts_and_finishes_bitwise(tmp_path):
    # ten attempts, each with SIGTERM to a rank drawn at random after a random delay (in a step, a collective
    # or a checkpoint), over a run long enough for most of them to land before training ends
    longer = ["parallel=ddp", "trainer.max_steps=60"]
    reference = tmp_path / "straight"
    assert run(longer, reference).returncode == 0
    run_dir = tmp_path / "trials"
    done = run([*longer, "fault_tolerance.max_restarts=10",
                "+callbacks.term._target_=tests.crash.SignalAtRandomMoments", "+callbacks.term.trials=10",
                "+callbacks.term.seed=7", "+callbacks.term.max_delay_s=0.4"], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    # a signal drawn after its attempt finished training is not sent; one sent after the last step's agreement
    # has no step left to stop at, and the run simply finishes (measured: 9 sent, 8 restarts)
    sent = len(list(run_dir.glob("sigterm-*")))
    results = json.loads((run_dir / "results.json").read_text())["fault_tolerance"]
    assert 6 <= results["restarts"] <= sent
    assert {cause["exit"] for cause in results["restart_causes"]} == {f"was preempted (exit {PREEMPTED_EXIT})"}
    assert logged_losses(run_dir) == logged_losses(reference)
    assert_same_weights(run_dir, reference)
    assert_no_orphans(run_dir)


# onebit's residuals travel in the same per-rank exchange state as PowerSGD's; the fast run restarts PowerSGD
@pytest.mark.parametrize("codec", [pytest.param("onebit", marks=pytest.mark.slow), "powersgd"])
def test_a_restarted_run_with_compressed_gradients_continues_the_residuals_bitwise(tmp_path, codec):
    # both are deterministic, and their state (error-feedback residuals; PowerSGD's warm-started factors; the
    # exchange count, past the 2-step warm-up at the step-4 save the restart resumes from) changes every update
    assert_killed_run_restarts_bitwise(["parallel=ddp", f"comm={codec}", "comm.warmup_steps=2", "comm.rank=4"], 1,
                                       tmp_path)  # GPT micro: rank 14 at most


def test_a_store_that_goes_away_is_said_at_once_not_as_a_timeout(tmp_path):
    # a job killed with SIGKILL takes its rendezvous store with it: a rank's watchdog finds the connection closed at
    # once and says so, instead of that the store "did not answer within 300 s"
    host = ("import sys, time\nfrom datetime import timedelta\nfrom torch.distributed import TCPStore\n"
            "store = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))\n"
            "print(store.port, flush=True)\ntime.sleep(600)\n")
    server = subprocess.Popen([sys.executable, "-c", host], stdout=subprocess.PIPE, text=True)
    port = server.stdout.readline().strip()
    watch = ("import time\nfrom disttrain.fault.watchdog import RankWatchdog\n"
             "RankWatchdog(300).start(0, 2)\ntime.sleep(2)\nprint('beating', flush=True)\ntime.sleep(120)\n")
    rank = subprocess.Popen([sys.executable, "-c", watch], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
    try:
        assert rank.stdout.readline().strip() == "beating"
        server.kill()
        server.wait()
        _, err = rank.communicate(timeout=60)
    finally:
        server.kill()
        rank.kill()
    assert rank.returncode == HUNG_EXIT
    last = err.strip().splitlines()[-1]  # after torch's own C++ warnings of the broken socket
    assert f"the rendezvous store at 127.0.0.1:{port} closed the connection after" in last, err
