"""Module buffers (BatchNorm running statistics) kept equal on all data-parallel ranks.

DDP broadcasts buffers from its first rank at every training forward; FSDP2 and pipeline stages do not,
so each rank's running statistics drift apart with its own micro-batches, validation on each rank uses
different statistics, and a checkpoint holds whichever copy its writer kept. The strategy calls
``broadcast_buffers`` where DDP would (before each training batch), and before every evaluation and
checkpoint, so all ranks evaluate and save the first rank's buffers, as under DDP.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


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
