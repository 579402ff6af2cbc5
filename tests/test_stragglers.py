"""Straggler detection: a rank slowed on purpose is named with its phase within three logging windows; a run
without one names none."""

from __future__ import annotations

import json
import random

import pytest
import torch

from disttrain.observe.stragglers import COLUMNS, JUDGED, PHASES, STRAGGLERS_FILE, StragglerDetector, slow_ranks
from tests.conftest import ROOT, train_cli_in_process

EVERY = 2
"""Steps per logging window: the first step (warm-up) is left out, so windows end at steps 2, 4, 6, ..."""
RUN = ["model=gpt", "model.flavour=micro", "data=pydocs", "data.block_size=32", "batch.global_size=8",
       f"trainer.max_steps={4 * EVERY}", f"trainer.log_every_n_steps={EVERY}", "trainer.limit_val_batches=0",
       "trainer.run_test=false", "logger=none", "callbacks=none", "trainer.devices=2", "plots=false",
       "checkpoint.save_last=false", "checkpoint.save_top_k=0", "energy=false",
       # the default ratio (1.2): with two ranks the median is their mean, so the delayed rank's fastest step must
       # exceed the other's by 0.5x it; the injected delay (0.3 s in every step) is ~10x this run's whole step, and
       # judged on fastest steps and spreads (``slow_ranks``) the load's noise names nobody however large it is
       "observe.straggler_windows=2"]
DELAY_S = 0.3
MICROBATCHES = 4
PIPELINE = ["model.tie_weights=false", f"parallel.pipeline.microbatches={MICROBATCHES}"]
"""A pipeline's options: stages cannot share a parameter; its backward delay is made once per micro-batch."""


def slowed(rank: int, phase: str, seconds: float = DELAY_S) -> list[str]:
    """Overrides adding ``tests.slow_rank.SlowRank`` on ``rank`` in ``phase``."""
    return ["+callbacks.slow._target_=tests.slow_rank.SlowRank", f"+callbacks.slow.rank={rank}",
            f"+callbacks.slow.phase={phase}", f"+callbacks.slow.seconds={seconds}"]


def run(tmp_path, *args: str, base: tuple[str, ...] = tuple(RUN)) -> tuple[dict, str, list[dict]]:
    """The run's ``stragglers`` section of results.json, its output and ``logs/stragglers.jsonl``'s lines."""
    result = train_cli_in_process([*base, *args, f"hydra.run.dir={tmp_path}"], ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    section = json.loads((tmp_path / "results.json").read_text())["stragglers"]
    log = tmp_path / "logs" / STRAGGLERS_FILE
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return section, result.stdout, lines


def row(**phases: float) -> list[float]:
    """A rank's window means in ``COLUMNS`` order (milliseconds; the step is their sum)."""
    values = [phases.get(name, 1.0) for name in COLUMNS[:-1]]
    return [*values, sum(values)]


def steady(*rows: list[float]) -> tuple[list[list[float]], list[list[float]], float]:
    """``slow_ranks``' arguments for ranks each of whose steps took its ``row``: fastest steps, spreads of 0 and the
    median step."""
    fastest = [[r[COLUMNS.index(name)] for name in JUDGED[:-1]] + [r[-1] - r[COLUMNS.index("collectives")]]
               for r in rows]
    return fastest, [[0.0] * len(JUDGED) for _ in rows], sorted(r[-1] for r in rows)[len(rows) // 2]


def test_the_rank_slow_earliest_in_the_step_is_named_not_the_one_waiting_for_it():
    # rank 1 fetches slowly; rank 0 waits for it in the gradient exchange, rank 2 in its forward (ZeRO-3)
    means = [row(data=1, collectives=50), row(data=50), row(data=1, forward=50)]
    assert slow_ranks(*steady(*means), 1.2) == {1: ("data", 50.0)}


def test_waiting_in_collectives_is_never_blamed_and_equal_ranks_name_none():
    assert slow_ranks(*steady(row(collectives=50), row(backward=50)), 1.2) == {1: ("backward", 50 / 25.5)}
    assert slow_ranks(*steady(row(forward=10), row(forward=10.5), row(forward=9.5)), 1.2) == {}


def test_a_phase_too_short_to_matter_is_not_named():
    # the optimiser 3x the median, but by less than a tenth of the step
    assert slow_ranks(*steady(row(forward=40, optimiser=0.5), row(forward=40, optimiser=1.5),
                              row(forward=40, optimiser=0.5)), 1.2) == {}


def judged_windows(steps_of_rank: list[list[list[float]]], windows: int = 2, every: int = 10) -> list[dict]:
    """Feed each rank's steps (seconds per phase, ``PHASES`` order) through a detector per rank at the default
    ratio, ``every`` steps a window (``trainer.log_every_n_steps``'s default), and judge each window's rows as rank
    0 does; the stragglers named."""
    detectors = [StragglerDetector(ratio=1.2, windows=windows, every=every, log_dir=None) for _ in steps_of_rank]
    judge = detectors[0]
    judge.hosts = [f"host{rank}" for rank in range(len(detectors))]
    judge._name = lambda rank, phase, since, step, means: judge.named.append({"rank": rank, "phase": phase})
    for step in range(len(steps_of_rank[0])):
        for detector, steps in zip(detectors, steps_of_rank, strict=True):
            detector._step = list(steps[step])
            detector._end_step()
            detector._window_steps += 1
        if (step + 1) % every == 0:
            table = torch.tensor([detector._window_row() for detector in detectors], dtype=torch.float64)
            for detector in detectors:
                detector._start_window()
            judge._judge_window(table, step + 2 - every, step + 1)
    return judge.named


BASE = [0.001, 0.010, 0.020, 0.005, 0.004]
"""One step's seconds per phase (``PHASES`` order) on every rank of a run without a slow rank."""


def noisy_steps(rng: random.Random, steps: int, delayed_share: float, every: int = 10) -> list[list[float]]:
    """``BASE`` steps of which about ``delayed_share`` are delayed in a phase that is not waiting by up to five
    whole steps (the machine's other processes, the scheduler): each window of ``every`` steps keeps a step that is
    not delayed."""
    out = []
    for step in range(steps):
        phases = list(BASE)
        if step % every and rng.random() < delayed_share:
            phase = rng.choice([i for i, name in enumerate(PHASES) if name != "collectives"])
            phases[phase] += rng.uniform(0.0, 5 * sum(BASE))
        out.append(phases)
    return out


def test_noise_that_spares_one_step_a_window_names_nobody_at_the_default_ratio():
    """By construction: a rank is judged on its fastest step of each window, so delays that leave any step of a
    window alone, however large and however many the others, name nobody at the default ratio (1.2) and windows
    (2). The same delays on every step of one rank by a steady amount name it."""
    rng = random.Random(0)
    for delayed_share in (0.3, 0.9):
        assert judged_windows([noisy_steps(rng, 200, delayed_share) for _ in range(4)]) == []  # every rank
        # one rank (sharing its core with another process), the others undisturbed
        assert judged_windows([noisy_steps(rng, 200, delayed_share * (rank == 1)) for rank in range(3)]) == []
    # forward delayed in every step by 6 to 8 ms: above a tenth of the 40 ms step and 1.2x the others' 10 ms, and
    # steadier (a spread of at most 2 ms) than its excess
    slow = [[b + (0.006 + 0.002 * rng.random()) * (i == 1) for i, b in enumerate(BASE)] for _ in range(40)]
    assert judged_windows([noisy_steps(rng, 40, 0.0), slow, noisy_steps(rng, 40, 0.0)]) == \
        [{"rank": 1, "phase": "forward"}]


def test_a_rank_delayed_every_step_by_more_than_it_varies_is_named_and_one_that_varies_more_is_not():
    """Delayed in every step, a rank whose delay varies by more than it exceeds the others' fastest step (the
    machine's noise, landing on every step) is not named; a steady delay of the same mean is."""
    # backward delayed 8 ms and 20 ms in turn: its fastest step exceeds the others' by 8 ms (above a tenth of the
    # step and 1.2x their 20 ms), its spread is 12 ms; steadily: 14 ms in each step
    varying = [[b + (0.008 if step % 2 else 0.020) * (i == 2) for i, b in enumerate(BASE)] for step in range(40)]
    steadily = [[b + 0.014 * (i == 2) for i, b in enumerate(BASE)] for _ in range(40)]
    others = [[list(BASE) for _ in range(40)] for _ in range(2)]
    assert judged_windows([others[0], varying, others[1]]) == []
    assert judged_windows([others[0], steadily, others[1]]) == [{"rank": 1, "phase": "backward"}]


# the data phase is timed the same way under every layout: ddp's case guards it, the others are slow
@pytest.mark.parametrize("preset,phase", [("ddp", "data"), ("ddp", "backward"),
                                          pytest.param("zero3", "data", marks=pytest.mark.slow),
                                          ("zero3", "backward"),
                                          pytest.param("pipeline", "data", marks=pytest.mark.slow),
                                          ("pipeline", "backward")])
def test_a_slowed_rank_is_named_with_its_phase_within_three_windows(tmp_path, preset, phase):
    # under a pipeline the backward delay is made per micro-batch: DELAY_S a step, as the others
    pipelined = preset == "pipeline"
    seconds = DELAY_S / MICROBATCHES if pipelined and phase == "backward" else DELAY_S
    section, out, lines = run(tmp_path, f"parallel={preset}", *(PIPELINE if pipelined else []),
                              *slowed(1, phase, seconds))
    assert [(entry["rank"], entry["phase"]) for entry in section["named"]] == [(1, phase)]
    assert section["named"][0]["named_at_step"] <= 1 + 3 * EVERY  # the third window's end at the latest
    assert lines == section["named"]
    assert "straggler: rank 1 (" in out and f"slower than the median rank in {phase}" in out
    by_rank = {entry["rank"]: entry for entry in section["ranks"]}
    assert by_rank[1]["slowest_phase"] == phase and by_rank[1]["slowest_phase_ms"] >= 1e3 * DELAY_S * 0.999
    assert "step by rank: rank 0 " in out and "stragglers named: rank 1" in out


@pytest.mark.slow
def test_a_rank_slow_in_a_split_backward_is_named_under_zero_bubble(tmp_path):
    """Interleaved zero bubble, two stages per rank: the backward runs as input- then weight-gradient halves, both
    marked; rank 1's delay lands in the input half of its first stage's backward."""
    section, out, _ = run(tmp_path, "parallel=pipeline", *PIPELINE, "parallel.pipeline.schedule=zero_bubble",
                          "parallel.pipeline.stages_per_rank=2", *slowed(1, "backward", DELAY_S / MICROBATCHES))
    assert [(entry["rank"], entry["phase"]) for entry in section["named"]] == [(1, "backward")]
    assert section["named"][0]["named_at_step"] <= 1 + 3 * EVERY
    assert {entry["rank"]: entry for entry in section["ranks"]}[1]["slowest_phase"] == "backward"


def test_a_run_without_a_slowed_rank_names_none(tmp_path):
    """At the default ratio (1.2) and windows (2): no rank is slower in every step of two windows by more than it
    varies (``slow_ranks``), whatever the machine's load does to some of the steps."""
    section, out, lines = run(tmp_path, "parallel=ddp", base=tuple(o for o in RUN if not o.startswith("observe.")))
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
    detector._name(1, "data", 2, 4, [row(data=1.0), row(data=3.0)])
    out = capsys.readouterr()
    assert "straggler: rank 1" in out.out
    assert f"could not write {tmp_path / 'logs' / STRAGGLERS_FILE}" in out.err
    assert detector.named and detector.named[0]["rank"] == 1


def test_a_pipeline_stage_marks_its_forward_backward_and_weight_backward_and_the_waits_between(monkeypatch):
    """Inside a schedule's training step the time before each stage action is waiting (``collectives``), the
    action's is its phase (a split backward's weight half too), and the time after the last is waiting; outside a
    training step (evaluation) nothing is marked, and an action inside another marks once."""
    from torch.distributed.pipelining import PipelineStage

    from disttrain.observe.phases import PHASE_MARKS
    from disttrain.parallel.pipeline.phases import PhaseLoss, PhaseStage

    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        monkeypatch.setattr(PipelineStage, name, lambda self, chunk, *args, **kwargs: chunk)
    stage = object.__new__(PhaseStage)  # its methods only: the marks, around torch's (replaced above)
    loss = PhaseLoss(lambda output, target: stage.forward_one_chunk(output))  # a loss calling a stage: nested
    marks: list[str] = []
    monkeypatch.setattr(PHASE_MARKS, "listener", marks.append)
    stage.forward_one_chunk(0)  # evaluation: no training step
    assert marks == []
    with PHASE_MARKS.schedule_step():
        assert stage.forward_one_chunk(0) == 0
        loss(1, None)
        stage.backward_one_chunk(0, full_backward=False)
        stage.backward_weight_one_chunk(0)
    assert marks == ["collectives", "forward", "collectives", "forward", "collectives", "backward",
                     "collectives", "backward", "collectives"]
