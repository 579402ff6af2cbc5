"""``parallel.pipeline.timeline``: a pipelined run writes the measured timeline of one step (JSON and PNG);
off, nothing is recorded or written."""

from __future__ import annotations

import json

import pytest

from disttrain.launch.job import train
from disttrain.parallel.pipeline.timeline import (
    JSON_FILE,
    PNG_FILE,
    TIMELINE_COLOURS,
    ActionRecorder,
    build_timeline,
    write_timeline,
)
from tests.test_run import GPT_FAST

MICROBATCHES = 4
PIPE_RUN = [*GPT_FAST, "model.tie_weights=false", "parallel=pipeline", "trainer.devices=2", "trainer.max_steps=3",
            f"parallel.pipeline.microbatches={MICROBATCHES}", "trainer.limit_val_batches=0"]


def rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def test_a_pipelined_run_writes_the_measured_timeline_of_one_step(make_config, tmp_path):
    run_dir = tmp_path / "on"
    train(make_config([*PIPE_RUN, "parallel.pipeline.timeline=true", "plots=true"], run_dir))
    timeline = json.loads((run_dir / "plots" / JSON_FILE).read_text())
    assert timeline["schedule"] == "1f1b" and timeline["microbatches"] == MICROBATCHES and timeline["step"] == 2
    first, last = timeline["ranks"]
    assert (first["stages"], last["stages"]) == ([0], [1])
    for rank in (first, last):
        for kind in ("F", "B"):  # every microbatch on every stage, forward and backward, once each
            assert sorted(a["microbatch"] for a in rank["actions"] if a["type"] == kind) == list(range(MICROBATCHES))
        # a rank runs one action at a time, inside its schedule step
        spans = sorted((a["start_s"], a["end_s"]) for a in rank["actions"])
        assert all(start < end for start, end in spans)
        assert all(before[1] <= after[0] for before, after in zip(spans, spans[1:], strict=False))
        assert rank["step_start_s"] <= spans[0][0] and spans[-1][1] <= rank["step_end_s"] <= timeline["step_s"]
    on_first = {(a["type"], a["microbatch"]): a for a in first["actions"]}
    on_last = {(a["type"], a["microbatch"]): a for a in last["actions"]}
    for i in range(MICROBATCHES):  # measured, so causal: activations flow forward, gradients back
        assert on_last["F", i]["start_s"] >= on_first["F", i]["end_s"], (i, on_first["F", i], on_last["F", i])
        assert on_first["B", i]["start_s"] >= on_last["B", i]["end_s"], (i, on_first["B", i], on_last["B", i])
    assert 0 < timeline["bubble_fraction"] < 1

    pytest.importorskip("matplotlib")
    from tests.test_plots import coloured_pixels, drawn_pixels

    png = run_dir / "plots" / PNG_FILE
    assert drawn_pixels(png) > 0.02
    for kind in ("F", "B"):
        assert coloured_pixels(png, rgb(TIMELINE_COLOURS[kind])) > 200, kind


def test_off_by_default_nothing_is_written(make_config, tmp_path):
    run_dir = tmp_path / "off"
    train(make_config([*PIPE_RUN, "trainer.max_steps=2"], run_dir))
    assert not (run_dir / "plots" / JSON_FILE).exists() and not (run_dir / "plots" / PNG_FILE).exists()


class FakeStage:
    """The three compute methods of a torch PipelineStage, each taking a known time."""

    def __init__(self, stage_index: int) -> None:
        self.stage_index, self.device = stage_index, None

    def forward_one_chunk(self, chunk, args, kwargs=None, save_forward_output=True):
        return ("forward", chunk)

    def backward_one_chunk(self, chunk, loss=None, full_backward=True, last_backward=False):
        return ("backward", chunk, full_backward)

    def backward_weight_one_chunk(self, chunk, last_backward=False):
        return ("weight", chunk)


def test_the_recorder_times_only_the_recorded_step_and_restores_the_stage():
    stage = FakeStage(3)
    recorder = ActionRecorder([stage], schedule="zero_bubble")
    with recorder.recording():
        assert stage.forward_one_chunk(0, ()) == ("forward", 0)
        assert stage.backward_one_chunk(0, loss=None, full_backward=False) == ("backward", 0, False)
        assert stage.backward_weight_one_chunk(0, last_backward=True) == ("weight", 0)
        stage.backward_one_chunk(1)
    assert [(a["type"], a["stage"], a["microbatch"]) for a in recorder.actions] == \
        [("F", 3, 0), ("I", 3, 0), ("W", 3, 0), ("B", 3, 1)]
    assert not {"forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"} & set(vars(stage))
    stage.forward_one_chunk(1, ())  # after the step: torch's method, not timed
    assert len(recorder.actions) == 4


def test_without_plots_only_the_json_is_written(tmp_path):
    record = {"global_rank": 0, "host": "h", "stages": [0], "step_start_s": 10.0, "step_end_s": 11.0,
              "actions": [{"type": "F", "stage": 0, "microbatch": 0, "start_s": 10.25, "end_s": 10.75}]}
    timeline = build_timeline([record], {"schedule": "gpipe"})
    assert timeline["step_s"] == 1.0 and timeline["bubble_fraction"] == 0.5
    assert timeline["ranks"][0]["actions"][0]["start_s"] == 0.25
    assert write_timeline(timeline, tmp_path, draw=False) == [tmp_path / JSON_FILE]
    assert json.loads((tmp_path / JSON_FILE).read_text()) == timeline
