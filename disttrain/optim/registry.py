"""Optimiser registry: configs name an optimiser (``optim.name``) and ``build_optimizer`` builds it.

Each optimiser module registers a builder ``(cfg, model) -> Optimizer`` together with its config schema,
a dataclass whose ``validate()`` rejects impossible values before any rank starts. The registry lives apart
from the package so that the optimiser modules can register in it while the package imports them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from disttrain.registry import Registry

OPTIMIZERS: Registry[torch.optim.Optimizer] = Registry("optim")
"""Built-in optimisers by name: each optimiser module adds its own when it is imported."""


def build_optimizer(cfg: Any, model: nn.Module) -> torch.optim.Optimizer:
    """Build the optimiser ``cfg`` names over ``model``'s trainable parameters (``cfg`` was validated with the run)."""
    return OPTIMIZERS.build(cfg, model)
