"""A validated run as the planner sees it: its model measured on the meta device, its layout and profile."""

from __future__ import annotations

from typing import Any

from torch import nn

from disttrain.plan.auto import choose
from disttrain.plan.devices import HardwareProfile
from disttrain.plan.estimate import Estimate
from disttrain.plan.inputs import PlanInputs
from disttrain.plan.layout import Layout, state_bytes
from disttrain.plan.model_stats import ModelStats, measure_model
from disttrain.plan.units import human_bytes


def module_names(net: nn.Module, modules: list[nn.Module]) -> list[str]:
    """Qualified names of ``modules`` inside ``net``."""
    names = {id(m): name for name, m in net.named_modules()}
    return [names[id(m)] for m in modules]


def plan_inputs(net: nn.Module, spec: Any, micro_size: int, parallel: Any, optim: Any, precision: str,
                profile: HardwareProfile) -> PlanInputs:
    """Measure ``net`` (built on the meta device) for a plan of a run with these options."""
    from disttrain.parallel.model_plan import pipeline_units_of, shard_units_of, tp_plan_of

    pipeline = pipeline_units_of(net, parallel.pipeline_units) or []
    shards = module_names(net, shard_units_of(net, parallel.shard_units, parallel.min_params_per_unit))
    tp_plan = tp_plan_of(net, parallel.tp_plan)

    def measure(size: int) -> ModelStats:
        return measure_model(net, spec, size, pipeline, shards, tp_plan)

    state = state_bytes(getattr(optim, "name", ""), getattr(optim, "momentum", 0.0) or 0.0)
    heads = getattr(getattr(net, "dims", None), "n_head", None)
    return PlanInputs(measure(micro_size), state, precision.startswith("bf16"), profile, bool(tp_plan), heads,
                      measure)


def layout_of(dims: Any, parallel: Any, batch: Any) -> Layout:
    """The layout of a validated run (its resolved degrees, options and batch)."""
    pipe = parallel.pipeline
    return Layout(pp=dims.pp, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp,
                  zero_stage=parallel.zero_stage, activation_checkpointing=parallel.activation_checkpoint != "none",
                  sequence_parallel=parallel.sequence_parallel, micro_size=batch.micro_size,
                  accumulation=batch.accumulation, microbatches=pipe.microbatches if dims.pp > 1 else 1,
                  schedule=pipe.schedule, stages_per_rank=pipe.stages_per_rank if dims.pp > 1 else 1,
                  accumulate_grads=parallel.accumulate_grads)



def planned_precision(precision: str, profile: HardwareProfile) -> str:
    """``trainer.precision`` for a plan: ``auto`` becomes bf16-mixed on a stated GPU profile and 32-true on a CPU
    (where a training run decides by a measured probe, which a plan does not run: its model may not fit here)."""
    if precision != "auto":
        return precision
    return "32-true" if profile.cpu else "bf16-mixed"


def preset_name(layout: Layout) -> str:
    """The preset a layout corresponds to (what a run chosen by ``parallel=auto`` is called)."""
    if layout.pp > 1:
        return "pipeline"
    if layout.tp > 1:
        return "tp" if layout.dp == 1 else "hybrid"
    if layout.dp_replicate > 1 and layout.dp_shard > 1:
        return "hsdp"
    if layout.zero_stage:
        return f"zero{layout.zero_stage}"
    return "ddp" if layout.dp_replicate > 1 else "single"


def choose_parallel(net: nn.Module, spec: Any, world: int, global_batch: int, parallel: Any, optim: Any,
                    precision: str, profile: HardwareProfile, alternatives: int = 3) -> tuple[Layout, str]:
    """``parallel=auto``: the chosen layout and the lines that say why (ConfigError if nothing fits)."""
    from disttrain.errors import ConfigError
    from disttrain.parallel.dims import ParallelDims
    from disttrain.parallel.model_checks import check_model_plan

    inputs = plan_inputs(net, spec, 1, parallel, optim, planned_precision(precision, profile), profile)

    def valid(layout: Layout) -> bool:
        candidate = apply_layout(parallel, layout)
        dims = ParallelDims.resolve(world, layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp)
        try:
            candidate.check_dims(dims)
            check_model_plan("model", net, candidate, dims, layout.micro_size)
        except ConfigError:
            return False
        return True

    choice = choose(inputs, world, global_batch, len(inputs.stats.pipeline_units), valid,
                    parallel.accumulate_grads)
    why = choice.reason(alternatives)
    if choice.best is None:
        raise ConfigError("parallel", "auto", f"a layout that fits {world} rank(s) of {profile.name} with "
                          f"{human_bytes(profile.memory_bytes)} per device: {why}")
    return choice.best.layout, f"parallel=auto ({profile.name}, {world} rank(s)): {why}"


def apply_layout(parallel: Any, layout: Layout) -> Any:
    """A copy of ``parallel`` with the degrees and options of ``layout``."""
    from dataclasses import replace

    pipeline = replace(parallel.pipeline, microbatches=layout.microbatches if layout.pp > 1 else
                       parallel.pipeline.microbatches, schedule=layout.schedule if layout.pp > 1 else
                       parallel.pipeline.schedule)
    return replace(parallel, name=preset_name(layout), dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard,
                   tp=layout.tp, pp=layout.pp, zero_stage=layout.zero_stage,
                   activation_checkpoint="full" if layout.activation_checkpointing else "none",
                   sequence_parallel=layout.sequence_parallel, pipeline=pipeline)


def print_plan(run: Any) -> Estimate:
    """``mode=plan``: print the plan of a validated run, write plan.json (and its picture); return it."""
    from pathlib import Path

    from disttrain.parallel.model_checks import model_on_meta
    from disttrain.plan.hardware import resolve_profile
    from disttrain.plan.report import render, write_plan

    cfg = run.train
    profile = resolve_profile(cfg.plan.profile, cfg.plan.memory_gb)
    net = model_on_meta(run.model, run.datamodule.spec)
    inputs = plan_inputs(net, run.datamodule.spec, run.batch.micro_size, cfg.parallel, run.optim,
                         planned_precision(cfg.trainer.precision, profile), profile)
    est = inputs.estimate(layout_of(run.dims, cfg.parallel, run.batch))
    print(render(est, profile, inputs.stats.params, run.model.name), flush=True)
    for path in write_plan(est, profile, Path(cfg.run_dir), cfg.plots):
        print(f"wrote {path}")
    return est
