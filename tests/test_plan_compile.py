"""``parallel=auto`` under the compile settings: it weighs only the layouts ``trainer.compile``, ``compile_mode`` and
``compile_scope`` allow (``trainer_checks.compile_refusal``, the rule a run's own layout is checked by), says in its
notice which it left out, and where only those fit names the compile setting. Config validation only: no rank
starts."""

from __future__ import annotations

import pytest

from disttrain.config.validation import validate
from disttrain.errors import ConfigError
from disttrain.plan import pictures
from disttrain.plan.auto import TIE
from disttrain.plan.units import human_bytes
from tests.conftest import compose_config

LLAMA_ON_A_SLOW_LINK = ["parallel=auto", "model=llama", "data=pydocs", "trainer.devices=2", "batch.global_size=8",
                        "plan.alternatives=50"]
"""Llama nano on 2 ranks joined by a 1 MB/s link (``slow_link``): a replica or ZeRO exchanges every gradient over
it each step, a pipeline only the activations between its two stages, so a pipeline is the fastest layout by far."""

WIDE_GPT_IN_22_MB = ["parallel=auto", "model=gpt", "model.n_layer=4", "model.n_embd=192", "model.n_head=3",
                     "data=pydocs", "trainer.devices=2", "batch.global_size=2", "plan.profile=h100_sxm",
                     "plan.memory_gb=0.022"]
"""A GPT whose state outgrows 22 MB per rank unless ZeRO-2/3 shard its parameters over the 2 ranks; its 3 heads
leave tensor parallelism out and its tied embedding a pipeline."""

WIDE_LLAMA_IN_23_MB = ["parallel=auto", "model=llama", "model.n_layer=4", "model.n_embd=192", "model.n_head=3",
                       "model.n_kv_head=3", "data=pydocs", "trainer.devices=2", "batch.global_size=4",
                       "plan.profile=h100_sxm", "plan.memory_gb=0.023"]
"""As ``WIDE_GPT_IN_22_MB`` with untied weights: in 23 MB per rank ZeRO-2/3 fit, and a pipeline of its two
halves."""


@pytest.fixture
def slow_link(monkeypatch, tmp_path) -> None:
    """The machine profile for this test's plans: a 2-core CPU's stored calibration whose link between ranks moves
    1 MB/s, so that what a layout sends decides the choice (and no measurement of the loaded machine does)."""
    from disttrain.plan.devices import HardwareProfile, Link
    from disttrain.plan.hardware import save_profile

    slow = Link(1e6, 1e-4)
    profile = HardwareProfile("2-core CPU, 1 MB/s link", {"fp32": 4.6e10, "fp32_conv": 2.5e10, "bf16": 1.5e10,
                              "bf16_conv": 8.2e9}, 5.8e9, 1.16e-5, 12.6e9, slow, slow, 2, cpu=True)
    monkeypatch.setenv("DISTTRAIN_PROFILE", str(save_profile(profile, tmp_path / "machine.json")))


def auto_notice(run) -> str:
    return next(n for n in run.notices if n.startswith("parallel=auto"))


def test_compile_leaves_the_pipelines_out_of_the_choice_and_its_listing(slow_link, tmp_path) -> None:
    run = validate(compose_config([*LLAMA_ON_A_SLOW_LINK, "mode=plan", "trainer.compile=true"], tmp_path))
    notice = auto_notice(run)
    assert run.layout.pp == 1 and run.train.parallel.name != "pipeline", notice  # and its own check passed
    (exclusion,) = run.choice.excluded
    pipeline = exclusion.best("time")
    assert pipeline.layout.pp == 2 and pipeline.step_s < run.choice.best.step_s / (1 + TIE)  # the premise: the
    # best layout here is a pipeline, which parallel=auto would choose but for the compile setting
    listed, excluded = notice.split("\n  excluded by ")
    assert "pp=" not in listed  # neither chosen nor among those that fit
    assert exclusion.count == 3 and not any(e.layout.pp > 1 for e in [*run.choice.ranked, *run.choice.too_big])
    assert excluded == ("trainer.compile=true: pipelines (stages are not compiled yet), 3 candidate(s); the best of "
                        f"them: {pipeline.layout.describe()}: {pipeline.step_s * 1e3:.3g} ms/step predicted, "
                        f"{human_bytes(pipeline.total_bytes)} of 12.6 GB per rank"), notice
    drawn = pictures.draw_candidates(run.choice, tmp_path / "plan_candidates.png")
    assert drawn.rows() and not any("pp=" in row for row in drawn.rows())
    assert any("3 excluded by trainer.compile=true" in text for text in drawn.texts), drawn.texts


@pytest.mark.parametrize(("budget", "found"), [
    ([], r"and only those fit \(the best: pp=2 1f1b m=4 micro=8x1\)"),
    (["plan.memory_gb=0.001"], "which is every layout it weighs"),  # nothing fits either: the mode is named first
])
def test_a_cuda_graph_mode_that_refuses_every_layout_of_two_ranks_is_named(slow_link, make_config, budget,
                                                                             found) -> None:
    # the mode refuses the pipelines too: it is named, not trainer.compile
    with pytest.raises(ConfigError, match=r"^trainer.compile_mode='reduce-overhead' is invalid: default or "
                       r"max-autotune-no-cudagraphs with parallel=auto on 2 rank\(s\) of 2-core CPU, 1 MB/s link "
                       r"with .* per device: it refuses layouts of more than one rank or under ZeRO \(CUDA graphs "
                       rf"replay no collectives\), {found}$"):
        validate(make_config([*LLAMA_ON_A_SLOW_LINK, *budget, "trainer.compile=true",
                              "trainer.compile_mode=reduce-overhead"]))


def test_scope_model_where_only_sharded_parameters_fit_is_named_with_what_runs(make_config) -> None:
    # what parallel=auto chooses here with each block compiled on its own: ZeRO-3, which scope model refuses
    with pytest.raises(ConfigError, match=r"^trainer.compile_scope='model' is invalid: blocks with parallel=auto on "
                       r"2 rank\(s\) of h100_sxm with 22 MB per device: it refuses layouts that shard parameters "
                       r"\(ZeRO-2/3: FSDP2's hooks stop a whole-model graph\), and only those fit \(the best: "
                       r"dp_shard=2 zero3 micro=1x1\)$"):
        validate(make_config([*WIDE_GPT_IN_22_MB, "trainer.compile=true", "trainer.compile_scope=model"]))


def test_where_two_compile_settings_refuse_every_layout_that_fits_both_are_named(make_config) -> None:
    with pytest.raises(ConfigError, match=r"^trainer.compile_scope='model' is invalid: blocks with parallel=auto on "
                       r"2 rank\(s\) of h100_sxm with 23 MB per device: it refuses layouts that shard parameters "
                       r"\(ZeRO-2/3: FSDP2's hooks stop a whole-model graph\), among them the best layout that fits "
                       r"\(dp_shard=2 zero3 ac=full micro=2x1\); the others that fit are refused by "
                       r"trainer.compile=true: pipelines \(stages are not compiled yet\)$"):
        validate(make_config([*WIDE_LLAMA_IN_23_MB, "trainer.compile=true", "trainer.compile_scope=model"]))
