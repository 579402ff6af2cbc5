"""``plan.objective``: ``parallel=auto`` minimising the predicted step time (the default) or the predicted energy per
token, and the choice line that says what the other objective picks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disttrain.config.validation import validate
from disttrain.errors import ConfigError
from disttrain.plan.auto import choose
from disttrain.plan.hardware import PROFILES
from tests.conftest import compose_config

MINI_GPT = ["model=gpt", "model.flavour=mini", "data=synthetic_tokens", "data.vocab_size=512",
            "data.block_size=256", "batch.global_size=64", "trainer.devices=8", "parallel=auto", "mode=plan",
            "plan.profile=h100_sxm"]
"""A 6-layer GPT of width 384 on 8 stated H100s: large micro-batches of context parallelism launch fewer, larger
kernels per token (less compute: the per-launch overhead is paid by more tokens), at the price of the key and value
gathers it exposes (more waiting)."""


def gpt_inputs(flavour: str, block_size: int, idle_watts: float | None):
    """Plan inputs of a GPT of ``flavour`` on sequences of ``block_size`` tokens, on a stated H100 whose devices
    draw ``idle_watts`` while they wait."""
    from omegaconf import OmegaConf

    from disttrain.config.typed import model_typed
    from disttrain.data.spec import DataSpec
    from disttrain.models import MODELS
    from disttrain.parallel.config import ParallelConfig
    from disttrain.parallel.model_checks import model_on_meta
    from disttrain.plan.planner import plan_inputs

    spec = DataSpec("text", vocab_size=512, block_size=block_size)
    net = model_on_meta(model_typed(OmegaConf.create({"name": "gpt", "flavour": flavour}), MODELS), spec)
    profile = replace(PROFILES["h100_sxm"], idle_watts=idle_watts)
    return plan_inputs(net, spec, 1, ParallelConfig(), OmegaConf.create({"name": "adamw"}), "bf16-mixed", profile)


@pytest.mark.slow
def test_energy_picks_the_layout_that_computes_less_and_waits_more_where_waiting_is_cheap() -> None:
    """With devices drawing nothing while they wait, energy per token is power x the busiest rank's compute: the
    energy objective takes the layout with the least compute, time the one with the least compute + waiting."""
    inputs = gpt_inputs("mini", 256, idle_watts=0.0)
    choice = choose(inputs, 8, 64, len(inputs.stats.pipeline_units), objective="energy")
    by_time, by_energy = choice.by_objective["time"], choice.by_objective["energy"]
    assert choice.best is by_energy and by_energy.layout != by_time.layout
    # measured here: time dp_replicate=8 micro=8x1 (5.98 ms, 2.04 mJ/token), energy cp=8 micro=64x1 (6.83 ms,
    # 1.90 mJ/token)
    assert by_time.step_s < by_energy.step_s and by_energy.joules_per_token < by_time.joules_per_token
    assert by_energy.compute_s < by_time.compute_s
    assert by_energy.step_s - by_energy.compute_s > by_time.step_s - by_time.compute_s  # it waits longer
    assert f"(objective energy; time would pick {by_time.layout.describe()}: " in choice.reason()


def test_without_an_idle_figure_energy_follows_the_step_time() -> None:
    """Every layout of one world draws the same power for its whole step and moves the same tokens per step, so
    joules per token are step time x a constant: both objectives pick the same layout."""
    inputs = gpt_inputs("micro", 32, idle_watts=None)
    choice = choose(inputs, 4, 32, len(inputs.stats.pipeline_units))
    per_second = [e.joules_per_token / e.step_s for e in choice.ranked]
    assert len(per_second) > 1 and max(per_second) == pytest.approx(min(per_second), rel=1e-12)
    assert choice.by_objective["time"] is choice.by_objective["energy"] is choice.best
    assert "(objective time; energy would pick the same)" in choice.reason()


@pytest.mark.slow
def test_the_choice_line_of_a_run_names_both_picks(tmp_path) -> None:
    run = validate(compose_config([*MINI_GPT, "plan.idle_watts=100", "plan.objective=energy"], tmp_path))
    notice = next(n for n in run.notices if n.startswith("parallel=auto"))
    assert "(objective energy; time would pick dp_replicate=8 micro=8x1: " in notice, notice
    assert "mJ/token" in notice and run.dims.cp == 8


@pytest.mark.parametrize(("overrides", "message"), [
    (["plan.objective=speed"], r"plan.objective='speed' is invalid: one of \['time', 'energy'\]"),
    (["plan.watts=0"], r"plan.watts=0.0 is invalid: a positive power per device in watts, or null"),
    (["plan.idle_watts=-1"], r"plan.idle_watts=-1.0 is invalid: a power per device in watts from 0 up to"),
    (["plan.idle_watts=800"], r"plan.idle_watts=800.0 is invalid: at most the power under load \(700 W per device "
                              r"on h100_sxm; plan.watts sets it\)"),
    (["plan.objective=energy", "plan.profile=machine"], r"plan.objective='energy' is invalid: time on machine "
                                                         r"\(a stored 2-core CPU\), which has no power figure"),
])
def test_a_bad_objective_or_power_figure_is_one_line(overrides, message, tmp_path, monkeypatch) -> None:
    from disttrain.plan.devices import HardwareProfile, Link
    from disttrain.plan.hardware import save_profile

    loopback = Link(1e9, 1e-4)  # this machine as calibrated without --watts: no power figure
    stored = HardwareProfile("machine (a stored 2-core CPU)", {"fp32": 4.6e10, "bf16": 1.5e10}, 5.8e9, 1.16e-5,
                             12.6e9, loopback, loopback, 2, cpu=True)
    monkeypatch.setenv("DISTTRAIN_PROFILE", str(save_profile(stored, tmp_path / "machine.json")))
    with pytest.raises(ConfigError, match=message):
        validate(compose_config([*MINI_GPT, *overrides], tmp_path))

