"""What an optimiser that steps whole matrices (``optim=muon``, ``optim=soap``) costs a layout: its state per rank
(Muon's momentum or SOAP's preconditioners for the matrices, AdamW's moments for the rest), the gathers of the
matrices a layout splits, and the FLOPs of Muon's Newton-Schulz iteration or SOAP's rotations and
eigendecompositions, as ``disttrain.optim.muon`` and ``disttrain.optim.soap`` run them: a split matrix is gathered
whole on every rank of its shard group once per optimiser step and stepped there, each rank keeping its piece (no
scatter)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from disttrain.plan.communication import Collective, collective, group_link
from disttrain.plan.devices import HardwareProfile
from disttrain.plan.layout import Layout, MatrixStep, StateBytes, param_on_rank, rank_expert_params, rank_params
from disttrain.plan.model_stats import ModelStats
from disttrain.plan.step_time import threads_per_rank

NS_RATES = {"bfloat16": "bf16", "float32": "fp32"}
"""The iteration's dtype -> the profile's peak rate it computes at."""
PRECONDITION_BYTES = {"float32": 4, "float64": 8}
"""SOAP's ``precondition_dtype`` -> bytes per value of its state."""
GRADIENT_BYTES = 4
"""Bytes per value of the gradients SOAP gathers (those of fp32 parameters)."""
EIGH_FLOPS = 9
"""FLOPs of a symmetric eigendecomposition with eigenvectors per n^3 (Golub and Van Loan's symmetric QR algorithm)."""


def _matrix_shapes(net: nn.Module, optim: Any, defaults: Any) -> dict[str, tuple[int, ...]]:
    """Name -> whole shape of the parameters of ``net`` a matrix optimiser steps, routed by Muon's rule and the
    config's patterns (``disttrain.optim.muon.route``)."""
    from disttrain.optim.muon import route

    other = getattr(optim, "other", defaults.other)
    matrices, _ = route(net, list(getattr(optim, "matrix_params", None) or []),
                        list(getattr(other, "params", None) or []))
    return {name: tuple(p.shape) for name, p in matrices}


def _heads(net: nn.Module, optim: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, int]]:
    """Name -> (axis, width) of the attention projections among ``shapes`` stepped per head (``optim.per_head``),
    as the model declares its heads (``disttrain.models.heads``); empty when the option is off."""
    from disttrain.models.heads import head_blocks_of

    declared = head_blocks_of(net) if getattr(optim, "per_head", False) else {}
    return {name: (declared[name].axis, declared[name].width) for name, shape in shapes.items()
            if name in declared and len(shape) == 2}


def muon_state(net: nn.Module, optim: Any) -> StateBytes:
    """State bytes of ``optim=muon`` on ``net`` (built on the meta device)."""
    from disttrain.optim.muon import MuonConfig

    defaults = MuonConfig()
    shapes = _matrix_shapes(net, optim, defaults)
    step = MatrixStep(shapes, ns_steps=getattr(optim, "ns_steps", defaults.ns_steps),
                      ns_dtype=getattr(optim, "ns_dtype", defaults.ns_dtype), heads=_heads(net, optim, shapes))
    return StateBytes(optim=step.other_state, matrices=step)


def soap_state(net: nn.Module, optim: Any) -> StateBytes:
    """State bytes of ``optim=soap`` on ``net`` (built on the meta device). Its rotations and eigendecompositions
    are timed at the profile's fp32 rate, also in float64 (which most accelerators compute slower: a lower bound)."""
    from disttrain.optim.soap import SoapConfig

    defaults = SoapConfig()
    dtype = getattr(optim, "precondition_dtype", defaults.precondition_dtype)
    shapes = _matrix_shapes(net, optim, defaults)
    step = MatrixStep(shapes, ns_dtype="float32", kind="soap", precondition_bytes=PRECONDITION_BYTES[dtype],
                      precondition_frequency=getattr(optim, "precondition_frequency", defaults.precondition_frequency),
                      heads=_heads(net, optim, shapes))
    return StateBytes(optim=step.other_state, matrices=step)


def stepped_matrices(step: MatrixStep, name: str) -> tuple[int, int, int]:
    """(count, rows, cols) of the matrices parameter ``name`` is stepped as: its heads' blocks where it is stepped per
    head, the matrices of a stack (3-D: experts), else itself."""
    shape = step.shapes[name]
    if name in step.heads:
        axis, width = step.heads[name]
        return shape[axis] // width, *((width, shape[1]) if axis == 0 else (shape[0], width))
    *batch, rows, cols = shape
    return (batch[0] if batch else 1), rows, cols


def soap_values(shape: tuple[int, ...]) -> int:
    """Values of SOAP's state of one matrix (or stack of matrices) of ``shape``: L and QL (rows^2 each), R and QR
    (cols^2 each) and the two rotated moments (rows x cols each), per matrix of a stack."""
    *batch, rows, cols = shape
    count = batch[0] if batch else 1
    return count * 2 * (rows * rows + cols * cols + rows * cols)


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
    mean = replace(state, param=params / total, grad=grads / total, optim=optim / total)
    if step is not None and step.kind == "soap":
        return replace(mean, optim=_soap_mean(stats, layout, units, step))
    return mean


def _soap_mean(stats: ModelStats, layout: Layout, units: list[str] | None, step: MatrixStep) -> float:
    """``rank_state``'s mean for SOAP: the state bytes the rank holding ``units`` keeps, over the elements
    ``disttrain.plan.memory.model_state`` divides it among (dense over ``state_shards``, experts over ``ep`` x
    ``expert_state_shards``). Each matrix's state is whole on every rank of its shard group (FSDP2, tensor and
    expert parallelism gather it), a 1/dp_shard share of it under ZeRO-1 (one owner per matrix); AdamW's moments
    are laid out like their parameter."""
    owners = layout.dp_shard if layout.shards_only_optimizer_state else 1
    held = 0.0
    for name in stats.param_numel:
        if not param_on_rank(stats, name, units) or name in stats.frozen:
            continue
        if name in step.shapes:
            count, rows, cols = stepped_matrices(step, name)
            held += soap_values((count, rows, cols)) * step.precondition_bytes / owners
        else:
            expert = name in stats.expert_params
            shards = layout.ep * layout.expert_state_shards if expert else layout.state_shards
            held += _local(stats, layout, name) * step.other_state / shards
    params, experts = rank_params(stats, layout, units), rank_expert_params(stats, layout, units)
    spread = (params - experts) / layout.state_shards + experts / layout.ep / layout.expert_state_shards
    return held / spread if spread else step.other_state


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


def soap_flops(rows: int, cols: int, precondition_frequency: int) -> float:
    """FLOPs per optimiser step of SOAP on a ``rows x cols`` matrix: the gradient into the eigenbasis and the update
    out of it (``QLᵀ G QR``, ``QL U QRᵀ``: 4 r c (r + c)), ``G Gᵀ`` and ``Gᵀ G`` (2 r c (r + c)); and, once per
    ``precondition_frequency`` steps, the eigendecompositions of L and R (``EIGH_FLOPS`` (r^3 + c^3)) and the first
    moment into the new basis (4 r c (r + c)). Elementwise terms and the null spaces' QR are left out."""
    products = 2 * rows * cols * (rows + cols)
    refresh = EIGH_FLOPS * (rows ** 3 + cols ** 3) + 2 * products
    return 3 * products + refresh / precondition_frequency


def heads_held_whole(stats: ModelStats, layout: Layout, name: str, step: MatrixStep) -> int:
    """Over how many ranks the rank's shards of the attention projection ``name`` (stepped per head) split its
    heads while each holds whole ones, stepped where they lie as ``disttrain.optim.muon`` steps them: tensor
    parallelism alone (its split is along the heads' axis), or ZeRO-2/3 alone on a projection whose heads are rows
    (FSDP2 splits rows), into pieces of whole heads. 0: gathered whole (both split it, or pieces cut heads) or not
    per head."""
    if name not in step.heads:
        return 0
    axis, width = step.heads[name]
    tp_split, shards = _split(stats, layout, name)
    if tp_split and shards > 1:  # FSDP2 over tensor parallelism interleaves its pieces
        return 0
    pieces = layout.tp if tp_split else shards
    if not tp_split and axis != 0:
        return 0 if pieces > 1 else 1
    return pieces if step.shapes[name][axis] % (pieces * width) == 0 else 0


def orthogonalise_flops(stats: ModelStats, layout: Layout, units: list[str] | None, step: MatrixStep) -> float:
    """The matrix optimiser's FLOPs per optimiser step of the rank holding ``units``: every matrix it steps whole, a
    split one too (each rank of its shard group computes it), a 1/dp_shard share under ZeRO-1 (each matrix has one
    owner). Of a stack of matrices (3-D: experts) Muon steps the matrices of its local shard (split by experts, never
    gathered), SOAP every matrix (gathered whole). A projection stepped per head is its heads' matrices, of
    its local heads where its shard holds whole ones (Muon; SOAP gathers it whole)."""
    flops = 0.0
    owners = layout.dp_shard if layout.shards_only_optimizer_state else 1
    for name, shape in step.shapes.items():
        if not param_on_rank(stats, name, units):
            continue
        if step.kind == "soap":
            count, rows, cols = stepped_matrices(step, name)
            flops += soap_flops(rows, cols, step.precondition_frequency) * count / owners
            continue
        each = newton_schulz_flops(shape[-2], shape[-1], step.ns_steps)
        if name in step.heads:
            axis, width = step.heads[name]
            block = (width, shape[1]) if axis == 0 else (shape[0], width)
            local = heads_held_whole(stats, layout, name, step) or 1
            flops += newton_schulz_flops(*block, step.ns_steps) * shape[axis] // width / local / owners
        elif len(shape) == 3:
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
    """The all-gathers per optimiser step that make each split matrix of the rank holding ``units`` whole on every
    rank of its shard group (tensor parallelism's, ZeRO-2/3's or both: gathered over their product, which sends as
    much as a ring over it), after backward (nothing left to hide them): Muon's momentum in its dtype, of the 2-D
    matrices (its stacks of matrices are split by experts only and stepped where they lie); SOAP's gradients, of the
    stacks too (over expert parallelism's ranks as well). Muon steps a projection stepped per head
    whose shards hold whole heads where it lies."""
    groups: dict[tuple[str, int, int], tuple[float, int]] = {}
    shard_group = "dp_shard_cp" if layout.cp > 1 else "dp_shard"
    soap = step.kind == "soap"
    for name, shape in step.shapes.items():
        if (len(shape) != 2 and not soap) or not param_on_rank(stats, name, units):
            continue
        tp_split, shards = _split(stats, layout, name)
        ep = layout.ep if name in stats.expert_params else 1
        size = (layout.tp if tp_split else 1) * shards * ep
        if size == 1 or (not soap and heads_held_whole(stats, layout, name, step)):
            continue
        label = "+".join(g for g, on in (("ep", ep > 1), (shard_group, shards > 1), ("tp", tp_split)) if on)
        span = layout.tp * (layout.cp * layout.dp_shard if shards * ep > 1 else 1)
        buffer, calls = groups.get((label, size, span), (0.0, 0))
        per_value = GRADIENT_BYTES if soap else step.state
        groups[(label, size, span)] = (buffer + stats.param_numel[name] * per_value, calls + 1)
    return [collective("all_gather", label, size, buffer, calls, group_link(profile, span), after_step=True,
                       what="whole matrices")
            for (label, size, span), (buffer, calls) in groups.items()]
