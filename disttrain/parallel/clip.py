"""Gradient clipping by the global norm when parameters are a mix of DTensor shards and plain tensors.

``torch.nn.utils.clip_grad_norm_`` refuses a mix (tensor parallelism shards some layers and replicates
the rest); here every parameter's norm is taken on its whole tensor from the local shard, with the same
single batched all-reduce per process group as the layer-wise optimisers use.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from disttrain.optim.norms import local_grad, whole_norms


def grad_norm(parameters: Iterable[Tensor], across: dist.ProcessGroup | None = None) -> Tensor:
    """The global L2 norm of the gradients of ``parameters`` (whole tensors, also when sharded).

    ``across``: a group whose ranks hold different parameters (pipeline stages); their squared norms add up.
    """
    params = [p for p in parameters if p.grad is not None]
    squared = whole_norms([local_grad(p) for p in params], params).square().sum() if params else torch.zeros(())
    if across is not None:
        dist.all_reduce(squared, group=across)
    return squared.sqrt()


def clip_grad_norm(
    parameters: Iterable[Tensor], max_norm: float, across: dist.ProcessGroup | None = None
) -> Tensor:
    """Scale all gradients so that their global L2 norm is at most ``max_norm``; return the norm before.

    ``across``: a group whose ranks hold different parameters (pipeline stages); their squared norms add up.
    """
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, across)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    if grads:  # a rank may hold none of the parameters (a parameter server's worker)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total
