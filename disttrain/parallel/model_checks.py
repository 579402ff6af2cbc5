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
    from disttrain.models import build_model
    from disttrain.models.meta import on_meta_device

    try:
        with on_meta_device():
            return build_model(model, spec)
    except ConfigError:
        if not isinstance(model, TargetModelConfig):
            raise
    # a user's constructor may need real tensors (it reads values while building): build it on the CPU
    return build_model(model, spec)


def check_model_plan(name: str, net: Any, p: ParallelConfig, dims: ParallelDims, micro_size: int,
                     spec: Any = None) -> None:
    """The model has what the degrees need from it: a tp plan that splits evenly, pipeline units that the
    schedule can cut, shard units that exist (from its methods or from ``parallel``; blocks to checkpoint
    when ``parallel.activation_checkpoint`` is not none), and attention that takes a sequence split for the
    sequences of ``spec`` (the data's) under context parallelism."""
    from disttrain.parallel.model_plan import pipeline_units_of, shard_units_of, tp_plan_of
    from disttrain.parallel.pipeline.split import check_pipeline, check_units

    for key in ("pipeline_units", "shard_units"):
        for unit in getattr(p, key) or []:
            _check_submodule(net, f"parallel.{key}", unit)
    if dims.cp_enabled:
        _check_sequence_split(name, net, dims, p.sequence_parallel, spec)
        capacities = [m.capacity_factor for m in net.modules() if getattr(m, "capacity_factor", None) is not None]
        if capacities:
            raise ConfigError("model.capacity_factor", capacities[0], f"null with parallel.cp={dims.cp} (which "
                              "tokens of a sequence an expert drops depends on its tokens on the other cp ranks; "
                              "not available yet)")
    if dims.ep_enabled:
        _check_experts(name, net, dims)
    if dims.pp_enabled and any(hasattr(m, "balance_group") for m in net.modules()):
        raise ConfigError("parallel.pp", dims.pp, f"1 for model {name} with its router balance loss "
                          "(+model.output_router_logits=false for pipelining): the loss is computed from every "
                          "layer's router logits at the end of the model's forward, which pipeline stages do not run")
    if p.activation_checkpoint != "none" and not shard_units_of(net, p.shard_units, p.min_params_per_unit):
        raise ConfigError("parallel.activation_checkpoint", p.activation_checkpoint,
                          f"none for model {name}: it has no blocks to checkpoint (declare shard_units(), or set "
                          "parallel.shard_units)")
    if dims.tp_enabled:
        from disttrain.parallel.tp import check_tp_plan  # imports DTensor (slow), which nothing else here needs

        plan = tp_plan_of(net, p.tp_plan)
        if not plan:
            raise ConfigError("parallel.tp", dims.tp, f"1 for model {name}: it declares no tp_plan() and "
                              "parallel.tp_plan is not set (module-name pattern -> colwise | rowwise)")
        check_tp_plan(net, plan, dims.tp, p.sequence_parallel, "parallel.tp_plan" if p.tp_plan else "tp_plan()")
    if dims.pp_enabled:
        units = pipeline_units_of(net, p.pipeline_units)
        if not units:
            refusal = getattr(net, "pipeline_refusal", None)  # a model may say why it declares no units
            why = refusal() if callable(refusal) else None
            raise ConfigError("parallel.pp", dims.pp, f"1 for model {name}: " + (why or (
                "it declares no pipeline_units() and parallel.pipeline_units is not set (ordered submodules whose "
                "application is forward)")))
        check_units(net, units, dims.pp, name)
        o = p.pipeline
        check_pipeline(o.schedule, dims.pp, o.stages_per_rank, o.microbatches, micro_size, len(units))


def _check_sequence_split(name: str, net: Any, dims: ParallelDims, sequence_parallel: bool, spec: Any) -> None:
    """Context parallelism needs text, a model whose attention takes a split, and chunks of equal length."""
    from disttrain.parallel.context import sequence_modules

    if getattr(spec, "kind", None) != "text" or not sequence_modules(net):
        refusal = getattr(net, "sequence_split_refusal", None)  # a model may say why its attention takes none
        why = refusal() if callable(refusal) else None
        raise ConfigError("parallel.cp", dims.cp,
                          f"1 for model {name}: context parallelism splits text sequences over ranks, and " + (
                              why or f"{type(net).__name__} has no module that takes a sequence split (attention "
                              "with a sequence_split attribute, as model=gpt, llama and hf Llama-family models "
                              "have)"))
    length = spec.block_size
    if length % (2 * dims.cp):
        raise ConfigError("parallel.cp", dims.cp, f"a degree whose double divides the sequence length {length} "
                          f"(data.block_size): each of the cp ranks holds two equal chunks of every sequence")
    if sequence_parallel and (length // dims.cp) % dims.tp:
        raise ConfigError("parallel.sequence_parallel", True,
                          f"false, or a sequence whose share per cp rank ({length} / cp={dims.cp}) divides by "
                          f"tp={dims.tp}")


def _check_submodule(net: Any, key: str, name: str) -> None:
    try:
        net.get_submodule(name)
    except AttributeError:
        raise ConfigError(key, name, f"names of submodules of {type(net).__name__}") from None


def _check_experts(name: str, net: Any, dims: ParallelDims) -> None:
    """Expert parallelism needs grouped experts (``expert_parallel`` modules) whose count ep divides."""
    experts = [m for m in net.modules() if hasattr(m, "expert_parallel")]
    if not experts:
        model_type = getattr(getattr(net, "hf_config", None), "model_type", None)
        kind = f"{name} ({model_type})" if model_type else name
        raise ConfigError("parallel.ep", dims.ep,
                          f"1 for model {kind}: expert parallelism splits grouped experts (modules with an "
                          "expert_parallel attribute holding [n_experts, ...] weights, as model=moe has); "
                          f"{type(net).__name__} has none" + (
                              f" (a Hugging Face model's are the experts modules its config's base_model_ep_plan "
                              f"names, and {model_type} names none)" if model_type else ""))
    for module in experts:
        if module.n_experts % dims.ep:
            key = getattr(module, "n_experts_key", "model.n_experts")  # a Hugging Face model's is its config's
            raise ConfigError("parallel.ep", dims.ep, f"a divisor of {key}={module.n_experts} (each of the ep ranks "
                              "holds the same number of experts)")
