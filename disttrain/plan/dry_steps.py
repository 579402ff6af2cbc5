"""The steps of ``mode=dryrun``: forward, backward and the optimiser step of one rank's micro-batches, with the
bytes alive at the moments the plan names (``disttrain.observe.tensor_bytes.LiveStorages``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from disttrain.loss import token_cross_entropy
from disttrain.models.nf4 import block_statistics, nf4_layers
from disttrain.models.protocol import logits_of
from disttrain.observe.tensor_bytes import LiveStorages, plain_tensors
from disttrain.parallel.apply import backward_sync_disabled
from disttrain.parallel.pipeline.runtime import PipelineSlot
from disttrain.plan.dry_device import synchronize
from disttrain.plan.layout import Layout

PIPELINE_SCHEDULES = ("gpipe", "1f1b")
"""Schedules a dry run replays on one stage: torch's schedules cannot run under the fake process group (their
set-up votes on and exchanges the stages' tensor metadata, which a fake receive never fills), so the dry run runs
the stage's forward and backward on its microbatches itself, in the order these single-stage schedules give."""


COUNTED_STEPS = 2
"""Steps run under the byte counter: the first allocates the optimiser's state, the second runs with all of it. The
counter's work at every operator slows them; the steps after them are the timed ones."""


@dataclass
class StepMemory:
    """What a dry run's steps measured."""

    peak: int = 0
    """The most bytes alive at once (model state counted from the start, and everything the steps made)."""
    moments: dict[str, int] = field(default_factory=dict)
    """Bytes alive after the last counted step's forward, backward and optimiser step."""
    step_s: list[float] = field(default_factory=list)
    """Wall time of each step after the counted ones (of the counted ones where no other step ran)."""
    counted_only: bool = False
    """No step ran outside the byte counter: ``step_s`` are the counted steps, slowed by the counter."""
    allocator_peaks: dict[str, int] = field(default_factory=dict)
    """On a GPU, the CUDA allocator's peaks over the layout and the steps (``dry_device.allocator_peaks``)."""


def count_model_state(live: LiveStorages, net: nn.Module) -> None:
    """Count the storages of ``net``'s parameters and buffers (a DTensor's local shard, and the tensors a wrapper
    such as torchao's float8-casting weight holds: under FSDP2 the wrapper's own storage is not the shard's memory)
    and the blocks' statistics of its nf4 layers (QLoRA's base: beside their codes, in no parameter or buffer; the
    absmax, and double-quantised their nested state) from now on."""
    for tensor in [*net.parameters(), *net.buffers()]:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        for plain in plain_tensors(local):
            live.count(plain.untyped_storage())
    for _, layer in nf4_layers(net):
        for tensor in block_statistics(layer.quant_state):
            live.count(tensor.untyped_storage())


def run_steps(net: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
              layout: Layout, steps: int, autocast: bool, pipeline: PipelineSlot | None = None,
              pp_rank: int = 0, recorder: AbstractContextManager | None = None,
              after_timed_step: Callable[[], None] | None = None) -> StepMemory:
    """``steps`` optimiser steps of ``layout.accumulation`` micro-batches of ``batch`` on ``net`` (a pipeline
    stage's microbatches with ``pipeline``, the ``disttrain.parallel.pipeline.runtime.PipelineSlot`` the stages were
    built into), the first ``COUNTED_STEPS`` under the byte counter; ``autocast``: bf16 autocast of forward and the
    loss, as a bf16-mixed run has it. Gradients are freed by the optimiser's zeroing. ``recorder``: a mode the last
    counted step runs under (``rank_matmuls.MatmulRecorder``: an untimed step); ``after_timed_step``: called after
    each timed step (a calibration interleaved with the steps meets the same load they do)."""
    result = StepMemory()
    counted = min(steps, COUNTED_STEPS)
    with LiveStorages(follow_resizes=True) as live:
        count_model_state(live, net)
        counted_s = []
        for index in range(counted):
            with recorder if recorder is not None and index == counted - 1 else nullcontext():
                counted_s.append(_step(net, optimizer, batch, layout, autocast, pipeline, pp_rank, live, result))
        result.peak = live.peak
    for _ in range(steps - counted):
        result.step_s.append(_step(net, optimizer, batch, layout, autocast, pipeline, pp_rank, None, result))
        if after_timed_step is not None:
            after_timed_step()
    if not result.step_s:
        result.step_s, result.counted_only = counted_s, True
    return result


def _step(net: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
          layout: Layout, autocast: bool, pipeline: PipelineSlot | None, pp_rank: int, live: LiveStorages | None,
          result: StepMemory) -> float:
    """One optimiser step; its seconds. With ``live``, the bytes at its moments go into ``result``."""
    start = time.perf_counter()
    for micro in range(layout.accumulation):
        last = micro == layout.accumulation - 1
        if pipeline is not None:
            _stage_micro_batch(pipeline, batch, layout, pp_rank, autocast, last, live, result)
            continue
        # accumulation micro-batches exchange nothing until the last (where a run accumulates sharded, ZeRO-2/3
        # reduce-scatter each one)
        with nullcontext() if last else backward_sync_disabled(net, layout.sharded_accumulation):
            with torch.autocast(batch[0].device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = token_cross_entropy(logits_of(net(batch[0])), batch[1]) / layout.accumulation
            _note(live, result, "after_forward")
            loss.backward()
            del loss
    _note(live, result, "after_backward")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _note(live, result, "after_step")
    synchronize(batch[0].device)
    return time.perf_counter() - start


def _note(live: LiveStorages | None, result: StepMemory, moment: str) -> None:
    if live is not None:
        result.moments[moment] = live.live


def _stage_micro_batch(pipeline: PipelineSlot, batch: tuple[torch.Tensor, torch.Tensor], layout: Layout, pp_rank: int,
                       autocast: bool, last_micro: bool, live: LiveStorages | None, result: StepMemory) -> None:
    """One micro-batch through this rank's stage: its microbatches' forwards and backwards in the order of a
    single-stage schedule (GPipe: every forward, then every backward; 1F1B: ``pp - pp_rank`` forwards in flight,
    then one backward per forward), each backward through the stage's own hand-over to FSDP2 and DDP, and the
    gradients reduced at the end as the schedule reduces them."""
    stage = pipeline.pipeline.stages[0]
    m = layout.microbatches
    inputs, targets = (part.chunk(m) for part in batch)
    in_flight = m if layout.schedule == "gpipe" else min(m, layout.pp - pp_rank)
    pending: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    def forward(i: int) -> None:
        if stage.is_first:
            args = [inputs[i]]
        else:  # what the previous stage would have sent: its shape, no values
            example = pipeline.pipeline.stage_inputs[0]
            args = [torch.zeros(example.shape, dtype=example.dtype, device=inputs[i].device,
                                requires_grad=example.is_floating_point())]
        with torch.autocast(inputs[i].device.type, dtype=torch.bfloat16, enabled=autocast):
            out = stage.forward_maybe_with_nosync(*args)
            if stage.is_last:
                out = pipeline.loss_fn(out, targets[i])
        pending.append((out, args))

    def backward(last: bool) -> None:
        out, args = pending.pop(0)
        grad = None if stage.is_last else torch.ones_like(out)  # what the next stage would have sent back
        stage.backward_maybe_with_nosync("full", {"stage_output": out, "output_grads": grad, "input_values": args},
                                         last_backward=last)

    for i in range(in_flight):
        forward(i)
    _note(live, result, "after_forward")
    for i in range(in_flight, m):
        backward(False)
        forward(i)
    while pending:
        backward(last_micro and len(pending) == 1)
    # as torch's schedules end every step: FSDP2 kept its unit whole and accumulated whole gradients through the
    # stage's backwards (not syncing), and only now reshards and reduce-scatters them (the loss is scaled already)
    stage.perform_reduce_grad(1)
