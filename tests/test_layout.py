"""The run's ``Layout``: what each ZeRO stage means as predicates, how it is built from the config, and that no module
outside it tests the stage as a number."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from disttrain.config.validation import validate
from disttrain.parallel.config import ParallelConfig
from disttrain.parallel.dims import ParallelDims
from disttrain.parallel.layout import Layout

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "disttrain"
SPELL_THE_STAGE = {"disttrain/parallel/layout.py", "disttrain/parallel/config.py"}
"""The only modules that name ``zero_stage``: the layout, and the config that declares, checks and hands it over."""

# stage: (optimizer state, only it, gradients, parameters, gathered kept, reshards, gathers per micro-batch)
PREDICATES = {
    0: (False, False, False, False, False, False, 1),
    1: (True, True, False, False, False, False, 1),
    2: (True, False, True, True, True, False, 1),
    3: (True, False, True, True, False, True, 2),
}


@pytest.mark.parametrize("stage", sorted(PREDICATES))
def test_each_stage_reads_as_its_predicates(stage):
    layout = Layout.of(ParallelConfig(zero_stage=stage), ParallelDims(dp_shard=4))
    assert (layout.shards_optimizer_state, layout.shards_only_optimizer_state, layout.shards_gradients,
            layout.shards_parameters, layout.keeps_gathered_parameters, layout.reshards_after_forward,
            layout.gathers_per_microbatch) == PREDICATES[stage]
    assert layout.state_shards == (4 if stage else 1)
    assert layout.wrapper == ("fsdp" if stage >= 2 else "ddp")
    assert layout.zero_setting == f"zero_stage={stage}" and layout.zero_name == f"ZeRO-{stage}"
    assert layout.describe() == "dp_shard=4" + (f" zero{stage}" if stage else "")


@pytest.mark.parametrize(("stage", "mode", "pp", "sharded"),
                         [(3, "auto", 1, True), (2, "sharded", 1, True), (3, "unsharded", 1, False),
                          (1, "auto", 1, False), (0, "auto", 1, False), (3, "auto", 2, False)])
def test_accumulation_is_sharded_under_zero2_or_3_without_a_pipeline(stage, mode, pp, sharded):
    layout = Layout.of(ParallelConfig(zero_stage=stage, accumulate_grads=mode), ParallelDims(pp=pp, dp_shard=2))
    assert layout.sharded_accumulation == sharded


def test_of_copies_the_degrees_and_the_options_that_lay_state_out():
    parallel = ParallelConfig(zero_stage=3, accumulate_grads="unsharded", activation_checkpoint="selective",
                              checkpoint_every_n_blocks=2, sequence_parallel=True, cpu_offload=True)
    dims = ParallelDims(pp=1, dp_replicate=2, dp_shard=4, tp=2, cp=2, ep=2)
    layout = Layout.of(parallel, dims)
    assert isinstance(layout, ParallelDims) and layout.mesh_shape == dims.mesh_shape and layout.ep == 2
    assert (layout.accumulate_grads, layout.activation_checkpoint, layout.checkpoint_every_n_blocks,
            layout.sequence_parallel, layout.cpu_offload, layout.ddp_exchange) == ("unsharded", "selective", 2, True,
                                                                                  True, True)
    assert layout.describe() == "dp_replicate=2 dp_shard=4 ep=2 cp=2 tp=2 zero3 sp ac=selective every 2"
    chosen = Layout.of_stage(1, dp_shard=4).applied_to(parallel)
    assert (chosen.zero_stage, chosen.dp_shard, chosen.tp, chosen.cpu_offload) == (1, 4, 1, True)


@pytest.mark.parametrize(("parallel", "dims", "wrapper"), [
    (ParallelConfig(), ParallelDims(), "none"),
    (ParallelConfig(dp_replicate=2), ParallelDims(dp_replicate=2), "ddp"),
    (ParallelConfig(cp=2), ParallelDims(cp=2), "ddp"),  # the cp ranks average their slices' gradients
    (ParallelConfig(zero_stage=3), ParallelDims(), "fsdp"),  # one rank: FSDP2's policies without sharding
    (ParallelConfig(zero_stage=3, pp=2), ParallelDims(pp=2, dp_shard=2), "pipeline"),
    (ParallelConfig(sync_every=4), ParallelDims(dp_replicate=2), "none"),
    (ParallelConfig(servers=1), ParallelDims(dp_replicate=2), "none"),
    (ParallelConfig(name="federated"), ParallelDims(dp_replicate=2), "none"),
])
def test_the_wrapper_follows_the_degrees_the_stage_and_who_exchanges(parallel, dims, wrapper):
    assert Layout.of(parallel, dims).wrapper == wrapper


def test_the_planner_and_the_run_read_one_kind_of_layout():
    from disttrain.plan.layout import Layout as Candidate
    from disttrain.plan.planner import layout_of

    batch = type("Batch", (), {"micro_size": 8, "accumulation": 2})()
    candidate = layout_of(ParallelDims(dp_shard=4), ParallelConfig(zero_stage=2), batch)
    assert isinstance(candidate, Layout) and isinstance(candidate, Candidate)
    assert candidate.shards_parameters and candidate.sharded_accumulation and not candidate.whole_grads
    assert candidate.describe() == "dp_shard=4 zero2 micro=8x2"
    assert not replace(candidate, accumulate_grads="unsharded").sharded_accumulation


def test_validation_builds_the_layout_once_and_the_run_reads_it(make_config):
    run = validate(make_config(["parallel=zero3", "trainer.devices=2"]))
    assert run.layout == Layout.of(run.train.parallel, ParallelDims(dp_shard=2))
    assert run.dims is run.layout and run.layout.shards_parameters


def zero_stage_lines() -> list[str]:
    """Every line of ``disttrain`` outside ``SPELL_THE_STAGE`` that names ``zero_stage``."""
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name not in SPELL_THE_STAGE:
            hits += [f"{name}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
                     if "zero_stage" in line]
    return hits


def test_no_module_but_the_layout_and_the_config_names_the_zero_stage():
    hits = zero_stage_lines()
    assert not hits, "ask the Layout's predicates (disttrain.parallel.layout), not the stage:\n" + "\n".join(hits)


def test_the_config_branches_on_the_stage_only_to_check_its_value():
    """ParallelConfig declares the stage, checks its value (``validate``) and names it in messages; its other
    checks ask the layout."""
    tree = ast.parse((PACKAGE / "parallel" / "config.py").read_text())
    branching = []
    for function in (node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)):
        for node in ast.walk(function):
            tested = node.test if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)) else \
                node if isinstance(node, (ast.Compare, ast.BoolOp)) else None
            if tested is not None and function.name != "validate" and any(
                    isinstance(part, ast.Attribute) and part.attr == "zero_stage" for part in ast.walk(tested)):
                branching.append(f"{function.name}:{node.lineno}")
    assert not branching, f"ParallelConfig tests the stage outside validate(): {branching}"
