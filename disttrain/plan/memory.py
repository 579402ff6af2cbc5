"""Per-rank memory of a layout: model state after the ZeRO paper with FSDP2's ZeRO-2 detail, activations
from the measured pass (Megatron's tensor-parallel split, checkpoint boundaries), and short-lived buffers."""

from __future__ import annotations

from disttrain.plan.layout import Layout, StateBytes, unit_on_rank, within
from disttrain.plan.model_stats import ROOT, ModelStats


def model_state(params: float, layout: Layout, state: StateBytes) -> dict[str, float]:
    """Bytes per rank of parameters, gradients and optimiser state (each at its largest during a step) for
    ``params`` elements on this rank before data-parallel sharding (its tensor-parallel and pipeline share)."""
    shard = layout.dp_shard if layout.zero_stage else 1
    p = params * state.param
    if layout.zero_stage == 3:
        held = p / shard
    elif layout.zero_stage == 2 and state.zero2_keeps_shards:
        held = p + p / shard
    else:
        held = p
    # unsharded accumulation keeps whole gradients until the step's last micro-batch reduce-scatters them
    grads = params * state.grad / (1 if layout.whole_grads else shard)
    return {"params": held, "grads": grads, "optimizer": params * state.optim / shard}


def state_peak(params: float, layout: Layout, state: StateBytes) -> dict[str, float]:
    """Model state at the two moments it peaks: after forward (ZeRO-2 holds whole parameters; gradients exist
    only while accumulating) and after backward (ZeRO-2 has resharded; every gradient exists)."""
    terms = model_state(params, layout, state)
    shard = layout.dp_shard if layout.zero_stage else 1
    resharded = params * state.param / shard if layout.zero_stage == 2 and state.zero2_keeps_shards else terms["params"]
    carried = terms["grads"] if layout.accumulation > 1 else 0.0
    return {"after_forward": terms["params"] + carried + terms["optimizer"],
            "after_backward": resharded + terms["grads"] + terms["optimizer"]}


def activations(stats: ModelStats, units: list[str] | None, layout: Layout, scale: float) -> tuple[float, float]:
    """Activation bytes of the first pipeline rank (it keeps the most microbatches in flight), with activation
    checkpointing of the shard units and without: saved tensors plus the gradient of the output at the start
    of backward."""
    last_stage = units is None or stats.pipeline_units[-1] in units
    blocks = set(stats.shard_units)
    # each saved storage was charged to the innermost running unit once: keep the entries of this rank's units
    per_unit = {u: b for u, b in stats.saved_bytes.items() if unit_on_rank(stats, u, units)}
    split = 1.0
    if layout.tp > 1:  # Megatron: 24 of 34 sbh bytes are split by tp; all of them with sequence parallelism
        split = 1 / layout.tp if layout.sequence_parallel else (10 + 24 / layout.tp) / 34
    in_blocks = {u: b * (split if u in blocks else 1.0) for u, b in per_unit.items()}
    block_units = [u for u in in_blocks if u in blocks]
    plain = sum(in_blocks.values())
    output_grad = stats.output_bytes if last_stage else 0
    plain_peak = plain + output_grad
    if block_units:
        # checkpointed: the units' inputs stay, and the output's gradient (the loss's, alive through backward);
        # the rest of the model's activations are gone by the time backward recomputes the last unit
        kept = sum(stats.unit_input_bytes.get(u, 0) for u in block_units)
        outside = plain - sum(in_blocks[u] for u in block_units)
        checkpointed_peak = kept + output_grad + max(outside, max(in_blocks[u] for u in block_units))
    else:
        checkpointed_peak = plain_peak
    in_flight = 1
    if layout.pp > 1:  # the first stage holds this many microbatches' activations (GPipe: all of them)
        in_flight = layout.microbatches if layout.schedule == "gpipe" else min(layout.microbatches, layout.pp)
        scale = scale / layout.microbatches
    return checkpointed_peak * in_flight * scale, plain_peak * in_flight * scale


def transient(stats: ModelStats, layout: Layout, state: StateBytes) -> float:
    """Short-lived buffers: under ZeRO-3 the gathered unit and the one prefetched; under ZeRO-2/3 one unit's
    whole gradients before their reduce-scatter."""
    if layout.zero_stage < 2:
        return 0.0
    units = stats.shard_units or [ROOT]
    largest = max(sum(n / (layout.tp if stats.tp_sharded.get(name) else 1) for name, n in stats.param_numel.items()
                      if within(stats.param_unit[name], u)) for u in units)
    gathered = 2 * largest * state.param if layout.zero_stage == 3 else 0.0
    return gathered + largest * state.grad
