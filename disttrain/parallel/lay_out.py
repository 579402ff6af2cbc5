"""One rank's model laid out over its mesh, in the order every run takes: allocated (before or after sharding),
split by sequence, then cut into pipeline stages or given its tensor, expert and data parallelism. The strategy
calls it for a training rank, and ``mode=dryrun`` for the one rank it builds under a fake process group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from disttrain.parallel.apply import apply_parallelism
from disttrain.parallel.config import ParallelConfig
from disttrain.parallel.context import SequenceSplit, apply_context_parallel
from disttrain.parallel.float8 import Float8Layers, convert_to_float8
from disttrain.parallel.layout import Layout
from disttrain.parallel.pipeline.runtime import PipelineSlot, build_pipeline


def lay_out(net: nn.Module, mesh: DeviceMesh, layout: Layout, parallel: ParallelConfig, device: torch.device,
            materialize: Callable[[torch.device], None] | None = None, sequence_split: SequenceSplit | None = None,
            pipeline: PipelineSlot | None = None, float8: Float8Layers | None = None, **apply_options: Any
            ) -> nn.Module:
    """``net`` as this rank trains it: a pipelined run's own stages (the schedule goes into ``pipeline``), else
    ``apply_parallelism``'s module (``apply_options``: its precision, buffer sync, gradient codec and
    compilation). ``materialize``: allocates a model still on the meta device; FSDP2 shards it there, so each rank
    allocates only its shards, and every other layout is allocated whole first (DDP broadcasts, stages are cut
    from the whole model). ``float8``: the linear layers swapped for float8 ones first (None: none)."""
    shards_on_meta = layout.wrapper == "fsdp"
    if materialize is not None and not shards_on_meta:
        materialize(device)
    if float8 is not None:
        convert_to_float8(net, float8)
    if sequence_split is not None:
        apply_context_parallel(net, sequence_split)
    if pipeline is not None:
        net, pipeline.pipeline = build_pipeline(net, mesh, layout, parallel, device, pipeline.loss_fn,
                                                pipeline.example_input)
    else:
        net = apply_parallelism(net, mesh, layout, device, parallel, **apply_options)
    if materialize is not None and shards_on_meta:
        materialize(device)
    return net
