"""LARS (You et al., 2017, "Large Batch Training of Convolutional Networks", Algorithm 1), shard-aware."""

# Written here: the maintained LARS implementations need torchvision or CUDA (apex) and take shard norms.

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from disttrain import checks
from disttrain.errors import ConfigError
from disttrain.optim.groups import param_groups
from disttrain.optim.norms import local, pair_norms
from disttrain.optim.registry import OPTIMIZERS
from disttrain.optim.stepping import closure_and_grads


class Lars(torch.optim.Optimizer):
    """SGD with momentum and a layer-wise learning rate, correct for parameters sharded as DTensors.

    Per parameter ``w`` with gradient ``g``::

        local_lr = eta * ||w|| / (||g|| + weight_decay * ||w|| + eps)     (1 if ||w|| or ||g|| is 0)
        v = momentum * v + lr * local_lr * (g + weight_decay * w)
        w = w - v

    Parameters of a group with ``adapt=False`` (biases and norm weights by default, see ``param_groups``,
    which also gives them no weight decay) take the same step with ``local_lr = 1``: plain SGD with
    momentum. As in the paper the learning rate sits inside the momentum buffer.

    ``||w||`` and ``||g||`` are the norms of the whole parameter and gradient even when the parameter is a
    DTensor sharded by FSDP2 or tensor parallelism: one all-reduce per step and process group of stacked
    local sums of squares (see ``pair_norms``); ``full_tensor`` is never called. ``shard_local_norms=True``
    skips that reduction, i.e. takes norms of the local shards only. It is wrong on purpose and exists
    only so the parity tests can show that they catch this mistake.

    State per parameter (``step``, ``momentum_buffer``) and the param groups are the standard ones, so
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` handles them.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.1,
        momentum: float = 0.9,
        eta: float = 0.001,
        weight_decay: float = 5e-4,
        eps: float = 1e-9,
        *,
        shard_local_norms: bool = False,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"invalid learning rate {lr}")
        defaults = dict(lr=lr, momentum=momentum, eta=eta, weight_decay=weight_decay, eps=eps, adapt=True)
        super().__init__(params, defaults)
        self.shard_local_norms = shard_local_norms

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One LARS step over all parameters that have a gradient."""
        loss, grads = closure_and_grads(self, closure)
        # group, param, local w, local g
        todo: list[tuple[dict[str, Any], Tensor, Tensor, Tensor]] = [(group, p, local(p), g) for group, p, g in grads]
        adapted = [item for item in todo if item[0]["adapt"]]
        w_norms, g_norms = pair_norms(adapted, shard_local=self.shard_local_norms)
        local_lrs = iter(_local_lrs(w_norms, g_norms, adapted))
        for group, p, w, g in todo:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            d = g.add(w, alpha=group["weight_decay"]) if group["weight_decay"] != 0 else g.clone()
            d.mul_(group["lr"])
            if group["adapt"]:
                d.mul_(next(local_lrs).to(d.dtype))
            buf = local(state["momentum_buffer"])
            buf.mul_(group["momentum"]).add_(d)
            w.sub_(buf)
        return loss


def _local_lrs(w_norm: Tensor, g_norm: Tensor, adapted: list[tuple[dict[str, Any], ...]]) -> Tensor:
    """``eta ||w|| / (||g|| + wd ||w|| + eps)`` per parameter, 1 where either norm is 0."""
    eta, wd, eps = (
        torch.tensor([item[0][key] for item in adapted], dtype=w_norm.dtype).to(w_norm.device)
        for key in ("eta", "weight_decay", "eps")
    )
    trust = eta * w_norm / (g_norm + wd * w_norm + eps)
    return torch.where((w_norm > 0) & (g_norm > 0), trust, torch.ones_like(trust))


@dataclass
class LarsConfig:
    """LARS: SGD with momentum and a layer-wise learning rate, for large batches."""

    name: str = "lars"
    """Registry name."""
    lr: float = 0.1
    """Peak (global) learning rate."""
    momentum: float = 0.9
    """Momentum of the update buffer, in [0, 1)."""
    eta: float = 0.001
    """Trust coefficient: the layer-wise rate is eta * ||w|| / (||g|| + weight_decay * ||w||)."""
    weight_decay: float = 5e-4
    """L2 weight decay, added to the gradient before the momentum update."""
    eps: float = 1e-9
    """Added to the denominator of the layer-wise rate."""
    exclude_bias_and_norm: bool = True
    """Biases and norm weights (ndim < 2) get no weight decay and no layer-wise rate."""

    def validate(self) -> None:
        """Reject values outside the ranges the update rule is defined for."""
        checks.positive("optim.lr", self.lr)
        checks.unit_interval("optim.momentum", self.momentum)
        checks.positive("optim.eta", self.eta)
        checks.non_negative("optim.weight_decay", self.weight_decay)
        if not self.eps >= 0:
            raise ConfigError("optim.eps", self.eps, "a number >= 0")


@OPTIMIZERS.register("lars", LarsConfig)
def build_lars(cfg: LarsConfig, model: nn.Module) -> Lars:
    """LARS over the (possibly wrapped) model's trainable parameters."""
    groups = param_groups(model, cfg.weight_decay, cfg.exclude_bias_and_norm, adapt=True)
    return Lars(groups, lr=cfg.lr, momentum=cfg.momentum, eta=cfg.eta, weight_decay=cfg.weight_decay,
                eps=cfg.eps)
