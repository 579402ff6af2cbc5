"""Predict one layout's per-rank memory, communication, pipeline bubble, step time and energy.

Memory follows the ZeRO paper (Rajbhandari et al., 2020, Section 5.1) with the bytes per parameter of the
run (``StateBytes``) and what FSDP2 does on top: under ZeRO-2 it keeps the parameter shards beside the whole
parameters it gathered for forward. Activations are what autograd saved in a meta-device pass of the model
(``ModelStats``; under bf16-mixed, a pass under autocast's lists: ``disttrain.plan.autocast``), scaled to the
micro-batch, divided by tensor parallelism as Megatron's activation analysis
has it (Korthikanti et al., 2022: 24 of 34 bytes per token and width are split without sequence parallelism,
all of them with it), divided by context parallelism (each rank holds 1/cp of every sequence, plus one
layer's gathered keys and values), and under activation checkpointing what each policy keeps: full the
checkpointed units' inputs, selective also the outputs of their matrix products and attention (measured in
the pass, operator by operator). Under expert parallelism a rank holds 1/ep of the experts, sharded over the
other dp_shard / ep x cp ranks, and exchanges token rows with all-to-all. Communication is charged per
collective in the ring model; time is the alpha-beta model of the profile's links.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from disttrain.plan.communication import Collective, collectives
from disttrain.plan.devices import HardwareProfile
from disttrain.plan.float8_cost import float8_cost, gathered_in_float8
from disttrain.plan.layout import (
    CHECKPOINT_POLICIES,
    Layout,
    StateBytes,
    expert_degrees,
    local_params,
    rank_expert_params,
    rank_params,
    rank_units,
    within,
)
from disttrain.plan.matrix_step import matrix_gathers, orthogonalise_flops, orthogonalise_seconds, rank_state
from disttrain.plan.memory import (
    ActivationBytes,
    activations,
    activations_by_length,
    block_buffers,
    dequantised_weight,
    model_state,
    root_unit,
    state_peak,
)
from disttrain.plan.model_stats import ModelStats
from disttrain.plan.step_time import bubble_fraction, compute_seconds, idle_power, power, threads_per_rank
from disttrain.plan.units import human_bytes

if TYPE_CHECKING:
    from disttrain.parallel.float8 import Float8Layers


@dataclass
class Estimate:
    """The prediction for one layout on one profile."""

    layout: Layout
    """The layout."""
    memory: dict[str, float]
    """Per-rank bytes of the most loaded rank, each term at its largest: params, grads, optimizer,
    activations, transient."""
    phases: dict[str, float]
    """Bytes in use at the moments memory peaks: after forward (model state, activations and transient
    buffers) and after backward (model state)."""
    activations_held: float
    """Activation bytes kept for backward when forward ends (``memory["activations"]`` is their peak)."""
    activations_by_policy: dict[str, float]
    """Peak activation bytes of this layout under each checkpointing policy (none, full, selective)."""
    activations_by_length: dict[int, dict[int, float | None]]
    """Sequence length -> cp degree -> peak activation bytes of this layout (``memory.activations_by_length``;
    empty for models without sequences)."""
    capacity: float
    """Memory per rank the profile allows."""
    collectives: list[Collective]
    """Collectives per optimiser step."""
    bubble: float
    """Pipeline bubble: fraction of a step the stages idle."""
    compute_s: float
    """Forward, backward (and recompute) time per step on one rank."""
    recompute_s: float
    """The part of ``compute_s`` that recomputes checkpointed activations."""
    exposed_comm_s: float
    """Communication time not hidden behind compute."""
    tokens_per_step: int
    """Tokens (samples, for images) per optimiser step over all ranks."""
    by_ep: dict[int, dict[str, float] | None] = field(default_factory=dict)
    """For a model with experts: ep degree (``EP_DEGREES`` and the layout's) -> this layout at that ep: per-rank
    ``params``, ``grads``, ``optimizer``, ``transient`` and ``peak`` bytes, and the bytes a rank sends per step in
    expert parallelism's all-to-alls (``all_to_all``) and in ZeRO's gathers and reduce-scatters (``fsdp``: the
    experts' over their own ranks included); None where the ep does not divide dp_shard and every layer's experts,
    or the layout has no ZeRO-2/3. Empty for other models."""
    grads_alternative: float | None = None
    """Gradient bytes under the other ``parallel.accumulate_grads`` choice (sharded <-> unsharded); None where
    there is no choice (no ZeRO-2/3 accumulation without pipelining)."""
    orthogonalise_flops: float = 0.0
    """FLOPs per optimiser step of a matrix optimiser's Newton-Schulz iteration on the busiest rank (0: none)."""
    orthogonalise_s: float = 0.0
    """Their time, part of ``compute_s``."""
    watts: float | None = None
    """Power of all the devices the run occupies (a CPU run: every core of the machine), when known."""
    idle_watts: float | None = None
    """Their power while they wait (exposed communication, the bubble); None: ``watts`` throughout."""
    notes: list[str] = field(default_factory=list)
    """Assumptions worth printing with the estimate."""

    @property
    def total_bytes(self) -> float:
        """Peak bytes of the most loaded rank."""
        return max(self.phases.values())

    @property
    def fits(self) -> bool:
        """The peak fits the profile's memory."""
        return self.total_bytes <= self.capacity

    @property
    def step_s(self) -> float:
        """Predicted seconds per optimiser step."""
        return self.compute_s / (1 - self.bubble) + self.exposed_comm_s

    @property
    def tokens_per_s(self) -> float:
        """Predicted throughput over all ranks."""
        return self.tokens_per_step / self.step_s

    @property
    def joules_per_token(self) -> float | None:
        """Predicted energy per token over all devices (None when the profile has no power figure): ``watts`` while
        the busiest rank computes, ``idle_watts`` (where stated) for the rest of the step."""
        if self.watts is None:
            return None
        waiting = self.step_s - self.compute_s
        idle = self.watts if self.idle_watts is None else self.idle_watts
        return (self.watts * self.compute_s + idle * waiting) / self.tokens_per_step

    def overflow(self) -> str:
        """Why it does not fit: how far over and the largest term; empty when it fits."""
        if self.fits:
            return ""
        term = max(self.memory, key=self.memory.get)
        over = self.total_bytes - self.capacity
        return (f"needs {human_bytes(self.total_bytes)} per rank of {human_bytes(self.capacity)} "
                f"({human_bytes(over)} over); largest term: {term} {human_bytes(self.memory[term])}")


EP_DEGREES = (1, 2, 4)
"""Expert-parallel degrees a plan of a model with experts shows (and the layout's own)."""


def busiest_units(stats: ModelStats, layout: Layout, ranks: list[list[str] | None]) -> list[str] | None:
    """The units of the pipeline rank that holds the most parameter elements (counting 1/ep of its experts)."""
    return max(ranks, key=lambda units: local_params(layout, rank_params(stats, layout, units),
                                                     rank_expert_params(stats, layout, units)))


def busiest_params(stats: ModelStats, layout: Layout, ranks: list[list[str] | None]) -> tuple[float, float]:
    """Parameter elements before data-parallel sharding of the pipeline rank that holds the most (counting 1/ep
    of its experts), and how many of them are experts'."""
    units = busiest_units(stats, layout, ranks)
    return rank_params(stats, layout, units), rank_expert_params(stats, layout, units)


def activation_dtype(stats: ModelStats, bf16: bool) -> float:
    """Bytes of the run's activations per byte the pass measured: 1 for a pass in the run's own dtypes (fp32, or
    bf16-mixed measured under autocast), a half for a bf16 run of an fp32 pass (bf16-true: every tensor bf16)."""
    return 0.5 if bf16 and not stats.autocast else 1.0


def weight_copies(layout: Layout, gather_bf16: bool) -> bool:
    """Whether autocast makes bf16 copies of the weights: not where FSDP2 (ZeRO-2/3) gathers them in bf16."""
    return not (gather_bf16 and layout.shards_parameters)


def estimate(stats: ModelStats, layout: Layout, profile: HardwareProfile, state: StateBytes,
             bf16: bool = False, float8: Float8Layers | None = None) -> Estimate:
    """Predict ``layout`` for the model measured in ``stats`` on ``profile``; ``float8``: the linear layers that
    train in float8 (``trainer.fp8``; None: none), priced by ``disttrain.plan.float8_cost``."""
    scale = layout.micro_size / stats.micro_size
    act_dtype = activation_dtype(stats, bf16)
    ranks = rank_units(stats, layout)
    params, experts = busiest_params(stats, layout, ranks)
    busiest = busiest_units(stats, layout, ranks)
    state = rank_state(stats, layout, busiest, state)
    alternative = None
    if layout.shards_gradients and layout.pp == 1 and layout.accumulation > 1:
        other = replace(layout, accumulate_grads="unsharded" if layout.sharded_accumulation else "sharded")
        alternative = model_state(params, other, state, experts)["grads"]
    gather_bf16 = bf16 and not profile.cpu
    copies = weight_copies(layout, gather_bf16)
    policies = {policy: activations(stats, ranks[0], replace(layout, activation_checkpoint=policy), scale * act_dtype,
                                    copies) for policy in CHECKPOINT_POLICIES}
    mine = policies[layout.activation_checkpoint]
    float8_gathered = frozenset(gathered_in_float8(stats, layout, float8))
    memory, phases = _memory(stats, layout, state, params, experts, mine, float8_gathered,
                             dequantised_weight(stats, ranks[0]))
    # the rows experts exchange are the normalised residual stream, which autocast leaves in fp32 (and on a CPU the
    # grouped product returns fp32 too): the pass's bytes under bf16-mixed as well
    f8 = None
    if float8 is not None:
        threads = threads_per_rank(profile, layout.world_size) if profile.cpu else 1
        f8 = float8_cost(stats, layout, busiest, profile, float8, "bf16" if bf16 else "fp32",
                         2 if bf16 else 4, threads)
    traffic = collectives(stats, layout, state, params, ranks, scale * act_dtype, profile, gather_bf16, experts,
                          scale, f8.gathered_elements if f8 else 0.0)
    compute, recompute = compute_seconds(stats, layout, ranks, profile, state, params, bf16)
    notes = []
    if f8 is not None:
        compute += f8.seconds
        notes.append(f"trainer.fp8={float8.recipe}: {len(float8.modules)} linear layers' products at the "
                     + (f"profile's float8 rate (saves {f8.products_saved_s * 1e3:.3g} ms a step)" if f8.priced_at
                        == "fp8" else f"run's {f8.priced_at} rate (the profile states no float8 rate)")
                     + f", casts to float8 {f8.casts_s * 1e3:.3g} ms a step"
                     + (", weights gathered in float8" if float8_gathered else ""))
    ns_flops = ns_seconds = 0.0
    if state.matrices is not None:  # a matrix optimiser: its gathers and iteration, once per optimiser step
        traffic += matrix_gathers(stats, layout, busiest, state.matrices, profile)
        ns_flops = orthogonalise_flops(stats, layout, busiest, state.matrices)
        ns_seconds = orthogonalise_seconds(ns_flops, layout, profile, state.matrices)
    shared_cpu = profile.cpu
    overlappable = [c for c in traffic if c.group.startswith("dp") and not c.after_step]
    dp_time = sum(c.seconds for c in overlappable)
    other = sum(c.seconds for c in traffic if not any(c is o for o in overlappable))
    # data-parallel collectives of backward overlap it on GPUs; gloo on a shared CPU runs on the cores that
    # compute; what runs after the optimiser step (ZeRO-1's broadcast) has nothing to overlap
    exposed = other + (dp_time if shared_cpu else max(0.0, dp_time - compute * 2 / 3))
    compute += ns_seconds  # after backward: the iteration hides no communication
    # CPU ranks of this machine share its memory (a whole machine's worth split over the ranks), unless a
    # budget per rank is stated
    shares = profile.cpu and not profile.memory_per_rank
    capacity = profile.memory_bytes * profile.devices_per_node / layout.world_size if shares else profile.memory_bytes
    # the cp ranks of one data-parallel index share their samples: cp adds no tokens to a step
    tokens = layout.micro_size * layout.accumulation * layout.dp * stats.tokens_per_sample
    by_ep = {}
    if stats.has_experts:
        fitting = expert_degrees(stats, layout.dp_shard, layout.shards_parameters)
        for ep in sorted({*EP_DEGREES, layout.ep}):
            by_ep[ep] = _at_ep(stats, replace(layout, ep=ep), state, ranks, scale, act_dtype, profile,
                               gather_bf16) if ep in fitting else None
    return Estimate(layout, memory, phases, mine.held, {p: a.peak for p, a in policies.items()},
                    activations_by_length(stats, ranks[0], layout, scale * act_dtype, copies), capacity, traffic,
                    bubble_fraction(layout.pp, layout.microbatches, layout.schedule, layout.stages_per_rank),
                    compute, recompute, exposed, tokens, by_ep, alternative, ns_flops, ns_seconds,
                    power(profile, layout.world_size), idle_power(profile, layout.world_size), notes)


def _memory(stats: ModelStats, layout: Layout, state: StateBytes, params: float, experts: float,
            acts: ActivationBytes, float8_gathered: frozenset[str] = frozenset(), dequantised: float = 0.0
            ) -> tuple[dict[str, float], dict[str, float]]:
    """Per-rank memory terms and the bytes in use at the moments memory peaks (``Estimate.memory`` and
    ``Estimate.phases``): after forward, when backward reaches the first block (every later unit's gradient
    exists beside that block's activations) and after backward. ``float8_gathered``: parameters FSDP2 gathers in
    float8; ``dequantised``: the largest weight a quantised layer dequantises for a product
    (``memory.dequantised_weight``), a transient of every block's backward."""
    memory = model_state(params, layout, state, experts)
    memory["activations"] = acts.peak
    buffers = block_buffers(stats, layout, state, float8_gathered)
    phases = state_peak(params, layout, state, experts)
    # a block's gathered unit comes with its backward, the gathered embedding and head with the head's and stay
    # until the end of backward, and neither comes with the loss's
    root = root_unit(stats, layout, state)
    # an earlier block's backward runs once the last block's activations are gone; a block's own gradients may
    # come while all of its activations are there (its widest part's backward runs first)
    earlier = acts.in_backward - acts.block_kept
    # a quantised layer's backward dequantises its weight beside what the block's backward holds (a forward, which
    # holds less, does too)
    in_blocks = max(acts.in_backward + buffers.last_with_grads, earlier + buffers.earlier_with_grads) + dequantised
    phases["after_forward"] += max(acts.at_start, acts.at_head + root.at_head, in_blocks + root.in_blocks)
    memory["transient"] = max(buffers.most + root.in_blocks + dequantised, root.at_head)
    if acts.first_block is not None:
        first = sum(n / (layout.tp if stats.tp_sharded.get(name) else 1) for name, n in stats.param_numel.items()
                    if within(stats.param_unit[name], acts.first_block))
        pending = memory["grads"] * min(first / params, 1.0) if params else 0.0
        phases["in_first_block"] = (memory["params"] + memory["grads"] - pending + memory["optimizer"]
                                    + acts.in_first_block + buffers.first_start + root.in_blocks + dequantised)
    return memory, phases


def _at_ep(stats: ModelStats, layout: Layout, state: StateBytes, ranks: list[list[str] | None], scale: float,
           act_dtype: float, profile: HardwareProfile, gather_bf16: bool) -> dict[str, float]:
    """``Estimate.by_ep``'s figures of ``layout`` (as ``estimate`` reckons them)."""
    params, experts = busiest_params(stats, layout, ranks)
    state = rank_state(stats, layout, busiest_units(stats, layout, ranks), state)
    memory, phases = _memory(stats, layout, state, params, experts, activations(
        stats, ranks[0], layout, scale * act_dtype, weight_copies(layout, gather_bf16)),
        dequantised=dequantised_weight(stats, ranks[0]))
    traffic = collectives(stats, layout, state, params, ranks, scale * act_dtype, profile, gather_bf16, experts,
                          scale)
    return {**{term: memory[term] for term in ("params", "grads", "optimizer", "transient")},
            "peak": max(phases.values()),
            "all_to_all": sum(c.sent_bytes for c in traffic if c.group == "ep"),
            "fsdp": sum(c.sent_bytes for c in traffic if c.kind in ("all_gather", "reduce_scatter")
                        and c.group.startswith("dp_shard"))}
