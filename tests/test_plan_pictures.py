"""The planner's pictures as a reader sees them: every term and moment of a plan's memory on a scale of its own
(the capacity beside it), the layouts ``parallel=auto`` weighed with the chosen one and those that do not fit
marked, and a dry run's measured moments beside the plan's. Each drawing returns what it put on the figure."""

from __future__ import annotations

from dataclasses import replace
from importlib.util import find_spec
from pathlib import Path

import pytest

from disttrain.config.validation import validate
from disttrain.plan import pictures
from disttrain.plan.layout import Layout
from disttrain.plan.pictures import CHOSEN, MEASURED, PLANNED, TERM_LABELS, TOO_BIG, draw_dry_run, draw_plan_memory
from disttrain.plan.units import human_bytes
from tests.conftest import compose_config
from tests.test_plan import TEXT, _inputs, _model

HAS_MATPLOTLIB = find_spec("matplotlib") is not None
"""Pictures are drawn only where matplotlib is installed (it is optional)."""
pytestmark = pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib draws the pictures")


def to_hex(colour: str) -> str:
    """A colour as ``#rrggbb`` (as ``Bar.colour`` holds it)."""
    from matplotlib.colors import to_hex as hex_of

    return hex_of(colour)

TINY_GPT = ["model=gpt", "model.flavour=nano", "data=synthetic_tokens", "data.vocab_size=96", "data.block_size=64",
            "plan.profile=h100_sxm", "plots=true"]
"""The model ``tests.test_plan`` plans, as a run composes it."""


@pytest.fixture(scope="module")
def zero3_plan():
    """GPT nano on 2 ZeRO-3 ranks of H100s: a peak of megabytes on a device of 80 GB."""
    net = _model({"name": "gpt", "flavour": "nano"}, TEXT)
    return _inputs(net, TEXT, 8).estimate(Layout(dp_shard=2, zero_stage=3, micro_size=8))


def test_the_memory_picture_draws_every_term_and_moment_on_a_scale_of_its_own(zero3_plan, tmp_path: Path) -> None:
    e = zero3_plan
    drawn = draw_plan_memory(e, tmp_path / "plan_memory.png")
    assert drawn.path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    terms = [f"{label} (checkpointing none)" if key == "activations" else label for key, label in TERM_LABELS.items()]
    assert drawn.rows("term") == terms
    for key in TERM_LABELS:
        share = 100 * e.memory[key] / e.total_bytes
        assert f"{human_bytes(e.memory[key])}, {share:.0f}% of the peak" in drawn.texts or \
            f"{human_bytes(e.memory[key])}, {share:.2g}% of the peak" in drawn.texts
    peak_moment = max(e.phases, key=e.phases.get)
    moments = drawn.rows("moment")
    assert len(moments) == len(e.phases) and f"{pictures.MOMENT_LABELS[peak_moment]} (peak)" in moments
    # the axis is scaled to the peak, not to the device: the peak's bar spans most of it (scaled to 80 GB, as the
    # picture once was, it spanned a ten-thousandth)
    [peak] = [bar for bar in drawn.bars if bar.row.endswith("(peak)")]
    assert peak.share > 0.5
    assert f"capacity 80 GB per rank: off this scale ({80e9 / e.total_bytes:,.0f}x the peak)" in drawn.texts
    assert drawn.title == (f"{e.layout.describe()} on 2 rank(s)\npeak {human_bytes(e.total_bytes)} "
                           f"({pictures.MOMENT_LABELS[peak_moment]}) of 80 GB per rank: fits, "
                           f"{human_bytes(80e9 - e.total_bytes)} headroom")


def test_a_plan_that_does_not_fit_draws_the_capacity_on_its_scale(zero3_plan, tmp_path: Path) -> None:
    e = replace(zero3_plan, capacity=zero3_plan.total_bytes * 0.8)
    drawn = draw_plan_memory(e, tmp_path / "plan_memory.png")
    assert f"capacity {human_bytes(e.capacity)}" in drawn.texts
    assert not any("off this scale" in text for text in drawn.texts)
    assert drawn.title.endswith(f"DOES NOT FIT: {human_bytes(e.total_bytes - e.capacity)} over")


@pytest.fixture(scope="module")
def auto_plan(tmp_path_factory: pytest.TempPathFactory):
    """``mode=plan parallel=auto`` of GPT nano on 2 ranks of 12 MB each (some layouts do not fit), planned and
    printed as the command does; the run, what ``print_plan`` wrote and how often the layouts were weighed."""
    from disttrain.plan import planner

    run_dir = tmp_path_factory.mktemp("auto")
    weighed = []
    with pytest.MonkeyPatch.context() as patch:
        def counted(*args, **kwargs):
            weighed.append(args)
            return weigh(*args, **kwargs)

        weigh = planner.weigh_layouts
        patch.setattr(planner, "weigh_layouts", counted)
        run = validate(compose_config([*TINY_GPT, "mode=plan", "parallel=auto", "trainer.devices=2",
                                       "batch.global_size=16", "plan.memory_gb=0.012"], run_dir))
        planner.print_plan(run)
    return run, run_dir, len(weighed)


def test_parallel_auto_plans_draw_the_layouts_it_weighed(auto_plan) -> None:
    run, run_dir, weighed = auto_plan
    assert weighed == 1  # validation weighed them; the picture draws that choice, handed down, not a second one
    for name in ("plan.json", "plots/plan_memory.png", "plots/plan_candidates.png"):
        assert (run_dir / name).is_file(), name


def test_the_candidates_picture_marks_the_chosen_layout_and_those_that_do_not_fit(auto_plan, tmp_path: Path) -> None:
    choice = auto_plan[0].choice
    assert choice.best is not None and choice.too_big  # the premise: a choice, and layouts that do not fit
    drawn = pictures.draw_candidates(choice, tmp_path / "plan_candidates.png")
    fitting, too_big = pictures.shown_candidates(choice)
    rows = drawn.rows("memory per rank")
    assert drawn.rows("step time") == rows and len(rows) == len(fitting) + len(too_big)
    chosen = [row for row in rows if row.endswith("(chosen)")]
    assert chosen == [f"{choice.best.layout.describe()} (chosen)"]
    assert {bar.colour for bar in drawn.bars if bar.row == chosen[0]} == {to_hex(CHOSEN)}
    refused = [row for row in rows if row.endswith("(does not fit)")]
    assert refused == [f"{e.layout.describe()} (does not fit)" for e in too_big] == rows[len(fitting):]
    assert {bar.colour for bar in drawn.bars if bar.row in refused} == {to_hex(TOO_BIG)}
    # those that fit, fastest first, each bar as long as its prediction
    times = [bar.value for bar in drawn.bars if bar.series == "step time"][:len(fitting)]
    assert times == sorted(times) and times == pytest.approx([e.step_s * 1e3 for e in fitting])
    memory = [bar.value for bar in drawn.bars if bar.series == "memory per rank"]
    assert memory == pytest.approx([e.total_bytes / 1e6 for e in [*fitting, *too_big]])
    assert f"chose {choice.best.layout.describe()}" in drawn.title
    assert f"capacity {human_bytes(choice.best.capacity)}" in drawn.texts


def check_dry_run_picture(result: dict, folder: Path) -> None:
    """What a dry run's picture must show of ``result`` (``dryrun.json``): the peak and every moment planned or
    measured, the planned bar beside the measured one, the measured one with its ratio to the plan."""
    drawn = draw_dry_run(result, folder / "dryrun_memory.png")
    measured, planned = result["measured_moments_bytes"], result["planned_moments_bytes"]
    in_order = list(pictures.MOMENT_LABELS)
    assert drawn.rows("planned") == ["peak", *[pictures.MOMENT_LABELS[m] for m in in_order if m in planned]]
    assert drawn.rows("measured") == ["peak", *[pictures.MOMENT_LABELS[m] for m in in_order if m in measured]]
    assert {bar.colour for bar in drawn.bars if bar.series == "planned"} == {to_hex(PLANNED)}
    assert {bar.colour for bar in drawn.bars if bar.series == "measured"} == {to_hex(MEASURED)}
    ratio = result["measured_peak_bytes"] / result["planned_peak_bytes"]
    assert f"measured {human_bytes(result['measured_peak_bytes'])}  (measured / planned {ratio:.3f})" in drawn.texts
    assert ("not measured" in drawn.texts) == bool(set(planned) - set(measured))
    assert max(bar.share for bar in drawn.bars if bar.row == "peak") > 0.5
    assert "communication absent" in drawn.title
    assert f"rank {result['rank']} of {result['world_size']}" in drawn.title
