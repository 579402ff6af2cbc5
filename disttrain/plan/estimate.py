"""Predict one layout's per-rank memory, communication, pipeline bubble, step time and energy.

Memory follows the ZeRO paper (Rajbhandari et al., 2020, Section 5.1) with the bytes per parameter of the
run (``StateBytes``) and what FSDP2 does on top: under ZeRO-2 it keeps the parameter shards beside the whole
parameters it gathered for forward. Activations are what autograd saved in a meta-device pass of the model
(``ModelStats``), scaled to the micro-batch, divided by tensor parallelism as Megatron's activation analysis
has it (Korthikanti et al., 2022: 24 of 34 bytes per token and width are split without sequence parallelism,
all of them with it), divided by context parallelism (each rank holds 1/cp of every sequence, plus one
layer's gathered keys and values), and under activation checkpointing what each policy keeps: full the
checkpointed units' inputs, selective also the outputs of their matrix products and attention (measured in
the pass, operator by operator). Communication is charged per collective in the ring model; time is the
alpha-beta model of the profile's links.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from disttrain.plan.communication import Collective, collectives
from disttrain.plan.devices import HardwareProfile
from disttrain.plan.layout import CHECKPOINT_POLICIES, Layout, StateBytes, rank_params, rank_units
from disttrain.plan.memory import activations, activations_by_length, model_state, state_peak, transient
from disttrain.plan.model_stats import ModelStats
from disttrain.plan.step_time import bubble_fraction, compute_seconds, power
from disttrain.plan.units import human_bytes


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
    grads_alternative: float | None = None
    """Gradient bytes under the other ``parallel.accumulate_grads`` choice (sharded <-> unsharded); None where
    there is no choice (no ZeRO-2/3 accumulation without pipelining)."""
    watts: float | None = None
    """Power of all the devices the run occupies (a CPU run: every core of the machine), when known."""
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
        """Predicted energy per token over all devices (None when the profile has no power figure)."""
        if self.watts is None:
            return None
        return self.watts * self.step_s / self.tokens_per_step

    def overflow(self) -> str:
        """Why it does not fit: how far over and the largest term; empty when it fits."""
        if self.fits:
            return ""
        term = max(self.memory, key=self.memory.get)
        over = self.total_bytes - self.capacity
        return (f"needs {human_bytes(self.total_bytes)} per rank of {human_bytes(self.capacity)} "
                f"({human_bytes(over)} over); largest term: {term} {human_bytes(self.memory[term])}")


def estimate(stats: ModelStats, layout: Layout, profile: HardwareProfile, state: StateBytes,
             bf16: bool = False) -> Estimate:
    """Predict ``layout`` for the model measured in ``stats`` on ``profile``."""
    scale = layout.micro_size / stats.micro_size
    act_dtype = 0.5 if bf16 else 1.0  # autocast keeps matmul outputs in bf16 (norms and softmax stay fp32)
    ranks = rank_units(stats, layout)
    params = max(rank_params(stats, layout, units) for units in ranks)
    memory = model_state(params, layout, state)
    alternative = None
    if layout.zero_stage >= 2 and layout.pp == 1 and layout.accumulation > 1:
        other = replace(layout, accumulate_grads="unsharded" if layout.sharded_accumulation else "sharded")
        alternative = model_state(params, other, state)["grads"]
    policies = {policy: activations(stats, ranks[0], replace(layout, activation_checkpoint=policy), scale * act_dtype)
                for policy in CHECKPOINT_POLICIES}
    mine = policies[layout.activation_checkpoint]
    memory["activations"] = mine.peak
    memory["transient"] = transient(stats, layout, state)
    phases = state_peak(params, layout, state)
    phases["after_forward"] += memory["activations"] + memory["transient"]
    traffic = collectives(stats, layout, state, params, ranks, scale * act_dtype, profile,
                          gather_bf16=bf16 and not profile.cpu)
    compute, recompute = compute_seconds(stats, layout, ranks, profile, state, params, bf16)
    shared_cpu = profile.cpu
    overlappable = [c for c in traffic if c.group.startswith("dp") and not c.after_step]
    dp_time = sum(c.seconds for c in overlappable)
    other = sum(c.seconds for c in traffic if not any(c is o for o in overlappable))
    # data-parallel collectives of backward overlap it on GPUs; gloo on a shared CPU runs on the cores that
    # compute; what runs after the optimiser step (ZeRO-1's broadcast) has nothing to overlap
    exposed = other + (dp_time if shared_cpu else max(0.0, dp_time - compute * 2 / 3))
    # CPU ranks of this machine share its memory (a whole machine's worth split over the ranks), unless a
    # budget per rank is stated
    shares = profile.cpu and not profile.memory_per_rank
    capacity = profile.memory_bytes * profile.devices_per_node / layout.world_size if shares else profile.memory_bytes
    # the cp ranks of one data-parallel index share their samples: cp adds no tokens to a step
    tokens = layout.micro_size * layout.accumulation * layout.dp * stats.tokens_per_sample
    return Estimate(layout, memory, phases, mine.held, {p: a.peak for p, a in policies.items()},
                    activations_by_length(stats, ranks[0], layout, scale * act_dtype), capacity, traffic,
                    bubble_fraction(layout.pp, layout.microbatches, layout.schedule, layout.stages_per_rank),
                    compute, recompute, exposed, tokens, alternative, power(profile, layout.world_size))
