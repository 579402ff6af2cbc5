"""Whether a model has what the parallel degrees need from it, checked on a copy built on the meta device."""

from __future__ import annotations

from typing import Any

from disttrain.errors import ConfigError
from disttrain.models.target import TargetModelConfig
from disttrain.parallel.config import ParallelConfig
from disttrain.parallel.dims import ParallelDims


def model_on_meta(model: Any, spec: Any) -> Any:
    """The model built on the meta device (no memory, no init cost), to check its parallel plan; a user's
    model that cannot be built there is built on the CPU (and its error, if any, comes from there)."""
    import torch

    from disttrain.models import build_model

    try:
        with torch.device("meta"):
            return build_model(model, spec)
    except ConfigError:
        if not isinstance(model, TargetModelConfig):
            raise
    # a user's constructor may need real tensors (it reads values while building): build it on the CPU
    return build_model(model, spec)


def check_model_plan(name: str, net: Any, p: ParallelConfig, dims: ParallelDims, micro_size: int) -> None:
    """The model has what the degrees need from it: a tp plan that splits evenly, pipeline units that the
    schedule can cut, and shard units that exist (from its methods or from ``parallel``; blocks to checkpoint
    when ``parallel.activation_checkpoint`` is not none)."""
    from disttrain.parallel.model_plan import pipeline_units_of, shard_units_of, tp_plan_of
    from disttrain.parallel.pipeline.split import check_pipeline, check_units
    from disttrain.parallel.tp import check_tp_plan

    for key in ("pipeline_units", "shard_units"):
        for unit in getattr(p, key) or []:
            _check_submodule(net, f"parallel.{key}", unit)
    if p.activation_checkpoint != "none" and not shard_units_of(net, p.shard_units, p.min_params_per_unit):
        raise ConfigError("parallel.activation_checkpoint", p.activation_checkpoint,
                          f"none for model {name}: it has no blocks to checkpoint (declare shard_units(), or set "
                          "parallel.shard_units)")
    if dims.tp_enabled:
        plan = tp_plan_of(net, p.tp_plan)
        if not plan:
            raise ConfigError("parallel.tp", dims.tp, f"1 for model {name}: it declares no tp_plan() and "
                              "parallel.tp_plan is not set (module-name pattern -> colwise | rowwise)")
        check_tp_plan(net, plan, dims.tp, p.sequence_parallel, "parallel.tp_plan" if p.tp_plan else "tp_plan()")
    if dims.pp_enabled:
        units = pipeline_units_of(net, p.pipeline_units)
        if not units:
            raise ConfigError("parallel.pp", dims.pp, f"1 for model {name}: it declares no pipeline_units() and "
                              "parallel.pipeline_units is not set (ordered submodules whose application is forward)")
        check_units(net, units, dims.pp, name)
        o = p.pipeline
        check_pipeline(o.schedule, dims.pp, o.stages_per_rank, o.microbatches, micro_size, len(units))


def _check_submodule(net: Any, key: str, name: str) -> None:
    try:
        net.get_submodule(name)
    except AttributeError:
        raise ConfigError(key, name, f"names of submodules of {type(net).__name__}") from None
