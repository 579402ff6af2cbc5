"""Whole matrices from sharded parameters and back: what a matrix optimiser (Muon) needs to compute its update on
the whole parameter under every layout.

A parameter is a plain tensor (every rank that steps it holds it whole: one process, DDP, ZeRO-1's owner, a
pipeline stage) or a DTensor sharded over some mesh dimensions (FSDP2, tensor parallelism, expert parallelism and
their hybrids). ``whole`` gathers a tensor laid out like the parameter's local shard into the whole tensor on every
rank of the shard groups; ``shard_of`` takes this rank's piece of a whole tensor back, with no communication.
"""

from __future__ import annotations

from torch import Tensor

from disttrain.models.heads import HeadBlocks
from disttrain.optim.norms import is_dtensor


def is_sharded(owner: Tensor) -> bool:
    """Whether ``owner`` (a parameter) is split over any mesh dimension, i.e. no rank holds it whole."""
    return is_dtensor(owner) and any(not placement.is_replicate() for placement in owner.placements)


def whole(local_tensor: Tensor, owner: Tensor) -> Tensor:
    """The whole tensor whose local shard is ``local_tensor``, laid out like ``owner``'s shard (a collective over
    the mesh dimensions that shard ``owner``; ``local_tensor`` itself for a parameter that no mesh splits).

    Uneven shards (FSDP2's padding, ``_StridedShard`` of FSDP over tensor parallelism) are gathered by DTensor's
    own rules, from the global shape and stride of ``owner``.
    """
    if not is_sharded(owner):
        return local_tensor
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local_tensor, owner.device_mesh, owner.placements, run_check=False,
                              shape=owner.shape, stride=owner.stride()).full_tensor()


def shard_of(whole_tensor: Tensor, owner: Tensor) -> Tensor:
    """This rank's piece of ``whole_tensor`` (every rank holds the same whole tensor), laid out like ``owner``'s
    local shard; no communication: a replicated tensor redistributed to a sharded layout is sliced locally."""
    if not is_sharded(owner):
        return whole_tensor
    from torch.distributed.tensor import DTensor, Replicate

    mesh = owner.device_mesh
    replicated = DTensor.from_local(whole_tensor, mesh, [Replicate()] * mesh.ndim, run_check=False,
                                    shape=owner.shape, stride=whole_tensor.stride())
    return replicated.redistribute(mesh, owner.placements).to_local()


def holds_whole_matrices(owner: Tensor) -> bool:
    """Whether this rank's shard of ``owner`` is made of whole matrices: a plain or replicated parameter, or a stack
    of matrices ``[E, rows, cols]`` (MoE experts) split only along its first dimension (expert parallelism, FSDP2's
    ``Shard(0)``), so each of its matrices can be stepped where it lies with no gather."""
    if not is_sharded(owner):
        return True
    return owner.ndim == 3 and all(placement.is_replicate() or getattr(placement, "dim", None) == 0
                                   for placement in owner.placements)


def holds_whole_heads(owner: Tensor, blocks: HeadBlocks) -> bool:
    """Whether this rank's shard of the attention projection ``owner`` is made of whole heads: every mesh dimension
    that splits it splits the heads' axis into even, contiguous pieces of whole heads (tensor parallelism's
    column-wise q/k/v and row-wise output projection; FSDP2's row shards of q/k/v where the heads divide evenly), so
    each head's block can be stepped where it lies with no gather."""
    if not is_sharded(owner):
        return True
    from torch.distributed.tensor import Shard

    pieces = 1
    for size, placement in zip(owner.device_mesh.shape, owner.placements, strict=True):
        if placement.is_replicate():
            continue
        # a strided shard (FSDP2 over tensor parallelism) interleaves pieces: not a plain run of heads
        if type(placement) is not Shard or placement.dim != blocks.axis:
            return False
        pieces *= size
    return owner.shape[blocks.axis] % (pieces * blocks.width) == 0
