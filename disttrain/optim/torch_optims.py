"""The optimisers torch ships: AdamW and SGD, with the shared parameter groups."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from disttrain import checks
from disttrain.errors import ConfigError
from disttrain.optim.groups import kernel_options, param_groups
from disttrain.optim.registry import OPTIMIZERS


@dataclass
class AdamWConfig:
    """AdamW (torch.optim.AdamW): Adam with decoupled weight decay."""

    name: str = "adamw"
    """Registry name."""
    lr: float = 1e-3
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Decay rates [beta1, beta2] of the first and second moment averages."""
    eps: float = 1e-8
    """Added to the root of the second moment before dividing."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    exclude_bias_and_norm: bool = True
    """Biases and norm weights (ndim < 2) get no weight decay."""
    fused: bool = True
    """torch's fused AdamW kernel where it applies (one device type, float parameters, plain tensors or DTensors
    alone); false: torch's default per-tensor kernels everywhere (their rounding differs in the last bits)."""

    def validate(self) -> None:
        """Reject values outside the ranges the update rule is defined for."""
        checks.positive("optim.lr", self.lr)
        checks.betas("optim.betas", self.betas)
        checks.positive("optim.eps", self.eps)
        checks.non_negative("optim.weight_decay", self.weight_decay)


@OPTIMIZERS.register("adamw", AdamWConfig)
def build_adamw(cfg: AdamWConfig, model: nn.Module) -> torch.optim.AdamW:
    """AdamW over the (possibly wrapped) model's trainable parameters, with torch's fused kernel where it applies."""
    groups = param_groups(model, cfg.weight_decay, cfg.exclude_bias_and_norm)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, **(kernel_options(groups) if cfg.fused else {}))


@dataclass
class SGDConfig:
    """SGD with momentum (torch.optim.SGD)."""

    name: str = "sgd"
    """Registry name."""
    lr: float = 0.1
    """Peak learning rate."""
    momentum: float = 0.9
    """Momentum, in [0, 1); 0: plain SGD."""
    nesterov: bool = False
    """Nesterov momentum (needs momentum > 0)."""
    weight_decay: float = 5e-4
    """L2 weight decay, added to the gradient."""
    exclude_bias_and_norm: bool = True
    """Biases and norm weights (ndim < 2) get no weight decay."""

    def validate(self) -> None:
        """Reject values outside the ranges the update rule is defined for."""
        checks.positive("optim.lr", self.lr)
        checks.unit_interval("optim.momentum", self.momentum)
        checks.non_negative("optim.weight_decay", self.weight_decay)
        if self.nesterov and self.momentum == 0:
            raise ConfigError("optim.nesterov", self.nesterov, "false when optim.momentum is 0")


@OPTIMIZERS.register("sgd", SGDConfig)
def build_sgd(cfg: SGDConfig, model: nn.Module) -> torch.optim.SGD:
    """SGD over the (possibly wrapped) model's trainable parameters, as torch decides (its fused SGD has no
    DTensor rule, and its rounding moved a parameter server's curve 1e-6 from DDP's)."""
    return torch.optim.SGD(
        param_groups(model, cfg.weight_decay, cfg.exclude_bias_and_norm),
        lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay,
    )
