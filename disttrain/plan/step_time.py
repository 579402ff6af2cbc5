"""Step time of a layout: a roofline per measured operator on the profile's calibrated rates, recompute under
each activation-checkpointing policy, context parallelism's share of the work, the optimiser's memory
traffic, the pipeline bubble, and the power it draws."""

from __future__ import annotations

from disttrain.plan.devices import HardwareProfile
from disttrain.plan.layout import Layout, StateBytes, policy_of_units, unit_on_rank, within
from disttrain.plan.model_stats import ModelStats
from disttrain.plan.ops import Op


def bubble_fraction(pp: int, microbatches: int, schedule: str, stages_per_rank: int = 1) -> float:
    """Idle fraction of a pipeline step: (p - 1) / (v m + p - 1) for GPipe and 1F1B (v = 1) and the
    interleaved schedules (Narayanan et al., 2021); zero-bubble schedules a third of 1F1B's (Qi et al., 2023,
    ZB-H1), which is what their handcrafted schedules reach with equal forward, input- and weight-gradient
    times."""
    if pp <= 1:
        return 0.0
    if schedule in ("zero_bubble", "zbv"):
        return (pp - 1) / (3 * microbatches * stages_per_rank + pp - 1)
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


def power(profile: HardwareProfile, world: int, per_device: float | None = None) -> float | None:
    """Watts of the devices a run of ``world`` ranks occupies (CPU ranks share all the cores of a machine), at
    ``per_device`` watts each (default: the profile's power under load)."""
    per_device = profile.watts if per_device is None else per_device
    if per_device is None:
        return None
    if profile.cpu:
        return per_device * profile.devices_per_node * -(-world // profile.devices_per_node)
    return per_device * world


def idle_power(profile: HardwareProfile, world: int) -> float | None:
    """Watts of the devices of ``power`` while they wait; None where the profile states no idle figure."""
    return None if profile.idle_watts is None else power(profile, world, profile.idle_watts)


def threads_per_rank(profile: HardwareProfile, world: int) -> float:
    """Cores each rank of a CPU run computes with: the runner's ``OMP_NUM_THREADS`` (cores // ranks), or a
    share of one core when there are more ranks than cores (they take turns)."""
    cores = profile.devices_per_node
    return cores // world if world <= cores else cores / world


def op_seconds(ops: list[Op], split: float, rates: tuple[float, float], bandwidth: float, overhead: float,
                overlapped: bool) -> float:
    """Roofline time of ``ops`` (each FLOPs and bytes divided by ``split``): the slower of compute (at the
    matrix-multiply or the convolution rate of ``rates``) and memory, plus the per-operator overhead (on a GPU
    the launch overlaps the work of the kernels before it)."""
    total = 0.0
    for flops, nbytes, conv, _ in ops:
        work = max(flops / split / rates[conv], nbytes / split / bandwidth)
        total += max(work, overhead) if overlapped else work + overhead
    return total


def in_any_block(unit: str, blocks: set[str]) -> bool:
    """Whether ``unit`` is one of the repeated blocks (tensor parallelism splits their work) or inside one."""
    return any(within(unit, b) for b in blocks)


def compute_seconds(stats: ModelStats, layout: Layout, ranks: list[list[str] | None], profile: HardwareProfile,
                     state: StateBytes, params: float, bf16: bool) -> tuple[float, float]:
    """Forward, backward, recompute and optimiser step of the busiest rank, and the recompute part of it:
    per-operator roofline times of the measured pass (tensor parallelism splits the work of the blocks;
    context parallelism the work of every operator, each rank computing 1/cp of the tokens and, with its early
    and late chunk, 1/cp of causal attention; embeddings, head, mixtures of experts and, in a block with gathering
    tp styles, what runs on whole activations are replicated over tp;
    expert parallelism moves rows, not work: under balanced routing a rank computes as many rows as it sends);
    backward is charged to units in proportion to their forward time. Recompute: a fully checkpointed unit's forward
    again; a selective one's operators other than matrix products and attention."""
    threads = threads_per_rank(profile, layout.world_size) if profile.cpu else 1
    dtype = "bf16" if bf16 else "fp32"
    rate = profile.flops[dtype] * threads
    rates = (rate, profile.flops.get(f"{dtype}_conv", profile.flops[dtype]) * threads)
    # a pass under autocast counted each operator's bytes in its own dtype; an fp32 pass of a bf16 run moves half
    bandwidth = profile.memory_bandwidth * threads * (2 if bf16 and not stats.autocast else 1)
    blocks = set(stats.shard_units)
    policies = policy_of_units(stats.shard_units, layout.activation_checkpoint, layout.checkpoint_every_n_blocks)

    cache = stats.__dict__.setdefault("_seconds", {})  # layouts share a pass: time each op list once per split

    def seconds(ops: list[Op], split: float) -> float:
        key = (id(ops), split, rates, bandwidth, profile.op_overhead, profile.cpu)
        if key not in cache:
            cache[key] = op_seconds(ops, split, rates, bandwidth, profile.op_overhead, not profile.cpu)
        return cache[key]

    def split(unit: str) -> int:
        return layout.cp * (layout.tp if in_any_block(unit, blocks) else 1)

    def unit_seconds(unit: str, ops: list[Op], mixture: list[Op]) -> float:
        """``ops`` of ``unit`` split as the unit is, but for those every tp rank runs whole (``mixture``: its
        mixtures of experts, or what a gathering unit runs on whole activations)."""
        if split(unit) == layout.cp or not mixture:
            return seconds(ops, split(unit))
        return seconds(ops, split(unit)) - seconds(mixture, split(unit)) + seconds(mixture, layout.cp)

    def recompute_seconds(unit: str) -> float:
        policy = next((p for block, p in policies.items() if within(unit, block)), "none")
        if policy == "full":
            return forward[unit]
        if policy == "selective":
            return unit_seconds(unit, stats.recomputed_ops[unit], stats.recomputed_tp_unsplit_ops.get(unit, []))
        return 0.0

    whole = sum(seconds(ops, 1) for ops in stats.forward_ops.values()) or 1.0
    forward = {u: unit_seconds(u, ops, stats.tp_unsplit_ops.get(u, [])) for u, ops in stats.forward_ops.items()}
    backward = seconds(stats.backward_ops, 1)
    passes = layout.accumulation * (layout.microbatches if layout.pp > 1 else 1)
    scale = layout.micro_size / (layout.microbatches if layout.pp > 1 else 1) / stats.micro_size
    worst, worst_recompute = 0.0, 0.0
    for units in ranks:
        mine = {u: t for u, t in forward.items() if unit_on_rank(stats, u, units)}
        own_backward = backward * sum(mine.values()) / whole  # this rank's share of the whole model's forward
        recompute = sum(recompute_seconds(u) for u in mine)
        if sum(mine.values()) + own_backward + recompute > worst:
            worst, worst_recompute = sum(mine.values()) + own_backward + recompute, recompute
    optimiser = params / layout.state_shards * (2 * state.param + state.grad + 2 * state.optim) / bandwidth
    return worst * scale * passes + optimiser, worst_recompute * scale * passes
