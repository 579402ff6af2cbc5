"""What an optimiser that steps whole matrices (``optim=muon``) costs a layout: its state per rank (momentum for
the matrices, AdamW's moments for the rest), the gathers of the matrices a layout splits, and the Newton-Schulz
iteration's FLOPs, as ``disttrain.optim.muon`` runs them: a split matrix is gathered whole on every rank of its
shard group once per optimiser step and orthogonalised there, each rank keeping its piece (no scatter)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from disttrain.plan.communication import Collective, collective, group_link
from disttrain.plan.devices import HardwareProfile
from disttrain.plan.layout import Layout, MatrixStep, StateBytes, param_on_rank
from disttrain.plan.model_stats import ModelStats
from disttrain.plan.step_time import threads_per_rank

NS_RATES = {"bfloat16": "bf16", "float32": "fp32"}
"""The iteration's dtype -> the profile's peak rate it computes at."""


def muon_state(net: nn.Module, optim: Any) -> StateBytes:
    """State bytes of ``optim=muon`` on ``net`` (built on the meta device), its parameters routed by Muon's own rule
    and the config's patterns (``disttrain.optim.muon.route``)."""
    from disttrain.optim.muon import MuonConfig, route

    defaults = MuonConfig()
    other = getattr(optim, "other", defaults.other)
    matrices, _ = route(net, list(getattr(optim, "matrix_params", None) or []),
                        list(getattr(other, "params", None) or []))
    step = MatrixStep({name: tuple(p.shape) for name, p in matrices},
                      ns_steps=getattr(optim, "ns_steps", defaults.ns_steps),
                      ns_dtype=getattr(optim, "ns_dtype", defaults.ns_dtype))
    return StateBytes(optim=step.other_state, matrices=step)


def _local(stats: ModelStats, layout: Layout, name: str) -> float:
    """Elements of parameter ``name`` on a rank before data-parallel sharding (its tensor-parallel share)."""
    return stats.param_numel[name] / (layout.tp if stats.tp_sharded.get(name) else 1)


def rank_state(stats: ModelStats, layout: Layout, units: list[str] | None, state: StateBytes) -> StateBytes:
    """``state`` with its bytes per element the means over the parameters of the rank holding ``units`` (each
    sharded as the parameter is): ``optim`` where a matrix optimiser keeps other state for its matrices, and, with
    frozen parameters (a LoRA run's base), ``param`` at each one's own dtype and ``grad`` and ``optim`` for the
    trainable ones alone; ``state`` itself for an optimiser with one figure for all and nothing frozen."""
    step = state.matrices
    if step is None and not stats.frozen:
        return state
    total = params = grads = optim = 0.0
    for name in stats.param_numel:
        if param_on_rank(stats, name, units):
            n = _local(stats, layout, name)
            total += n
            if name in stats.frozen:
                params += n * stats.frozen[name]
                continue
            params += n * state.param
            grads += n * state.grad
            optim += n * (state.optim if step is None else step.state if name in step.shapes else step.other_state)
    if not total:
        return state if step is None else replace(state, optim=step.other_state)
    return replace(state, param=params / total, grad=grads / total, optim=optim / total)


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """FLOPs of torch's ``_zeropower_via_newtonschulz`` on a ``rows x cols`` matrix: per step, with ``m`` the smaller
    side and ``n`` the larger, the Gram matrix ``X X^T`` (2 m^2 n), its square (2 m^3) and that times ``X``
    (2 m^2 n); the elementwise terms and the norm are left out."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def _split(stats: ModelStats, layout: Layout, name: str) -> tuple[bool, int]:
    """Whether the tensor-parallel plan splits parameter ``name``, and over how many ranks ZeRO-2/3 shards it."""
    expert = name in stats.expert_params and layout.ep > 1
    shards = (layout.expert_state_shards if expert else layout.state_shards) if layout.shards_parameters else 1
    return layout.tp > 1 and bool(stats.tp_sharded.get(name)), shards


def orthogonalise_flops(stats: ModelStats, layout: Layout, units: list[str] | None, step: MatrixStep) -> float:
    """Newton-Schulz FLOPs per optimiser step of the rank holding ``units``: every matrix it steps whole, a split one
    too (each rank of its shard group computes it), a 1/dp_shard share under ZeRO-1 (each matrix has one owner),
    and of a stack of matrices (3-D: experts) the matrices of its local shard (split by experts, never gathered)."""
    flops = 0.0
    owners = layout.dp_shard if layout.shards_only_optimizer_state else 1
    for name, shape in step.shapes.items():
        if not param_on_rank(stats, name, units):
            continue
        each = newton_schulz_flops(shape[-2], shape[-1], step.ns_steps)
        if len(shape) == 3:
            tp_split, shards = _split(stats, layout, name)
            ep = layout.ep if name in stats.expert_params else 1
            flops += each * shape[0] / (layout.tp if tp_split else 1) / ep / shards / owners
        else:
            flops += each / owners
    return flops


def orthogonalise_seconds(flops: float, layout: Layout, profile: HardwareProfile, step: MatrixStep) -> float:
    """Time of ``flops`` of the iteration at the profile's peak matrix-multiply rate of its dtype."""
    threads = threads_per_rank(profile, layout.world_size) if profile.cpu else 1
    return flops / (profile.flops[NS_RATES[step.ns_dtype]] * threads)


def matrix_gathers(stats: ModelStats, layout: Layout, units: list[str] | None, step: MatrixStep,
                   profile: HardwareProfile) -> list[Collective]:
    """The all-gathers per optimiser step that make each split 2-D matrix of the rank holding ``units`` whole on
    every rank of its shard group (tensor parallelism's, ZeRO-2/3's or both: gathered over their product, which
    sends as much as a ring over it), in the momentum's dtype, after backward (nothing left to hide them). Stacks of
    matrices are split by experts only and stepped where they lie."""
    groups: dict[tuple[str, int, int], tuple[float, int]] = {}
    shard_group = "dp_shard_cp" if layout.cp > 1 else "dp_shard"
    for name, shape in step.shapes.items():
        if len(shape) != 2 or not param_on_rank(stats, name, units):
            continue
        tp_split, shards = _split(stats, layout, name)
        size = (layout.tp if tp_split else 1) * shards
        if size == 1:
            continue
        label = "+".join(g for g, on in ((shard_group, shards > 1), ("tp", tp_split)) if on)
        span = layout.tp * (layout.cp * layout.dp_shard if shards > 1 else 1)
        buffer, calls = groups.get((label, size, span), (0.0, 0))
        groups[(label, size, span)] = (buffer + stats.param_numel[name] * step.state, calls + 1)
    return [collective("all_gather", label, size, buffer, calls, group_link(profile, span), after_step=True,
                       what="whole matrices")
            for (label, size, span), (buffer, calls) in groups.items()]
