"""Hangs explained: a rank stopped (SIGSTOP) leaves the others waiting in a collective; each of them writes its stacks
and that collective, and the job's summary names the rank that has not reached it. SIGUSR2 to the job asks every
rank for the same report at any time."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest

from disttrain.fault.config import HUNG_EXIT
from disttrain.observe.hang import REPORTS_FOLDER
from tests.fault_runs import assert_no_orphans, run, signal_at


def stopped_run(tmp_path, preset: str) -> tuple[object, Path, dict]:
    """A run under ``preset`` whose rank 1 stops itself (SIGSTOP) after step 3: its result, reports folder and
    rank 0's report (the stopped rank writes none)."""
    run_dir = tmp_path / preset
    done = run([f"parallel={preset}", "fault_tolerance.hang_timeout_s=6", *signal_at(3, 1, signal.SIGSTOP)], run_dir)
    assert done.returncode == HUNG_EXIT, done.stderr[-3000:]
    reports = run_dir / "logs" / REPORTS_FOLDER
    assert sorted(path.name for path in reports.glob("*.json")) == ["rank0.json"]
    assert f"hang report: stacks of ranks [0] in {reports}" in done.stderr
    report = json.loads((reports / "rank0.json").read_text())
    assert any(name.startswith("disttrain-watchdog") for name in report["stacks"])
    assert_no_orphans(run_dir)
    return done, reports, report


def training_stack(report: dict) -> list[str]:
    """The lines of the training thread's stack, innermost last."""
    return next(stack for name, stack in report["stacks"].items() if name.startswith("MainThread")).splitlines()


def test_a_stopped_rank_leaves_the_others_in_a_recorded_collective_and_the_summary_names_it(tmp_path):
    done, reports, report = stopped_run(tmp_path, "zero3")
    waits_in = report["collective"]
    assert waits_in["waiting"] and waits_in["group_ranks"] == [0, 1]
    assert waits_in["kind"] in training_stack(report)[-2]  # the innermost frame: inside that collective
    line = next(line for line in done.stderr.splitlines() if " wait in " in line)
    assert line.startswith(f"disttrain:   ranks [0] wait in {waits_in['kind']} #{waits_in['seq']} (ranks [0, 1], ")
    assert line.endswith("not reached by rank 1 (no report: stopped, frozen or gone)")


@pytest.mark.slow
def test_under_ddp_the_summary_says_the_others_wait_in_the_backwards_exchange(tmp_path):
    done, reports, report = stopped_run(tmp_path, "ddp")
    assert report["training_thread_in"] == "_engine_run_backward"
    assert ("disttrain:   ranks [0] wait inside the backward (DDP's gradient all-reduce, made outside Python: not "
            "recorded); not reached by rank 1 (no report: stopped, frozen or gone)") in done.stderr


def test_sigusr2_to_the_job_brings_every_ranks_stacks_while_it_trains(tmp_path):
    run_dir = tmp_path / "asked"
    started = run_dir / "signal-sent"

    def ask_when_training() -> None:  # the job is this process (the run is made in it)
        deadline = time.monotonic() + 300
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        signal.raise_signal(signal.SIGUSR2)

    # rank 1 marks step 3 (signal 0: none); every rank sleeps between steps, so the run outlasts a few beats
    asker = threading.Thread(target=ask_when_training, daemon=True)
    asker.start()
    done = run(["parallel=ddp", "fault_tolerance.hang_timeout_s=20", *signal_at(3, 1, 0),
                "+callbacks.pause._target_=tests.slow_rank.SlowRank", "+callbacks.pause.rank=-1",
                "+callbacks.pause.phase=data", "+callbacks.pause.seconds=0.8"], run_dir)
    asker.join()
    assert done.returncode == 0, done.stderr[-3000:]
    reports = run_dir / "logs" / REPORTS_FOLDER
    assert sorted(path.name for path in reports.glob("*.json")) == ["rank0.json", "rank1.json"]
    assert f"hang report: stacks of ranks [0, 1] in {reports}" in done.stderr
    for rank in (0, 1):
        report = json.loads((reports / f"rank{rank}.json").read_text())
        assert report["reason"] == "asked by the job" and report["collectives_entered"] > 0
