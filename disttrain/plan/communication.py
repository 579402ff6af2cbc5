"""Collectives per optimiser step of a layout, their bytes in the ring model and their time on the profile's
links (alpha-beta)."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.plan.devices import HardwareProfile, Link
from disttrain.plan.layout import Layout, StateBytes
from disttrain.plan.model_stats import ModelStats


@dataclass
class Collective:
    """One kind of collective a rank takes part in each optimiser step."""

    kind: str
    """all_reduce, reduce_scatter, all_gather, broadcast or send (point-to-point)."""
    group: str
    """Mesh dimension it runs over (dp_replicate, dp_shard, tp, pp)."""
    size: int
    """Ranks in the group."""
    buffer_bytes: float
    """Whole-buffer bytes per step (all calls together)."""
    calls: int
    """Calls per step."""
    sent_bytes: float = 0.0
    """Bytes this rank sends per step in the ring model."""
    seconds: float = 0.0
    """Predicted time per step on the profile's link."""
    after_step: bool = False
    """Runs after the optimiser step (ZeRO-1's parameter broadcast), when no backward is left to hide it."""


RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
               "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: (n - 1) / n, "send": lambda n: 1.0}


RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "reduce_scatter": lambda n: n - 1, "all_gather": lambda n: n - 1,
              "broadcast": lambda n: n - 1, "send": lambda n: 1}


def group_link(profile: HardwareProfile, span: int) -> Link:
    """The link a group spanning ``span`` consecutive ranks uses (the mesh is pp, dp_replicate, dp_shard, tp)."""
    return profile.intra_node if span <= profile.devices_per_node else profile.inter_node


def collective(kind: str, group: str, size: int, buffer: float, calls: int, link: Link,
               after_step: bool = False) -> Collective:
    """``calls`` calls of ``kind`` over ``group`` moving ``buffer`` bytes in all, timed on ``link``."""
    sent = RING_FACTOR[kind](size) * buffer
    seconds = sent / link.bandwidth + calls * RING_STEPS[kind](size) * link.latency
    return Collective(kind, group, size, buffer, calls, sent, seconds, after_step)


def collectives(stats: ModelStats, layout: Layout, state: StateBytes, params: float,
                 ranks: list[list[str] | None], act_scale: float, profile: HardwareProfile,
                 gather_bf16: bool = False) -> list[Collective]:
    """What each rank sends per optimiser step, by group."""
    out: list[Collective] = []
    acc, tp, ds, dr = layout.accumulation, layout.tp, layout.dp_shard, layout.dp_replicate
    link_tp = group_link(profile, tp)
    link_ds = group_link(profile, tp * ds)
    link_dr = group_link(profile, tp * ds * dr)
    # FSDP2 under bf16-mixed on a GPU gathers bf16 copies of the parameters (reduces gradients in fp32)
    grads, weights = params * state.grad, params * (2 if gather_bf16 else state.param)
    if layout.zero_stage == 0 and dr > 1:
        out.append(collective("all_reduce", "dp_replicate", dr, grads, 1, link_dr))
    if layout.zero_stage == 1 and ds > 1:
        out.append(collective("all_reduce", "dp_shard", ds, grads, 1, link_ds))
        # each rank broadcasts the parameters it stepped: after the optimiser step, so nothing overlaps it
        out.append(collective("broadcast", "dp_shard", ds, weights, ds, link_ds, after_step=True))
    if layout.zero_stage >= 2 and ds > 1:
        gathers = acc * (2 if layout.zero_stage == 3 else 1)
        out.append(collective("all_gather", "dp_shard", ds, weights * gathers, gathers, link_ds))
        scatters = acc if layout.sharded_accumulation else 1  # every micro-batch, or once per step
        out.append(collective("reduce_scatter", "dp_shard", ds, grads * scatters, scatters, link_ds))
        if dr > 1:
            out.append(collective("all_reduce", "dp_replicate", dr, grads / ds, 1, link_dr))
    if tp > 1:
        micro = act_scale * acc
        recompute = 2 if layout.activation_checkpointing else 1  # recomputed forwards all-reduce again
        forward = stats.tp_forward_bytes * micro * recompute
        backward = stats.tp_backward_bytes * micro
        kinds = ("reduce_scatter", "all_gather") if layout.sequence_parallel else ("all_reduce",)
        for kind in kinds:
            out.append(collective(kind, "tp", tp, forward + backward, acc, link_tp))
    if layout.pp > 1:
        boundaries = [stats.unit_output_bytes.get(units[-1], 0) for units in ranks if units]
        per_micro = max(boundaries) * act_scale / layout.microbatches
        sends = 2 * layout.microbatches * acc  # activations forward, their gradients backward
        link_pp = group_link(profile, layout.world_size)
        out.append(collective("send", "pp", layout.pp, per_micro * sends, sends, link_pp))
    return out
