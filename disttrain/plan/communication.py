"""Collectives per optimiser step of a layout, their bytes in the ring model and their time on the profile's
links (alpha-beta)."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.plan.devices import HardwareProfile, Link
from disttrain.plan.layout import Layout, StateBytes, policy_of_units, unit_on_rank, within
from disttrain.plan.model_stats import ModelStats


@dataclass
class Collective:
    """One kind of collective a rank takes part in each optimiser step."""

    kind: str
    """all_reduce, reduce_scatter, all_gather, all_to_all, broadcast or send (point-to-point)."""
    group: str
    """Mesh dimension it runs over (dp_replicate, dp_shard, cp, tp, pp, ep), or the flattened ones of cp > 1:
    dp_shard_cp (ZeRO-2/3 shard over dp_shard x cp) and dp_cp (replicas average gradients over dp x cp); under
    expert parallelism experts shard over dp_shard_mod_ep (dp_shard_mod_ep_cp with cp)."""
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
    what: str = ""
    """What it moves, where the kind and group leave it open (expert parallelism's rows and their counts)."""

    @property
    def label(self) -> str:
        """The kind, and what it moves where that is said."""
        return f"{self.kind} ({self.what})" if self.what else self.kind


# Bytes each rank sends (and receives), as a fraction of the whole buffer, in a ring of n ranks: an all-gather
# passes the n chunks of size B/n around the ring in n - 1 steps, so each rank sends and receives (n - 1) B / n;
# a reduce-scatter is the same with additions; an all-reduce is both, 2 (n - 1) B / n. An all-to-all sends each
# of the other n - 1 ranks its chunk directly: (n - 1) B / n too, in n - 1 exchanges.
RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
               "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
               "broadcast": lambda n: (n - 1) / n, "send": lambda n: 1.0}


RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "reduce_scatter": lambda n: n - 1, "all_gather": lambda n: n - 1,
              "all_to_all": lambda n: n - 1, "broadcast": lambda n: n - 1, "send": lambda n: 1}


def group_link(profile: HardwareProfile, span: int) -> Link:
    """The link a group spanning ``span`` consecutive ranks uses (the mesh is pp, dp_replicate, dp_shard, cp,
    tp: tp's ranks are neighbours, then cp's)."""
    return profile.intra_node if span <= profile.devices_per_node else profile.inter_node


def collective(kind: str, group: str, size: int, buffer: float, calls: int, link: Link,
               after_step: bool = False, what: str = "") -> Collective:
    """``calls`` calls of ``kind`` over ``group`` moving ``buffer`` bytes in all, timed on ``link``."""
    sent = RING_FACTOR[kind](size) * buffer
    seconds = sent / link.bandwidth + calls * RING_STEPS[kind](size) * link.latency
    return Collective(kind, group, size, buffer, calls, sent, seconds, after_step, what)


def collectives(stats: ModelStats, layout: Layout, state: StateBytes, params: float,
                 ranks: list[list[str] | None], act_scale: float, profile: HardwareProfile,
                 gather_bf16: bool = False, experts: float = 0.0, row_scale: float | None = None,
                 float8_elements: float = 0.0) -> list[Collective]:
    """What each rank sends per optimiser step, by group; ``params``: the rank's parameter elements before
    data-parallel sharding, ``experts`` of them experts' (under expert parallelism FSDP gathers and reduces a
    rank's 1/ep of them over their own ranks, dp_shard / ep x cp); ``act_scale``: bytes per measured byte of
    activations, ``row_scale`` of the rows experts exchange (None: the same); ``float8_elements``: of the dense
    parameter elements, those FSDP2 gathers in float8 (one byte each, ``disttrain.plan.float8_cost``)."""
    out: list[Collective] = []
    acc, tp, cp, ds, dr = layout.accumulation, layout.tp, layout.cp, layout.dp_shard, layout.dp_replicate
    shards = layout.state_shards
    link_tp = group_link(profile, tp)
    link_cp = group_link(profile, tp * cp)
    link_ds = group_link(profile, tp * cp * ds)
    link_dr = group_link(profile, tp * cp * ds * dr)
    shard_group = "dp_shard_cp" if cp > 1 else "dp_shard"
    expert_parallel = layout.ep > 1
    dense = params - experts if expert_parallel else params
    # FSDP2 under bf16-mixed on a GPU gathers bf16 copies of the parameters (reduces gradients in fp32)
    param_bytes = 2 if gather_bf16 else state.param
    grads, weights = dense * state.grad, dense * param_bytes
    if not layout.shards_optimizer_state and dr * cp > 1:  # DDP averages over the replicas and the cp ranks
        out.append(collective("all_reduce", "dp_cp" if cp > 1 else "dp_replicate", dr * cp, grads, 1, link_dr))
    if layout.shards_only_optimizer_state and ds > 1:
        out.append(collective("all_reduce", "dp_shard", ds, grads, 1, link_ds))
        # each rank broadcasts the parameters it stepped: after the optimiser step, so nothing overlaps it
        out.append(collective("broadcast", "dp_shard", ds, weights, ds, link_ds, after_step=True))
    if layout.shards_gradients:
        gathers = acc * layout.gathers_per_microbatch
        scatters = acc if layout.sharded_accumulation else 1  # every micro-batch, or once per step
        groups = [(shard_group, shards, dense)]
        if expert_parallel:  # the rank's own experts, over the ranks that share them (their span is dp_shard's)
            groups.append(("dp_shard_mod_ep_cp" if cp > 1 else "dp_shard_mod_ep", layout.expert_state_shards,
                           experts / layout.ep))
        for group, size, elements in groups:
            if size > 1 and elements:
                float8 = float8_elements if group == shard_group else 0.0
                gathered = (elements - float8) * param_bytes + float8
                out.append(collective("all_gather", group, size, gathered * gathers, gathers, link_ds))
                out.append(collective("reduce_scatter", group, size, elements * state.grad * scatters, scatters,
                                      link_ds))
        if dr > 1:  # each rank's shards: its dense and expert ones are 1 / (dp_shard x cp) of their wholes alike
            out.append(collective("all_reduce", "dp_replicate", dr, params * state.grad / shards, 1, link_dr))
    recomputed = _recomputed_fraction(stats, layout)
    tokens = act_scale / cp  # activations a rank sends are its 1/cp of the sequence
    if tp > 1:
        micro = tokens * acc
        forward = stats.tp_forward_bytes * micro * (1 + recomputed)  # recomputed forwards all-reduce again
        backward = stats.tp_backward_bytes * micro
        kinds = ("reduce_scatter", "all_gather") if layout.sequence_parallel else ("all_reduce",)
        for kind in kinds:
            out.append(collective(kind, "tp", tp, forward + backward, acc, link_tp))
        # gathered outputs (gathered again where recomputed) and whole inputs' gradients
        gathered = (stats.tp_forward_gather_bytes * (1 + recomputed) + stats.tp_backward_gather_bytes) * micro
        if gathered:
            out.append(collective("all_gather", "tp", tp, gathered, acc, link_tp, what="activations"))
        if stats.tp_weight_grad_bytes:  # whole weights' gradients, once per backward whatever the tokens
            out.append(collective("all_reduce", "tp", tp, stats.tp_weight_grad_bytes * acc, acc, link_tp,
                                  what="whole weights' gradients"))
    if cp > 1:
        out += context_parallel(stats, layout, ranks, act_scale, link_cp)
    if expert_parallel:
        out += expert_exchange(stats, layout, ranks, act_scale if row_scale is None else row_scale,
                               group_link(profile, tp * cp * layout.ep))
    if layout.pp > 1:
        boundaries = [stats.unit_output_bytes.get(units[-1], 0) for units in ranks if units]
        per_micro = max(boundaries) * tokens / layout.microbatches
        sends = 2 * layout.microbatches * acc  # activations forward, their gradients backward
        link_pp = group_link(profile, layout.world_size)
        out.append(collective("send", "pp", layout.pp, per_micro * sends, sends, link_pp))
    return out


def context_parallel(stats: ModelStats, layout: Layout, ranks: list[list[str] | None], act_scale: float,
                     link: Link) -> list[Collective]:
    """Context parallelism's collectives of the busiest pipeline rank: every attention layer all-gathers the
    keys and values of the whole sequence over the cp group in forward, and again in backward (the gathered
    ones are not kept); a checkpointed layer's recomputed forward gathers them a third time; backward sends the
    gradients of the gathered keys and values back to their ranks (an all-to-all of the same size). Buffers
    are the whole sequence's K and V (``act_scale`` of the measured ones, split over tp's heads); each rank
    sends (and receives) (cp - 1) / cp of them (``RING_FACTOR``)."""
    policies = policy_of_units(stats.shard_units, layout.activation_checkpoint, layout.checkpoint_every_n_blocks)
    per_pass = 1 if layout.pp == 1 else layout.microbatches  # a micro-batch's microbatches each gather theirs
    busiest = (0.0, 0.0, 0, 0)
    for units in ranks:
        gathered = again = 0.0
        layers = recomputed_layers = 0
        for unit, sizes in stats.attention_kv_bytes.items():
            if not sizes or not unit_on_rank(stats, unit, units):
                continue
            checkpointed = any(p != "none" and within(unit, block) for block, p in policies.items())
            gathered, layers = gathered + sum(sizes), layers + len(sizes)
            if checkpointed:
                again, recomputed_layers = again + sum(sizes), recomputed_layers + len(sizes)
        busiest = max(busiest, (gathered, again, layers, recomputed_layers))
    gathered, again, layers, recomputed_layers = busiest
    if not layers:
        return []
    per_step = act_scale / layout.tp * layout.accumulation  # measured bytes -> this run's, per optimiser step
    calls = layout.accumulation * per_pass
    return [collective("all_gather", "cp", layout.cp, (2 * gathered + again) * per_step,
                       (2 * layers + recomputed_layers) * calls, link),
            collective("all_to_all", "cp", layout.cp, gathered * per_step, layers * calls, link)]


def expert_exchange(stats: ModelStats, layout: Layout, ranks: list[list[str] | None], act_scale: float,
                    link: Link) -> list[Collective]:
    """Expert parallelism's all-to-alls of the busiest pipeline rank, per optimiser step. Each mixture of experts
    sends its rows to their experts' ranks and the results back in forward (two all-to-alls over the ep group),
    and their gradients the same ways in backward (two more); a checkpointed block's recomputed forward sends
    them again (full and selective alike: neither keeps what an all-to-all received). The rows are the
    rank's tokens (1/cp of each sequence; tp ranks each send their own, as each runs the whole mixture) x
    experts per token, at ``act_scale`` of the measured bytes; each rank sends (ep - 1) / ep of them
    (``RING_FACTOR``: under balanced routing the rows for its own experts stay). Before each forward exchange
    the ranks swap how many rows each sends to each expert (one small all-to-all of n_experts integers)."""
    policies = policy_of_units(stats.shard_units, layout.activation_checkpoint, layout.checkpoint_every_n_blocks)
    per_pass = 1 if layout.pp == 1 else layout.microbatches  # a micro-batch's microbatches each exchange theirs
    busiest = (0.0, 0, 0.0, 0, 0)
    for units in ranks:
        rows = again = counts = 0.0
        layers = recomputed = 0
        for call in stats.expert_calls:
            if not unit_on_rank(stats, call.unit, units):
                continue
            checkpointed = any(p != "none" and within(call.unit, block) for block, p in policies.items())
            forwards = 2 if checkpointed else 1
            rows, layers = rows + call.in_bytes + call.out_bytes, layers + 1
            again, recomputed = again + (forwards - 1) * (call.in_bytes + call.out_bytes), recomputed + forwards - 1
            counts += forwards * call.n_experts * 8  # int64 counts
        busiest = max(busiest, (rows, layers, again, recomputed, counts))
    rows, layers, again, recomputed, counts = busiest
    if not layers:
        return []
    passes = layout.accumulation * per_pass
    per_step = act_scale / layout.cp * layout.accumulation  # measured bytes -> this rank's, per optimiser step
    return [collective("all_to_all", "ep", layout.ep, (2 * rows + again) * per_step,
                       (4 * layers + 2 * recomputed) * passes, link, what="token rows"),
            collective("all_to_all", "ep", layout.ep, counts * passes, (layers + recomputed) * passes, link,
                       what="row counts")]


def _recomputed_fraction(stats: ModelStats, layout: Layout) -> float:
    """The fraction of the shard units a checkpointing policy recomputes."""
    if layout.activation_checkpoint == "none" or not stats.shard_units:
        return 0.0
    policies = policy_of_units(stats.shard_units, layout.activation_checkpoint, layout.checkpoint_every_n_blocks)
    return sum(p != "none" for p in policies.values()) / len(stats.shard_units)
