"""Per-rank memory of a layout: model state after the ZeRO paper with FSDP2's ZeRO-2 detail, activations
from the measured pass (Megatron's tensor-parallel split, each checkpointing policy, context parallelism's
share of the sequence), and short-lived buffers."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from disttrain.plan.layout import Layout, StateBytes, policy_of_units, unit_on_rank, within
from disttrain.plan.model_stats import ModelStats
from disttrain.plan.recorder import ROOT

CP_DEGREES = (1, 2, 4)
"""Context-parallel degrees the report's table of activations by sequence length shows."""
LENGTH_FACTORS = (0.25, 0.5, 1, 2, 4)
"""Sequence lengths that table shows, as multiples of the run's."""


def model_state(params: float, layout: Layout, state: StateBytes, experts: float = 0.0) -> dict[str, float]:
    """Bytes per rank of parameters, gradients and optimiser state (each at its largest during a step) for
    ``params`` elements on this rank before data-parallel sharding (its tensor-parallel and pipeline share), of
    which ``experts`` are experts': a rank holds 1/ep of those, sharded over dp_shard / ep x cp under ZeRO
    (``Layout.expert_state_shards``), and the rest over dp_shard x cp as without expert parallelism."""
    dense = _state(params - experts, layout.state_shards, layout, state)
    if not experts:
        return dense
    own = _state(experts / layout.ep, layout.expert_state_shards, layout, state)
    return {term: dense[term] + own[term] for term in dense}


def _state(params: float, shard: int, layout: Layout, state: StateBytes) -> dict[str, float]:
    """``model_state`` of ``params`` elements that ZeRO shards over ``shard`` ranks."""
    p = params * state.param
    if layout.stage_keeps_whole:  # whole through the stage's backwards, beside the shards
        held = p + p / shard
    elif layout.reshards_after_forward:
        held = p / shard
    elif layout.keeps_gathered_parameters and state.zero2_keeps_shards:
        held = p + p / shard
    else:
        held = p
    # unsharded accumulation keeps whole gradients until the step's last micro-batch reduce-scatters them
    grads = params * state.grad / (1 if layout.whole_grads else shard)
    return {"params": held, "grads": grads, "optimizer": params * state.optim / shard}


def sharded_params(params: float, layout: Layout, experts: float = 0.0) -> float:
    """Parameter elements of a rank's shards (``model_state``'s split: experts' over ep and their shard ranks)."""
    return (params - experts) / layout.state_shards + experts / layout.ep / layout.expert_state_shards


def state_peak(params: float, layout: Layout, state: StateBytes, experts: float = 0.0) -> dict[str, float]:
    """Model state at the two moments it peaks: after forward (ZeRO-2 holds whole parameters; gradients exist
    only while accumulating, in a 1F1B pipeline's steady state, and always under DDP, whose buckets hold them) and
    after backward (ZeRO-2 has resharded; every gradient exists)."""
    terms = model_state(params, layout, state, experts)
    if layout.keeps_gathered_parameters and state.zero2_keeps_shards:
        resharded = sharded_params(params, layout, experts) * state.param
    else:
        resharded = terms["params"]
    # DDP's gradients are views of its buckets (``gradient_as_bucket_view``), which live from its construction on:
    # setting gradients to None frees no bucket, so they are there during forward too
    # and a pipeline stage past its first backward (1F1B) keeps microbatches in flight beside its gradients
    steady = layout.pp > 1 and layout.schedule != "gpipe" and layout.microbatches > 1
    carried = terms["grads"] if layout.accumulation > 1 or layout.wrapper == "ddp" or steady else 0.0
    return {"after_forward": terms["params"] + carried + terms["optimizer"],
            "after_backward": resharded + terms["grads"] + terms["optimizer"]}


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes of one rank at the two moments that matter."""

    held: float
    """Kept for backward when forward ends: saved tensors, checkpointed units' inputs and, under selective
    checkpointing, the outputs of their matrix products and attention."""
    peak: float
    """At their largest: as backward starts (what is held and the gradient of the output) or in the last
    block's backward (what is held but the head's activations, the block's recomputed activations and the
    gradient of its widest activation), whichever is more; under cp also a layer's attention backward (the
    whole sequence's keys and values, their gradient and the parts' gradients); under ep also, in a mixture of
    experts' backward, the buffer its all-to-all receives."""
    in_first_block: float = 0.0
    """When backward reaches the first block, last of all: what the units before the blocks keep, that block's
    kept and recomputed activations and the gradient of its widest. Small beside ``peak``, but every other
    block's gradients exist by then: under checkpointing this moment can be the step's peak."""
    first_block: str | None = None
    """That block (None: the rank has no blocks)."""
    at_start: float = 0.0
    """As backward starts: what is held and the gradient of the output (the loss's backward)."""
    at_head: float = 0.0
    """Once the loss's backward is done, as the head's starts: what is held, less what the loss saved and has
    freed, and the gradient of the output (``ModelStats.loss_left_bytes``; ZeRO-3 gathers the parameters outside
    the blocks for it, ``RootUnit``)."""
    in_backward: float = 0.0
    """At their largest after that, while backward runs through the blocks: the moments ZeRO-2/3's gathered unit
    and its unreduced gradients come on top of (``BlockBuffers``); the loss's backward runs on the root's
    parameters, which stay gathered, and no block's are."""
    block_kept: float = 0.0
    """What the last block keeps, which its backward frees: an earlier block's backward runs with
    ``in_backward`` less it (beside more of ZeRO-2/3's buffers, ``BlockBuffers``)."""


def activations(stats: ModelStats, units: list[str] | None, layout: Layout, scale: float,
                weight_copies: bool = True, length_factor: float = 1.0) -> ActivationBytes:
    """Activation bytes of the first pipeline rank (it keeps the most microbatches in flight) under the
    layout's checkpointing policy, tensor- and context-parallel split; ``scale``: bytes per measured byte
    (micro-batch over the pass's, and the activation dtype); ``weight_copies``: whether autocast's bf16 copies
    of the weights, which a pass under autocast saved, are made (not where FSDP2 gathers bf16 parameters).
    Those copies are one set per rank whatever its tokens (not scaled, not split by cp, by tp as the weights),
    kept where a unit keeps what it saved and freed with the head's once backward is past it; a checkpointed
    unit makes them again in its own backward, as short-lived as its recomputed activations but not counted.
    ``length_factor``: the sequence length over the pass's (``scale`` includes it), which the mask of packed
    documents, tokens x tokens, grows with once more.

    Backward starts with what the loss's backward adds to everything held (``ModelStats.loss_grad_bytes``: its
    gradients less what it frees): in fp32 the log-probabilities' gradient beside the logits'; under autocast,
    per logit, 8 bytes of fp32 gradients on a CPU and 4 on a GPU (``disttrain.plan.autocast``). The logits'
    gradient alone, as plans took it before, fell well short of the measured fp32 peak at GPT-2's vocabulary
    (benchmarks/README.md, Figures cited elsewhere).

    Mixtures of experts are not split by tp (every tp rank runs them on the same tokens). A block with layers
    that gather their activations whole (``colwise_gather``, ``rowwise_whole_input``) splits only what the pass
    saw split (``ModelStats.tp_split_bytes``): between such layers every tp rank holds all of it. Under expert
    parallelism a rank keeps, of a mixture, the rows its all-to-all received (the grouped products save them)
    and the combined rows that came back (the weighting saves them) instead of its own rows, as many under
    balanced routing: what the pass saved. The exchange's receive buffer while a mixture's backward runs comes
    on top of it."""
    last_stage = units is None or stats.pipeline_units[-1] in units
    blocks = set(stats.shard_units)
    policies = policy_of_units(stats.shard_units, layout.activation_checkpoint, layout.checkpoint_every_n_blocks)
    split = 1.0
    if layout.tp > 1:  # Megatron: 24 of 34 sbh bytes are split by tp; all of them with sequence parallelism
        split = 1 / layout.tp if layout.sequence_parallel else (10 + 24 / layout.tp) / 34

    def tp_share(unit: str, total: float, part: str) -> float:  # a unit's mixtures of experts stay whole
        if layout.tp > 1 and not layout.sequence_parallel and unit in stats.tp_gathering_units:
            measured = stats.tp_split_bytes.get(unit, {}).get(part, 0)
            return total - measured + measured / layout.tp
        whole = stats.mixture_bytes.get(unit, {}).get(part, 0)
        return (total - whole) * split + whole

    held = outside = recompute = gradient = 0.0
    copies_held = copies_outside = 0.0  # in bytes of the run, not of the pass
    first_block = next((u for u in stats.units if u in blocks and unit_on_rank(stats, u, units)), None)
    last_block_here = next((u for u in reversed(stats.units) if u in blocks and unit_on_rank(stats, u, units)), None)
    last_kept = 0.0  # what that block keeps
    first_block_bytes = 0.0  # its kept, recomputed and widest gradient's bytes
    # what runs after the last block (the head, the loss) is freed before backward reaches the blocks; what
    # runs before them (a CNN's stem) stays until the end
    order = stats.pipeline_units
    last_block = max((i for i, u in enumerate(order) if u in blocks), default=len(order) - 1)
    after_blocks = {ROOT, *order[last_block + 1:]}
    # each saved storage was charged to the innermost running unit once: keep the entries of this rank's units
    for unit, saved in stats.saved_bytes.items():
        if not unit_on_rank(stats, unit, units):
            continue
        measured_copies = stats.weight_copy_bytes.get(unit, 0)
        saved -= measured_copies  # what stays is proportional to the tokens
        copies = measured_copies if weight_copies else 0
        if unit not in blocks:
            held += saved
            outside += saved if unit in after_blocks else 0
            copies_held += copies
            copies_outside += copies if unit in after_blocks else 0
            continue
        policy, unit_input = policies[unit], stats.unit_input_bytes.get(unit, 0)
        if policy == "full":  # the input stays; backward recomputes everything the unit saved
            kept, again = unit_input, tp_share(unit, saved, "saved")
        elif policy == "selective":  # the input and every matmul and attention output stay; the rest is redone
            kept = unit_input + tp_share(unit, stats.selective_bytes.get(unit, 0), "selective")
            # weight copies are made by casts, "other" operators: selective checkpointing does not keep them
            again = tp_share(unit, stats.saved_by_kind.get(unit, {}).get("other", 0) - measured_copies, "other")
        else:
            kept, again = tp_share(unit, saved, "saved"), 0.0
            copies_held += copies / layout.tp
        if unit == first_block and policy != "none":  # a recomputation reuses the documents' mask (below)
            again = max(again - stats.document_mask_bytes, 0.0)
        held += kept
        last_kept = kept if unit == last_block_here else last_kept
        recompute = max(recompute, again)
        gradient = max(gradient, stats.largest_saved.get(unit, 0) * split)
        if unit == first_block:
            first_block_bytes = kept + again + stats.largest_saved.get(unit, 0) * split
    if stats.document_mask_bytes and first_block is not None:
        # packed documents' mask: one per forward, which the pass saw the first block save; the model keeps it
        # whatever that block's policy, and under cp no whole mask exists (each chunk's is made where it attends)
        counted = policies[first_block] == "none"
        whole = 0 if layout.cp > 1 else stats.document_mask_bytes * length_factor
        held += whole - (stats.document_mask_bytes if counted else 0)
    # stats measured without the loss's backward (built by hand) fall back to the logits' gradient alone
    output_grad = (stats.loss_grad_bytes or stats.output_bytes) if last_stage else 0
    # what expert parallelism's all-to-all receives in backward, beside the gradient it sends
    exchange = max((max(c.in_bytes, c.out_bytes) for c in stats.expert_calls if unit_on_rank(stats, c.unit, units)),
                   default=0) if layout.ep > 1 else 0
    in_flight = 1
    if layout.pp > 1:  # the first stage holds this many microbatches' activations (GPipe: all of them)
        in_flight = layout.microbatches if layout.schedule == "gpipe" else min(layout.microbatches, layout.pp)
        scale = scale / layout.microbatches
    share = scale * in_flight / layout.cp  # each cp rank holds 1/cp of every sequence's tokens
    # under cp a third moment, a layer's attention backward: its feed-forward half is through backward, and
    # the whole sequence's keys and values are alive with their gradient and the parts' gradients being added
    in_attention = (held - outside + recompute / 2) * share + 3 * kv_transient(stats, units, layout) * scale
    # two moments: backward's start (everything held and the output's gradient), and the last block's backward,
    # when the head's activations and the output's gradient are gone, the block's recomputed activations are
    # back and the gradient of its widest activation lives beside them
    start = (held + output_grad) * share + copies_held
    in_blocks = (held - outside + recompute + gradient + exchange) * share + copies_held - copies_outside
    before_blocks = sum(saved for unit, saved in stats.saved_bytes.items()
                        if unit not in blocks and unit not in after_blocks and unit_on_rank(stats, unit, units))
    in_first_block = (before_blocks + first_block_bytes + exchange) * share + copies_held - copies_outside
    later = max(in_blocks, in_attention + copies_held - copies_outside)
    # the loss's backward has freed what it saved (its log-probabilities) by then: the pass measured what it left
    left = stats.output_bytes if stats.loss_left_bytes is None else stats.loss_left_bytes
    at_head = (held + (left if last_stage else 0)) * share + copies_held
    return ActivationBytes(held * share + copies_held, max(start, later), in_first_block, first_block, start, at_head,
                           later, last_kept * share)


def kv_transient(stats: ModelStats, units: list[str] | None, layout: Layout) -> float:
    """Context parallelism's short-lived buffers, in measured bytes: one layer's keys and values gathered for
    the whole sequence; none without cp (tensor parallelism splits the heads). Their gradients (the same size)
    come later in that layer's backward, once its feed-forward activations (larger, for a 4x or SwiGLU hidden)
    are freed: measured on gloo ranks, the peak per rank was the held bytes plus about one gathered set."""
    if layout.cp == 1:
        return 0.0
    calls = [kv for unit, sizes in stats.attention_kv_bytes.items() if unit_on_rank(stats, unit, units) for kv in sizes]
    return max(calls, default=0) / layout.tp


def activations_by_length(stats: ModelStats, units: list[str] | None, layout: Layout, scale: float,
                          weight_copies: bool = True) -> dict[int, dict[int, float | None]]:
    """Peak activation bytes per rank of ``layout`` at other sequence lengths (``LENGTH_FACTORS`` of the
    pass's) and cp degrees (``CP_DEGREES``); None where cp does not divide the sequence into 2 cp chunks.
    Every term is linear in the tokens (fused attention saves no tokens x tokens matrix) but the mask of packed
    documents, so the pass at one length gives all of them (autocast's weight copies do not depend on it:
    ``activations``). Empty for a model without sequences."""
    tokens = stats.tokens_per_sample
    if tokens < 2:
        return {}
    table = {}
    for factor in LENGTH_FACTORS:
        length = int(tokens * factor)
        if length < 1:
            continue
        table[length] = {cp: activations(stats, units, replace(layout, cp=cp), scale * length / tokens,
                                         weight_copies, length / tokens).peak
                         if cp == 1 or length % (2 * cp) == 0 else None for cp in CP_DEGREES}
    return table


def dequantised_weight(stats: ModelStats, units: list[str] | None) -> float:
    """Bytes of the largest weight a layer held quantised on the rank holding ``units`` (QLoRA's nf4 base)
    dequantises for one matrix product (``ModelStats.dequantised_bytes``): one at a time, whatever the tokens."""
    return max((size for unit, size in stats.dequantised_bytes.items() if unit_on_rank(stats, unit, units)),
               default=0)


@dataclass(frozen=True)
class BlockBuffers:
    """ZeRO-2/3's short-lived buffers while backward runs through the blocks (of a unit's experts, the rank's 1/ep),
    each unit's with its own sizes, as its backward starts (``start``: its activations are all there) and once its
    gradients are whole (``with_grads``: its activations are gone). Under ZeRO-3 the unit's gathered parameters and
    an all-gather's output beside them: its own as it copies them out, then, once FSDP2 has freed that, the one
    backward comes to next (the unit before it), prefetched; under ZeRO-2/3 its whole gradients before their
    reduce-scatter and, in a block before the last, the later block's reduce-scatter input, which FSDP2 frees only
    as the next reduce-scatter starts (not in a pipeline stage, which reduces once when the step ends). Blocks of
    unequal sizes (a CNN's stages) differ: the prefetched output beside the last block's gradients is the previous
    block's, not another of the last one's."""

    last_start: float = 0.0
    """The last block's backward as it starts."""
    last_with_grads: float = 0.0
    """The last block's, its gradients whole."""
    earlier_start: float = 0.0
    """An earlier block's as it starts (the most of any)."""
    earlier_with_grads: float = 0.0
    """An earlier block's, its gradients whole (the most of any)."""
    first_start: float = 0.0
    """The first block's as it starts, when backward reaches it last of all (the last block's where it is the only
    one)."""

    @property
    def most(self) -> float:
        """The most of them at once."""
        return max(self.last_start, self.last_with_grads, self.earlier_start, self.earlier_with_grads)


def block_buffers(stats: ModelStats, layout: Layout, state: StateBytes, float8_gathered: frozenset[str] = frozenset()
                  ) -> BlockBuffers:
    """The ``BlockBuffers`` of ``layout`` (none without ZeRO-2/3). ``float8_gathered``: the parameters FSDP2 gathers
    in float8 (one byte per value, ``disttrain.plan.float8_cost``)."""
    if not layout.shards_gradients:
        return BlockBuffers()
    units = stats.shard_units or [ROOT]

    def unit_bytes(unit: str) -> tuple[float, float]:  # (gathered bytes, gradient bytes)
        names = [(name, _gathered(stats, layout, name, n)) for name, n in stats.param_numel.items()
                 if within(stats.param_unit[name], unit)]
        return (sum(n * (1 if name in float8_gathered else state.param) for name, n in names),
                sum(n for _, n in names) * state.grad)

    sizes = [unit_bytes(u) for u in units]  # in forward order: backward runs them from the last
    gathers = layout.reshards_after_forward

    def waiting(i: int) -> float:  # the later unit's reduce-scatter input
        return sizes[i + 1][1] if i + 1 < len(sizes) and not layout.stage_keeps_whole else 0.0

    def start(i: int) -> float:  # its parameters beside its own all-gather output
        return (2 * sizes[i][0] if gathers else 0.0) + waiting(i)

    def with_grads(i: int) -> float:  # its parameters beside the previous unit's output (the first prefetches none)
        prefetched = sizes[i - 1][0] if i > 0 else 0.0
        return (sizes[i][0] + prefetched if gathers else 0.0) + sizes[i][1] + waiting(i)

    last = len(sizes) - 1
    earlier = range(last)
    return BlockBuffers(start(last), with_grads(last), max(map(start, earlier), default=0.0),
                        max(map(with_grads, earlier), default=0.0), start(0))


@dataclass(frozen=True)
class RootUnit:
    """Under ZeRO-3 without a pipeline, the FSDP2 unit of the parameters outside the blocks (the embedding, the
    head), which backward gathers again once the output's gradient exists and reshards only after the
    embedding's backward, the last: whole through every block's backward. With a large vocabulary it outweighs
    every block."""

    gathered: float = 0.0
    """Bytes of its parameters gathered (0: another layout)."""
    head_grad: float = 0.0
    """Bytes of the whole gradient of its largest parameter (the head's, which its backward makes first), kept
    until the unit's reduce-scatter at the end of backward."""

    @property
    def at_head(self) -> float:
        """As the head's backward runs: first the all-gather's output beside the parameters (FSDP2 gathers a unit
        into one flat buffer and copies each parameter out of it), then the parameters and the head's gradient."""
        return self.gathered + max(self.gathered, self.head_grad)

    @property
    def in_blocks(self) -> float:
        """While backward runs through the blocks: the gathered parameters and the head's gradient."""
        return self.gathered + self.head_grad


def root_unit(stats: ModelStats, layout: Layout, state: StateBytes) -> RootUnit:
    """The ``RootUnit`` of ``layout`` (empty under layouts that do not reshard it after forward)."""
    if not layout.reshards_after_forward or layout.pp > 1 or not stats.shard_units:
        return RootUnit()
    outside = [_gathered(stats, layout, name, n) for name, n in stats.param_numel.items()
               if not any(within(stats.param_unit[name], unit) for unit in stats.shard_units)]
    return RootUnit(sum(outside) * state.param, max(outside, default=0.0) * state.grad)


def _gathered(stats: ModelStats, layout: Layout, name: str, n: int) -> float:
    """Elements of parameter ``name`` (``n`` whole) a rank gathers: its tp share, its own experts only, with the
    rows FSDP2 pads to a multiple of the shard ranks (a small matrix gathered over many ranks is mostly padding;
    where tp splits the rows, its share of them is padded)."""
    n = n / (layout.tp if stats.tp_sharded.get(name) else 1) / (layout.ep if name in stats.expert_params else 1)
    rows = stats.param_rows.get(name, 0) / (layout.tp if name in stats.tp_rows_split else 1)
    shards = layout.expert_state_shards if name in stats.expert_params else layout.state_shards
    return n * math.ceil(rows / shards) * shards / rows if rows else n
