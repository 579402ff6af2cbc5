"""LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning", Algorithm 2), shard-aware."""

# Written here: timm's LAMB pulls in torchvision and apex's needs CUDA; neither reduces norms over shards.

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from disttrain import checks
from disttrain.errors import ConfigError
from disttrain.optim.groups import param_groups
from disttrain.optim.norms import local, pair_norms
from disttrain.optim.registry import OPTIMIZERS
from disttrain.optim.stepping import closure_and_grads


class Lamb(torch.optim.Optimizer):
    """Adam moments with a layer-wise trust ratio, correct for parameters sharded as DTensors.

    Per parameter ``w`` with gradient ``g`` at step ``t``::

        m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
        r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)     (no division when bias_correction=False)
        u = r + weight_decay * w
        w = w - lr * ratio * u,   ratio = ||w|| / ||u||   (1 if either norm is 0)

    ``phi`` of the paper is the identity, as in its experiments and in the apex and timm defaults;
    ``max_trust_ratio`` optionally caps the ratio. Parameters of a group with ``adapt=False`` (biases
    and norm weights by default, see ``param_groups``) take the plain Adam step ``w -= lr * u``.

    The norms are those of the whole parameter and of its whole update even when the parameter is a
    DTensor sharded by FSDP2 or tensor parallelism: local sums of squares of every parameter are reduced
    together, one all-reduce per step and process group (see ``pair_norms``); ``full_tensor`` is never
    called. ``shard_local_norms=True`` skips that reduction, i.e. takes norms of the local shards only.
    It is wrong on purpose and exists only so the parity tests can show that they catch this mistake.

    State per parameter (``step``, ``exp_avg``, ``exp_avg_sq``) and the param groups are the standard
    ones, so ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` handles them.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        max_trust_ratio: float | None = None,
        *,
        shard_local_norms: bool = False,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"invalid learning rate {lr}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_trust_ratio=max_trust_ratio, adapt=True)
        super().__init__(params, defaults)
        self.shard_local_norms = shard_local_norms

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One LAMB step over all parameters that have a gradient."""
        loss, grads = closure_and_grads(self, closure)
        todo: list[tuple[dict[str, Any], Tensor, Tensor, Tensor]] = []  # group, param, local w, local u
        for group, p, g in grads:
            b1, b2 = group["betas"]
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            t = state["step"].item()
            m, v = local(state["exp_avg"]), local(state["exp_avg_sq"])
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            bc1, bc2 = (1 - b1**t, 1 - b2**t) if group["bias_correction"] else (1.0, 1.0)
            u = (m / bc1).div_((v / bc2).sqrt_().add_(group["eps"]))
            w = local(p)
            if group["weight_decay"] != 0:
                u.add_(w, alpha=group["weight_decay"])
            todo.append((group, p, w, u))
        adapted = [item for item in todo if item[0]["adapt"]]
        w_norms, u_norms = pair_norms(adapted, shard_local=self.shard_local_norms)
        ratios = iter(_trust_ratios(w_norms, u_norms, adapted))
        for group, _, w, u in todo:
            if group["adapt"]:
                u.mul_(next(ratios).to(u.dtype))
            w.add_(u, alpha=-group["lr"])
        return loss


def _trust_ratios(w_norm: Tensor, u_norm: Tensor, adapted: list[tuple[dict[str, Any], ...]]) -> Tensor:
    """``||w|| / ||u||`` per parameter, 1 where either norm is 0, capped by the group's max_trust_ratio."""
    ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
    caps = [item[0]["max_trust_ratio"] for item in adapted]
    if any(c is not None for c in caps):
        cap = torch.tensor([float("inf") if c is None else c for c in caps], dtype=ratio.dtype)
        ratio = torch.minimum(ratio, cap.to(ratio.device))
    return ratio


@dataclass
class LambConfig:
    """LAMB: Adam with a layer-wise trust ratio, for large batches."""

    name: str = "lamb"
    """Registry name."""
    lr: float = 1e-3
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Decay rates [beta1, beta2] of the first and second moment averages."""
    eps: float = 1e-6
    """Added to the root of the second moment before dividing."""
    weight_decay: float = 0.01
    """Decoupled weight decay, added to the update before the trust ratio is taken."""
    bias_correction: bool = True
    """Divide the moments by (1 - beta^t) as Adam does."""
    max_trust_ratio: float | None = None
    """Cap of the trust ratio ||w|| / ||u||; null: no cap (the paper's identity scaling)."""
    exclude_bias_and_norm: bool = True
    """Biases and norm weights (ndim < 2) get no weight decay and no trust ratio."""

    def validate(self) -> None:
        """Reject values outside the ranges the update rule is defined for."""
        checks.positive("optim.lr", self.lr)
        checks.betas("optim.betas", self.betas)
        checks.positive("optim.eps", self.eps)
        checks.non_negative("optim.weight_decay", self.weight_decay)
        if self.max_trust_ratio is not None and not self.max_trust_ratio > 0:
            raise ConfigError("optim.max_trust_ratio", self.max_trust_ratio, "a positive number, or null")


@OPTIMIZERS.register("lamb", LambConfig)
def build_lamb(cfg: LambConfig, model: nn.Module) -> Lamb:
    """LAMB over the (possibly wrapped) model's trainable parameters."""
    groups = param_groups(model, cfg.weight_decay, cfg.exclude_bias_and_norm, adapt=True)
    return Lamb(groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps,
                weight_decay=cfg.weight_decay, bias_correction=cfg.bias_correction,
                max_trust_ratio=cfg.max_trust_ratio)
