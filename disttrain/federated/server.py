"""The server's step on the clients' aggregated update: FedAvg's mean, FedAdam and FedYogi.

A ``torch.optim.Optimizer`` over the global model's parameters, so the strategy checkpoints its moments with
every other optimiser state. Each parameter's ``grad`` holds the negated aggregate update ``-delta`` (the
pseudo-gradient), so ``lr = 1`` under ``avg`` makes the global model the clients' weighted mean.
The adaptive rules are Reddi et al. (2021) as Flower implements them (its bias correction of FedAdam's step
included), which the tests check against Flower's strategies.
"""

from __future__ import annotations

import math
from typing import Any

import torch

RULES = {"fedavg": "avg", "fedprox": "avg", "fedadam": "adam", "fedyogi": "yogi"}


class ServerOptimizer(torch.optim.Optimizer):
    """``rule``: avg (``w += lr * delta``), adam or yogi (``w += lr_t * m / (sqrt(v) + tau)``)."""

    def __init__(self, params: Any, rule: str, lr: float, beta1: float = 0.9, beta2: float = 0.99,
                 tau: float = 1e-3) -> None:
        if rule not in ("avg", "adam", "yogi"):
            raise ValueError(f"unknown server rule {rule!r}")
        super().__init__(params, {"rule": rule, "lr": lr, "beta1": beta1, "beta2": beta2, "tau": tau})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Apply the aggregated update held (negated) in each parameter's ``grad``."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            rule, lr, beta1, beta2, tau = (group[k] for k in ("rule", "lr", "beta1", "beta2", "tau"))
            for param in group["params"]:
                if param.grad is None:
                    continue
                delta = -param.grad
                if rule == "avg":
                    param.add_(delta, alpha=lr)
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float64)
                    state["m"] = torch.zeros_like(param)
                    state["v"] = torch.zeros_like(param)
                state["step"] += 1
                rounds = float(state["step"])
                m, v = state["m"], state["v"]
                m.mul_(beta1).add_(delta, alpha=1 - beta1)
                squared = delta * delta
                if rule == "adam":
                    v.mul_(beta2).add_(squared, alpha=1 - beta2)
                    # Flower's FedAdam counts rounds from 1 and corrects with round + 1
                    step_size = lr * math.sqrt(1 - beta2 ** (rounds + 1)) / (1 - beta1 ** (rounds + 1))
                else:
                    v.sub_(squared * torch.sign(v - squared), alpha=1 - beta2)
                    step_size = lr
                param.add_(m / (v.sqrt() + tau), alpha=step_size)
