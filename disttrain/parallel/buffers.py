"""Module buffers (BatchNorm running statistics) kept equal on all data-parallel ranks.

DDP broadcasts buffers from its first rank at every training forward; FSDP2 and pipeline stages do not,
so each rank's running statistics drift apart with its own micro-batches, validation on each rank uses
different statistics, and a checkpoint holds whichever copy its writer kept. The strategy calls
``broadcast_buffers`` before every evaluation and checkpoint, so all ranks evaluate and save the first rank's
buffers, as under DDP.

Before each training batch they are copied only where a training forward can read them
(``step_broadcast_needed``): a normalisation layer in training mode normalises by the batch's statistics and
only writes its running ones, so the first rank's buffers evolve from its own batches alone whether or not
they are broadcast, and evaluation and checkpoints see the same numbers either way. The per-step broadcast
DDP makes by default is a synchronisation point before forward, which small steps on shared cores feel
(benchmarks/README.md, Figures cited elsewhere).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.modules.batchnorm import _NormBase


def broadcast_buffers(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Copy the buffers of ``group``'s first rank to every rank of ``group``: one broadcast per dtype."""
    if group is None or dist.get_world_size(group) == 1:
        return
    by_dtype: dict = {}
    for buffer in module.buffers():
        by_dtype.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    src = dist.get_global_rank(group, 0)
    for buffers in by_dtype.values():
        flat = _flatten_dense_tensors(buffers)
        dist.broadcast(flat, src=src, group=group)
        for buffer, synced in zip(buffers, _unflatten_dense_tensors(flat, buffers), strict=True):
            buffer.copy_(synced)


def step_broadcast_needed(module: nn.Module, setting: bool | None = None) -> bool:
    """Whether buffers must be made equal before every training forward: ``setting`` when given, else whether
    ``module`` holds a buffer that is not a normalisation layer's running statistics (such a buffer may be read
    by a training forward, so ranks keep DDP's per-step copy of it)."""
    if setting is not None:
        return setting
    statistics = {id(b) for m in module.modules() if isinstance(m, _NormBase) for b in m.buffers(recurse=False)}
    return any(id(b) not in statistics for b in module.buffers())
