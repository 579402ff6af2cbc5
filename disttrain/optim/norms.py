"""Norms of whole parameters from their local shards, with one all-reduce per step and process group."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import Tensor


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor, without importing ``torch.distributed.tensor`` (a slow import) where nothing has: a
    process that never imported it holds none (a federated client, whose every round is a new process)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: Tensor) -> Tensor:
    """The tensor this rank holds: the local shard of a DTensor (same storage), else ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def local_grad(p: Tensor) -> Tensor:
    """The local gradient of ``p``, laid out like ``p``'s local shard."""
    grad = p.grad
    if is_dtensor(grad):
        if is_dtensor(p) and tuple(grad.placements) != tuple(p.placements):
            grad = grad.redistribute(p.device_mesh, p.placements)
        return grad.to_local()
    return grad


def shard_groups(owner: Tensor) -> list[dist.ProcessGroup]:
    """Process groups of the mesh dimensions on which ``owner`` is sharded (none for a plain tensor)."""
    if not is_dtensor(owner):
        return []
    mesh = owner.device_mesh
    groups = []
    for dim, placement in enumerate(owner.placements):
        if placement.is_partial():
            raise ValueError("a parameter with a Partial placement has no well-defined local norm")
        # not ``is_shard()``: FSDP over a tensor-parallel shard places ``_StridedShard``, for which it is False
        if not placement.is_replicate():
            groups.append(mesh.get_group(dim))
    return groups


def whole_norms(tensors: list[Tensor], owners: list[Tensor], shard_local: bool = False) -> Tensor:
    """L2 norms of the whole tensors whose local shards are ``tensors``; ``owners[i]`` gives the layout.

    ``tensors[i]`` is this rank's piece of a logical tensor laid out like ``owners[i]`` (a parameter:
    a DTensor, or a plain tensor that every rank holds whole). The local sums of squares of all of them
    are stacked into one vector and summed over each mesh dimension that shards any of them with a
    single all-reduce per process group, so a step costs one all-reduce on a 1-D FSDP mesh however many
    parameters there are. Replicated mesh dimensions and plain tensors need no communication.
    ``shard_local`` skips the reduction and so returns norms of the local shards only: a deliberate
    mistake that exists for the parity tests.
    """
    if not tensors:
        return torch.zeros(0)
    acc = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    # one fused kernel launch per dtype instead of one norm per tensor (this runs every step); a cast only where a
    # dtype differs: a no-op .to() is a microsecond of dispatch per tensor and step
    sq = torch.stack([n if n.dtype == acc else n.to(acc) for n in torch._foreach_norm(tensors)]).square()
    if not shard_local:
        members: dict[dist.ProcessGroup, list[int]] = {}
        for i, owner in enumerate(owners):
            for group in shard_groups(owner):
                members.setdefault(group, []).append(i)
        for group, idx in members.items():
            if len(idx) == len(tensors):
                dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
            else:
                index = torch.tensor(idx, device=sq.device)
                part = sq.index_select(0, index)
                dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
                sq.index_copy_(0, index, part)
    return sq.sqrt()


def pair_norms(items: list[tuple], shard_local: bool = False) -> tuple[Tensor, Tensor]:
    """Whole norms of ``(w, x)`` for items ``(group, param, w, x)``: a weight and its update or gradient.

    All pairs go through one ``whole_norms`` call, so a step costs one all-reduce per process group.
    """
    norms = whole_norms([t for _, _, w, x in items for t in (w, x)], [p for _, p, _, _ in items for _ in (0, 1)],
                        shard_local=shard_local)
    return norms[0::2], norms[1::2]
