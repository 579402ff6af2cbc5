"""What the steps of the shard-aware optimisers (LAMB, LARS) begin with: the closure's loss and each
parameter's local gradient, laid out like the local shard of the parameter it belongs to."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from disttrain.optim.norms import local_grad


def closure_and_grads(
    optimizer: torch.optim.Optimizer, closure: Callable[[], float] | None
) -> tuple[float | None, Iterator[tuple[dict[str, Any], Tensor, Tensor]]]:
    """The loss of ``closure`` (None without one), evaluated with autograd on, and ``(group, param, local
    grad)`` for every parameter of ``optimizer`` that has a gradient, group by group.

    The gradients are yielded one at a time, so an update made per parameter while iterating happens in the
    same order as the gradients are read. A sparse gradient raises RuntimeError: the updates are written for
    dense local tensors.
    """
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    return loss, _local_grads(optimizer)


def _local_grads(optimizer: torch.optim.Optimizer) -> Iterator[tuple[dict[str, Any], Tensor, Tensor]]:
    """``(group, param, local grad)`` of each parameter with a gradient; RuntimeError on a sparse one."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            g = local_grad(p)
            if g.is_sparse:
                raise RuntimeError(f"{type(optimizer).__name__} does not support sparse gradients")
            yield group, p, g
