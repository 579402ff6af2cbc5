"""Straggler detection: a rank slowed on purpose is named with its phase within three logging windows; a run
without one names none."""

from __future__ import annotations

import json

import pytest

from disttrain.observe.stragglers import COLUMNS, STRAGGLERS_FILE, slow_ranks
from tests.conftest import ROOT, train_cli_in_process

EVERY = 2
"""Steps per logging window: the first step (warm-up) is left out, so windows end at steps 2, 4, 6, ..."""
RUN = ["model=gpt", "model.flavour=micro", "data=pydocs", "data.block_size=32", "batch.global_size=8",
       f"trainer.max_steps={4 * EVERY}", f"trainer.log_every_n_steps={EVERY}", "trainer.limit_val_batches=0",
       "trainer.run_test=false", "logger=none", "callbacks=none", "trainer.devices=2", "plots=false",
       "checkpoint.save_last=false", "checkpoint.save_top_k=0", "energy=false",
       # With two ranks the median is their mean, so a rank is at most 2x the median: 1.8 needs one rank 9x the
       # other in a phase. The injected delay (0.2 s) is ~7x this run's whole step; unloaded ranks differed by at
       # most 2.5x in any phase of a window on the shared 2-core test machine.
       "observe.straggler_ratio=1.8", "observe.straggler_windows=2"]
DELAY_S = 0.2


def slowed(rank: int, phase: str) -> list[str]:
    """Overrides adding ``tests.slow_rank.SlowRank`` on ``rank`` in ``phase``."""
    return ["+callbacks.slow._target_=tests.slow_rank.SlowRank", f"+callbacks.slow.rank={rank}",
            f"+callbacks.slow.phase={phase}", f"+callbacks.slow.seconds={DELAY_S}"]


def run(tmp_path, *args: str) -> tuple[dict, str, list[dict]]:
    """The run's ``stragglers`` section of results.json, its output and ``logs/stragglers.jsonl``'s lines."""
    result = train_cli_in_process([*RUN, *args, f"hydra.run.dir={tmp_path}"], ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    section = json.loads((tmp_path / "results.json").read_text())["stragglers"]
    log = tmp_path / "logs" / STRAGGLERS_FILE
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return section, result.stdout, lines


def row(**phases: float) -> list[float]:
    """A rank's window means in ``COLUMNS`` order (milliseconds; the step is their sum)."""
    values = [phases.get(name, 1.0) for name in COLUMNS[:-1]]
    return [*values, sum(values)]


def test_the_rank_slow_earliest_in_the_step_is_named_not_the_one_waiting_for_it():
    # rank 1 fetches slowly; rank 0 waits for it in the gradient exchange, rank 2 in its forward (ZeRO-3)
    means = [row(data=1, collectives=50), row(data=50), row(data=1, forward=50)]
    assert slow_ranks(means, 1.2) == {1: ("data", 50.0)}


def test_waiting_in_collectives_is_never_blamed_and_equal_ranks_name_none():
    assert slow_ranks([row(collectives=50), row(backward=50)], 1.2) == {1: ("backward", 50 / 25.5)}
    assert slow_ranks([row(forward=10), row(forward=10.5), row(forward=9.5)], 1.2) == {}


def test_a_phase_too_short_to_matter_is_not_named():
    # the optimiser 3x the median, but by less than a tenth of the step
    assert slow_ranks([row(forward=40, optimiser=0.5), row(forward=40, optimiser=1.5),
                       row(forward=40, optimiser=0.5)], 1.2) == {}


@pytest.mark.parametrize("preset,phase", [("ddp", "data"), ("ddp", "backward"), ("zero3", "data"),
                                          ("zero3", "backward"), ("pipeline", "data"),
                                          ("pipeline", "backward")])
def test_a_slowed_rank_is_named_with_its_phase_within_three_windows(tmp_path, preset, phase):
    untied = ["model.tie_weights=false"] if preset == "pipeline" else []  # stages cannot share a parameter
    section, out, lines = run(tmp_path, f"parallel={preset}", *untied, *slowed(1, phase))
    assert [(entry["rank"], entry["phase"]) for entry in section["named"]] == [(1, phase)]
    assert section["named"][0]["named_at_step"] <= 1 + 3 * EVERY  # the third window's end at the latest
    assert lines == section["named"]
    assert "straggler: rank 1 (" in out and f"slower than the median rank in {phase}" in out
    by_rank = {entry["rank"]: entry for entry in section["ranks"]}
    assert by_rank[1]["slowest_phase"] == phase and by_rank[1]["slowest_phase_ms"] >= 1e3 * DELAY_S
    assert "step by rank: rank 0 " in out and "stragglers named: rank 1" in out


def test_a_run_without_a_slowed_rank_names_none(tmp_path):
    section, out, lines = run(tmp_path, "parallel=ddp")
    assert section["named"] == [] and lines == []
    assert len(section["ranks"]) == 2 and "no straggler" in out


def test_a_ratio_of_one_or_less_is_refused_before_ranks_start(tmp_path):
    result = train_cli_in_process([*RUN, "observe.straggler_ratio=1.0", f"hydra.run.dir={tmp_path}"], ROOT)
    assert result.returncode == 2
    assert "observe.straggler_ratio=1.0 is invalid: a number above 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_record_the_disk_refuses_costs_a_warning_not_the_rank(tmp_path, capsys):
    """Naming a straggler where ``logs/`` cannot be written (a full disk; here a file in the way of the folder)
    prints the line and one warning naming the file, and the detector goes on."""
    from disttrain.observe.stragglers import StragglerDetector

    (tmp_path / "logs").write_text("in the way")
    detector = StragglerDetector(ratio=1.2, windows=1, every=1, log_dir=tmp_path / "logs")
    detector.hosts = ["a", "b"]
    detector._name(1, "data", 1.5, 2, 4, [row(data=1.0), row(data=3.0)])
    out = capsys.readouterr()
    assert "straggler: rank 1" in out.out
    assert f"could not write {tmp_path / 'logs' / STRAGGLERS_FILE}" in out.err
    assert detector.named and detector.named[0]["rank"] == 1
