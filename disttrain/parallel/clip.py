"""Gradient clipping by the global norm when parameters are a mix of DTensor shards and plain tensors.

``torch.nn.utils.clip_grad_norm_`` refuses a mix (tensor parallelism shards some layers and replicates
the rest); here every parameter's norm is taken on its whole tensor from the local shard, with the same
single batched all-reduce per process group as the layer-wise optimisers use.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

from disttrain.optim.norms import is_dtensor, local_grad, whole_norms


def grad_norm(parameters: Iterable[Tensor], across: dist.ProcessGroup | None = None) -> Tensor:
    """The global L2 norm of the gradients of ``parameters`` (whole tensors, also when sharded).

    ``across``: a group whose ranks hold different parameters (pipeline stages); their squared norms add up.
    """
    params = [p for p in parameters if p.grad is not None]
    squared = whole_norms([local_grad(p) for p in params], params).square().sum() if params else torch.zeros(())
    if across is not None:
        dist.all_reduce(squared, group=across)
    return squared.sqrt()


def owned_grad_norm(parameters: list[Tensor], owned: Iterable[Tensor], across: dist.ProcessGroup) -> Tensor:
    """The global L2 norm of the gradients of ``parameters`` (every rank of ``across`` lists them alike) when
    each parameter's gradient is held by one rank alone (``owned``: this rank's), bit for bit what
    ``grad_norm(parameters)`` gives in one process that holds them all.

    Each rank puts the norms of its parameters in their places of a vector of all of them; one all-reduce
    fills the vector (every place has one value and zeros: exact in any order of addition); the squares add
    up in the parameters' order. Adding up per-rank partial sums instead, as ``grad_norm(..., across)``
    does, would round differently with every split of the parameters between ranks.
    """
    held = [p for p in owned if p.grad is not None]
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in parameters) else torch.float32
    norms = torch.zeros(len(parameters), dtype=dtype, device=parameters[0].device)
    if held:
        position = {id(p): index for index, p in enumerate(parameters)}
        index = torch.tensor([position[id(p)] for p in held], device=norms.device)
        norms.index_copy_(0, index, whole_norms([local_grad(p) for p in held], held).to(dtype))
    dist.all_reduce(norms, group=across)
    return norms.square().sum().sqrt()


def clip_grad_norm(
    parameters: Iterable[Tensor], max_norm: float, across: dist.ProcessGroup | None = None
) -> Tensor:
    """Scale all gradients so that their global L2 norm is at most ``max_norm``; return the norm before.

    ``across``: a group whose ranks hold different parameters (pipeline stages); their squared norms add up.
    """
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, across)
    scale_to_norm(params, max_norm, total)
    return total


def scale_to_norm(parameters: Iterable[Tensor], max_norm: float, total: Tensor) -> None:
    """Scale the gradients of ``parameters``, whose global L2 norm is ``total``, to a norm of at most
    ``max_norm``."""
    scale_grads(parameters, torch.clamp(max_norm / (total + 1e-6), max=1.0))


def scale_grads(parameters: Iterable[Tensor], factor: Tensor) -> None:
    """Multiply the gradients of ``parameters`` (local shards of sharded ones) by the scalar tensor ``factor``."""
    grads = [p.grad.to_local() if is_dtensor(p.grad) else p.grad for p in parameters if p.grad is not None]
    if grads:  # a rank may hold none of the parameters (a parameter server's worker)
        torch._foreach_mul_(grads, factor.to(device=grads[0].device, dtype=grads[0].dtype))


@runtime_checkable
class ClipsWhatItApplies(Protocol):
    """An optimiser wrapper that clips the gradients it applies itself (a synchronous parameter server clips the
    averaged gradients, which only its servers hold), so the task leaves the local ones alone."""

    clips_averaged_gradients: bool
    """True where this wrapper clips; the task then only hands it the norm."""
    clip_value: float | None
    """The norm to clip to (set by the task each step)."""
