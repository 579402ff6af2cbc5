"""A validated run as the planner sees it: its model measured on the meta device, its layout and profile."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from disttrain.errors import ConfigError, Refusal
from disttrain.plan.auto import Choice, choose
from disttrain.plan.devices import HardwareProfile
from disttrain.plan.estimate import Estimate
from disttrain.plan.inputs import PlanInputs
from disttrain.plan.layout import Layout, expert_degrees, state_bytes
from disttrain.plan.matrix_step import muon_state, soap_state
from disttrain.plan.memory import ActivationBytes
from disttrain.plan.model_stats import ModelStats, measure_model
from disttrain.plan.units import human_bytes


def module_names(net: nn.Module, modules: list[nn.Module]) -> list[str]:
    """Qualified names of ``modules`` inside ``net``."""
    names = {id(m): name for name, m in net.named_modules()}
    return [names[id(m)] for m in modules]


def plan_inputs(net: nn.Module, spec: Any, micro_size: int, parallel: Any, optim: Any, precision: str,
                profile: HardwareProfile, float8: Any = None) -> PlanInputs:
    """Measure ``net`` (built on the meta device) for a plan of a run with these options; ``float8``: the run's
    ``disttrain.parallel.float8.Float8Layers`` (None: no float8), which the plan prices."""
    from disttrain.parallel.model_plan import pipeline_units_of, shard_units_of, tp_plan_of

    pipeline = _declared(pipeline_units_of, net, parallel.pipeline_units) or []
    shards = module_names(net, shard_units_of(net, parallel.shard_units, parallel.min_params_per_unit))
    tp_plan = _declared(tp_plan_of, net, parallel.tp_plan)

    # bf16-mixed runs forward and the loss under autocast, and the pass does too, by the lists of the device
    # planned for; bf16-true holds every tensor in bf16, which ``estimate`` takes as half of the fp32 pass
    autocast = ("cpu" if profile.cpu else "cuda") if precision == "bf16-mixed" else None

    def measure(size: int) -> ModelStats:
        return measure_model(net, spec, size, pipeline, shards, tp_plan, autocast)

    if getattr(optim, "name", "") == "muon":  # momentum for the matrices Muon steps, AdamW's moments for the rest
        state = muon_state(net, optim)
    elif getattr(optim, "name", "") == "soap":  # whole preconditioners and moments for its matrices
        state = soap_state(net, optim)
    else:
        state = state_bytes(getattr(optim, "name", ""), getattr(optim, "momentum", 0.0) or 0.0)
    heads = getattr(getattr(net, "dims", None), "n_head", None)
    return PlanInputs(measure(micro_size), state, precision.startswith("bf16"), profile, bool(tp_plan), heads,
                      measure, float8)


def _declared(plan_of: Any, net: nn.Module, configured: Any) -> Any:
    """The pipeline units or tensor-parallel plan ``plan_of`` reads of ``net``; None where the model refuses that
    kind of parallelism (a ``transformers`` model type disttrain cannot cut into stages, a tp style it does not
    run): the plan then leaves it out, as validation refuses a run that asks for it."""
    try:
        return plan_of(net, configured)
    except ConfigError:
        return None


def layout_of(dims: Any, parallel: Any, batch: Any) -> Layout:
    """The layout of a validated run (its resolved degrees, options and batch)."""
    pipe = parallel.pipeline
    return Layout.of(parallel, dims, micro_size=batch.micro_size, accumulation=batch.accumulation,
                     microbatches=pipe.microbatches if dims.pp > 1 else 1, schedule=pipe.schedule,
                     stages_per_rank=pipe.stages_per_rank if dims.pp > 1 else 1)


def predicted_activation_bytes(net: nn.Module, spec: Any, micro_size: int, cp: int = 1,
                               activation_checkpoint: str = "none", checkpoint_every_n_blocks: int = 1,
                               precision: str = "32-true") -> ActivationBytes:
    """The planner's activation bytes per rank for ``net`` on micro-batches of ``micro_size`` sequences of
    ``spec`` split over ``cp`` context-parallel ranks under a checkpointing policy (no other parallelism): what
    is held when forward ends and the peak early in backward (``memory.ActivationBytes``), for comparison with
    what a rank measures."""
    from disttrain.parallel.config import ParallelConfig
    from disttrain.plan.estimate import activation_dtype
    from disttrain.plan.hardware import PROFILES
    from disttrain.plan.layout import rank_units
    from disttrain.plan.memory import activations

    inputs = plan_inputs(net, spec, micro_size, ParallelConfig(), None, precision, PROFILES["h100_sxm"])
    layout = Layout(cp=cp, activation_checkpoint=activation_checkpoint,
                    checkpoint_every_n_blocks=checkpoint_every_n_blocks, micro_size=micro_size)
    return activations(inputs.stats, rank_units(inputs.stats, layout)[0], layout,
                       activation_dtype(inputs.stats, inputs.bf16))


def planned_precision(precision: str, profile: HardwareProfile) -> str:
    """``trainer.precision`` for a plan: ``auto`` becomes bf16-mixed on a stated GPU profile and 32-true on a CPU
    (where a training run decides by a measured probe, which a plan does not run: its model may not fit here)."""
    if precision != "auto":
        return precision
    return "32-true" if profile.cpu else "bf16-mixed"


def preset_name(layout: Layout) -> str:
    """The preset a layout corresponds to (what a run chosen by ``parallel=auto`` is called), with ``+ep`` for
    expert parallelism and ``+cp`` for context parallelism (``cp`` alone on one data-parallel rank)."""
    name = _data_and_model_preset(layout) + ("+ep" if layout.ep > 1 else "")
    if layout.cp == 1:
        return name
    return "cp" if name == "single" else f"{name}+cp"


def _data_and_model_preset(layout: Layout) -> str:
    if layout.pp > 1:
        return "pipeline"
    if layout.tp > 1:
        return "tp" if layout.dp == 1 else "hybrid"
    if layout.dp_replicate > 1 and layout.dp_shard > 1:
        return "hsdp"
    if layout.shards_optimizer_state:
        return layout.zero_preset
    return "ddp" if layout.dp_replicate > 1 else "single"


def choose_parallel(net: nn.Module, spec: Any, world: int, global_batch: int, parallel: Any, optim: Any,
                    precision: str, profile: HardwareProfile, alternatives: int = 3,
                    objective: str = "time") -> tuple[Layout, str]:
    """``parallel=auto``: the chosen layout (the least predicted ``objective``: ``auto.OBJECTIVES``) and the lines
    that say why (ConfigError if nothing fits, or energy is asked of a profile without a power figure)."""
    choice = weigh_layouts(net, spec, world, global_batch, parallel, optim, precision, profile, objective)
    return chosen_layout(choice, world, profile, alternatives)


def weigh_layouts(net: nn.Module, spec: Any, world: int, global_batch: int, parallel: Any, optim: Any,
                  precision: str, profile: HardwareProfile, objective: str = "time",
                  refusal_of: Callable[[Layout], Refusal | None] = lambda layout: None) -> Choice:
    """``parallel=auto``'s weighing: every candidate layout the model and the run accept, predicted, the one that
    fits with the least ``objective`` chosen (``auto.Choice``: what ``chosen_layout`` reports and
    ``plan_candidates.png`` draws); ConfigError for energy on a profile without a power figure. ``refusal_of``:
    the rule of the run's other settings (``disttrain.config.layout_refusals.LayoutRefusals``: the compile
    settings, a quantised LoRA base, a gradient codec, 1-bit Adam), whose refused candidates are left out of the
    choice and reported apart (``auto.Exclusion``)."""
    from disttrain.parallel.dims import ParallelDims
    from disttrain.parallel.model_checks import check_model_plan

    if objective == "energy" and profile.watts is None:
        raise ConfigError("plan.objective", objective, f"time on {profile.name}, which has no power figure (or "
                          "plan.watts=W per device; python -m disttrain.plan --calibrate --watts W for this machine)")
    inputs = plan_inputs(net, spec, 1, parallel, optim, planned_precision(precision, profile), profile)

    def valid(layout: Layout) -> bool:
        candidate = apply_layout(parallel, layout)
        dims = ParallelDims.resolve(world, layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp, layout.cp,
                                    layout.ep)
        try:
            candidate.check_layout(Layout.of(candidate, dims))
            check_model_plan("model", net, candidate, dims, layout.micro_size, spec)
        except ConfigError:
            return False
        return True

    return choose(inputs, world, global_batch, len(inputs.stats.pipeline_units), valid, parallel.accumulate_grads,
                  objective, refusal_of)


def chosen_layout(choice: Choice, world: int, profile: HardwareProfile, alternatives: int = 3) -> tuple[Layout, str]:
    """The layout ``choice`` chose and the lines that say why. ConfigError if nothing fits: naming the setting that
    refused the layouts that fit, or that left no candidate at all (``Choice.refused``), else ``parallel=auto``."""
    why = choice.reason(alternatives)
    where = f"{world} rank(s) of {profile.name} with {human_bytes(profile.memory_bytes)} per device"
    blocked = choice.refused(where)  # a setting, not the memory, stands between the run and a layout
    if blocked is not None:
        raise blocked
    if choice.best is None:
        raise ConfigError("parallel", "auto", f"a layout that fits {where}: {why}")
    return choice.best.layout, f"parallel=auto ({profile.name}, {world} rank(s)): {why}"


def apply_layout(parallel: Any, layout: Layout) -> Any:
    """A copy of ``parallel`` with the degrees and options of ``layout``."""
    from dataclasses import replace

    pipeline = replace(parallel.pipeline, microbatches=layout.microbatches if layout.pp > 1 else
                       parallel.pipeline.microbatches, schedule=layout.schedule if layout.pp > 1 else
                       parallel.pipeline.schedule)
    return replace(layout.applied_to(parallel), name=preset_name(layout), pipeline=pipeline)


def check_memory_budget(net: nn.Module, spec: Any, dims: Any, parallel: Any, batch: Any, optim: Any,
                        precision: str, memory_gb: float) -> None:
    """``plan.memory_gb`` on a training run: refuse, before any rank starts, a layout whose predicted peak per
    rank exceeds it, naming what would fit: a higher ep degree (a model with experts), a higher cp degree, or
    another checkpointing policy."""
    from dataclasses import replace

    from disttrain.errors import ConfigError
    from disttrain.plan.hardware import resolve_profile

    profile = resolve_profile("machine", memory_gb)
    inputs = plan_inputs(net, spec, batch.micro_size, parallel, optim, planned_precision(precision, profile),
                         profile)
    layout = layout_of(dims, parallel, batch)
    est = inputs.estimate(layout)
    if est.fits:
        return
    fitting = []
    for ep in expert_degrees(inputs.stats, layout.dp_shard, layout.shards_parameters):  # the same ranks, experts split
        if ep > layout.ep and inputs.estimate(replace(layout, ep=ep)).fits:
            fitting.append(f"parallel.ep={ep}")
            break
    for cp in (2, 4, 8):  # the same data-parallel ranks, each sequence split over more ranks
        if cp > layout.cp and spec.block_size % (2 * cp) == 0:
            other = replace(layout, cp=cp)
            if inputs.estimate(other).fits:
                fitting.append(f"parallel.cp={cp} on {other.world_size} ranks")
                break
    for policy in ("selective", "full"):
        other = replace(layout, activation_checkpoint=policy)
        if policy != layout.activation_checkpoint and inputs.estimate(other).fits:
            fitting.append(f"parallel.activation_checkpoint={policy}")
            break
    hint = f"; fits: {' or '.join(fitting)}" if fitting else "; parallel=auto searches the layouts that fit"
    raise ConfigError("plan.memory_gb", memory_gb, f"at least the predicted peak per rank of this layout "
                      f"({layout.describe()}): {est.overflow()}{hint}")


def plan_of_run(run: Any) -> tuple[Estimate, HardwareProfile, PlanInputs]:
    """The plan of a validated run: its estimate, the profile it is for and what it measured of the model."""
    from disttrain.parallel.model_checks import model_on_meta
    from disttrain.plan.hardware import profile_of_plan

    cfg = run.train
    profile = profile_of_plan(cfg.plan)
    net = model_on_meta(run.model, run.datamodule.spec)
    inputs = plan_inputs(net, run.datamodule.spec, run.batch.micro_size, cfg.parallel, run.optim,
                         planned_precision(cfg.trainer.precision, profile), profile, cfg.trainer.float8)
    return inputs.estimate(layout_of(run.layout, cfg.parallel, run.batch)), profile, inputs


def planned_moments(run: Any) -> dict[str, float] | None:
    """The bytes the plan of a validated run predicts on its most loaded rank at the moments memory peaks
    (``Estimate.phases``); None for a run the planner cannot plan (it says why in a ConfigError)."""
    try:
        return dict(plan_of_run(run)[0].phases)
    except ConfigError:
        return None


def print_plan(run: Any) -> Estimate:
    """``mode=plan``: print the plan of a validated run, write plan.json (and its pictures: with
    ``parallel=auto``, the layouts it weighed too); return it."""
    from pathlib import Path

    from disttrain.plan.report import render, write_plan

    cfg = run.train
    est, profile, inputs = plan_of_run(run)
    print(render(est, profile, inputs.stats.params, run.model.name, inputs.stats), flush=True)
    for path in write_plan(est, profile, Path(cfg.run_dir), cfg.plots, run.choice):
        print(f"wrote {path}")
    return est
